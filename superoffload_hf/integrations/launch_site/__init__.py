"""Holds the `sitecustomize.py` that `superoffload launch` puts first on PYTHONPATH (see autopatch.py)."""
