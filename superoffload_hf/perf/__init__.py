"""Performance measurement: measure (probe) and look (timeline). The cost model and the activation
estimate are pure decisions and live in plan/ (plan/cost_model.py, plan/activations.py).

* `probe`: measures a machine through the device seam and the host Adam back end, and a recipe's
  model (the `superoffload probe` command that prints them is superoffload_hf/cli.py's).
* `timeline`: `Timeline` records spans and instants of chosen steps and writes a Chrome trace and
  a PNG.
"""
