"""Host Adam back ends: the JIT-built GraceAdam kernel, or the PyTorch reference.

PLACEHOLDER INTERFACE (being replaced by the kernel work): only the reference back end exists
here so far. The public surface below is the contract the engine codes against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from superoffload_hf import reference


@dataclass
class HostAdam:
    """One host Adam back end. `name` is "cpp" or "reference"; `isa` the instruction set in use."""

    name: str
    isa: str
    threads: int

    def adam_step_(self, param, exp_avg, exp_avg_sq, grad, **hyper) -> None:
        reference.adam_step_(param, exp_avg, exp_avg_sq, grad, **hyper)

    def adam_rollback_(self, param, exp_avg, exp_avg_sq, grad, **hyper) -> None:
        reference.adam_rollback_(param, exp_avg, exp_avg_sq, grad, **hyper)

    def sum_squares(self, grad: torch.Tensor) -> float:
        return reference.sum_squares(grad)

    def set_num_threads(self, n: int) -> None:
        self.threads = n


def get_host_adam(mode: str = "auto", threads: Optional[int] = None, isa: Optional[str] = None) -> HostAdam:
    return HostAdam(name="reference", isa="none", threads=threads or 1)
