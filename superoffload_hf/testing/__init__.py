"""Test support: the simulated asynchronous device (sim.py)."""

from superoffload_hf.testing.sim import SimRaceError, SimRuntime

__all__ = ["SimRaceError", "SimRuntime"]
