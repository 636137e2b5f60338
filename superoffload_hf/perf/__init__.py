"""Performance: measure (probe), predict and choose (cost_model), and look (timeline).

* `cost_model`: pure. `choose_plan(Machine, Workload) -> Plan` (bucket size, device-resident
  buckets, cast location, speculation, predicted step time); `predict(...)` for one layout.
* `probe`: measures a machine through the device seam and the host Adam back end, and a recipe's
  model; `superoffload probe` prints the plan the cost model derives.
* `activation_memory`: pure. `estimate_activations(config, micro_batch, seq_len, dtype_bytes, ...)`
  -> the device activation bytes of a Llama-style decoder by term (checkpointing, tiled loss and
  MLP, activation offload, sequence parallel), printed by the dry run.
* `timeline`: `Timeline` records spans and instants of chosen steps and writes a Chrome trace and
  a PNG.
"""
