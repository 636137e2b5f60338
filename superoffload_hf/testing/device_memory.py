"""The simulated device's memory: a budget (bytes; None: the fake device's 80 GiB), what is
allocated now and its peak, as torch's `memory_allocated` / `max_memory_allocated` report them.

What counts (sim.py keeps the records): every runtime allocation (`device_empty`) and the
storage of every adopted parameter, each storage once, at its current size, so a storage
resized to 0 (weight-flow's release, as FSDP frees a parameter) has returned its bytes. A new
block that would take the total past the budget raises `torch.OutOfMemoryError`, as CUDA's
caching allocator does. Activations and autograd's transients (CPU tensors the simulator does
not see) are not counted.

Accounting only: the tensors are ordinary CPU tensors.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from superoffload_hf.testing.host_memory import bytes_from_env

DEVICE_MEMORY_ENV_VAR = "SUPEROFFLOAD_SIM_DEVICE_MEMORY"  # bytes, for the shared simulated device
TOTAL_BYTES = 80 * 2**30  # the fake device's memory when no budget is set


def device_budget_from_env(environ=os.environ) -> Optional[int]:
    return bytes_from_env(DEVICE_MEMORY_ENV_VAR, "the simulated device's 80 GiB", environ)


class SimDeviceMemory:
    """The caller (SimRuntime) holds its lock around every call."""

    def __init__(self, budget_bytes: Optional[int] = None):
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"`device_budget_bytes` is {budget_bytes!r}; expected None or an int >= 0.")
        self.budget_bytes = budget_bytes
        self.allocated = 0
        self.peak = 0

    @property
    def total(self) -> int:
        return TOTAL_BYTES if self.budget_bytes is None else self.budget_bytes

    def admit(self, nbytes: int, what: str) -> None:
        """Raise torch.OutOfMemoryError unless `nbytes` more fit."""
        if self.allocated + nbytes > self.total:
            raise torch.OutOfMemoryError(
                f"Simulated device out of memory: {what} needs {nbytes} bytes, {self.allocated} of the "
                f"{self.total}-byte device memory are allocated (peak {self.peak}). Raise "
                f"`SimRuntime(device_budget_bytes=...)` / {DEVICE_MEMORY_ENV_VAR}, or hold less on the "
                "device (`weights: flow` streams the weights from the host).")

    def set_allocated(self, nbytes: int) -> None:
        self.allocated = nbytes
        self.peak = max(self.peak, nbytes)

    def reset_peak(self) -> None:
        """Start the peak again from what is allocated now (torch's reset_peak_memory_stats)."""
        self.peak = self.allocated
