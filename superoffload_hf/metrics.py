"""OffloadCounters: what the engine did, for logs and benchmarks.

Step counts are per optimizer step (`step()` call); a step in which several buckets rolled
back counts once in `rollbacks`. A field written from both the training thread and the host worker
(the byte counts: weight-flow's fetches and gradient copies on the one, copy-backs on the other) is
updated through `add`, under a lock; the others are written by one thread only.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class OffloadCounters:
    steps: int = 0
    """Optimizer steps applied (skipped steps are not counted; they count in `skips`)."""
    speculative_steps: int = 0
    """Steps in which at least one bucket was stepped speculatively during backward."""
    rollbacks: int = 0
    """Speculative steps in which at least one bucket had to be rolled back (clipping, a
    non-finite gradient, hyperparameters changed between backward and step(), or a gradient
    that arrived after its bucket was launched)."""
    replays: int = 0
    """Steps in which at least one rolled-back bucket was stepped again (e.g. clipped)."""
    skips: int = 0
    """Steps skipped because the gradients were not finite."""
    host_step_seconds: float = 0.0
    """Wall time the host worker spent in the host Adam kernel (steps, rollbacks, norms)."""
    step_seconds: float = 0.0
    """Wall time of the last step, from the previous `step()` call to this one."""
    predicted_step_seconds: float = 0.0
    """The cost model's prediction of a step's time for the layout in use (set after the first
    step; engine/learn.py), to read beside `step_seconds`."""
    bytes_d2h: int = 0
    """Gradient bytes moved from the device to the host."""
    bytes_h2d: int = 0
    """Parameter bytes moved from the host to the device (copy-backs, and weight-flow's fetches)."""
    weight_fetches: int = 0
    """Weight-flow (config `weights`): units fetched to the device (for a forward, a backward, a
    state_dict); 0 when the weights are stationary."""
    bytes_fetched: int = 0
    """The bytes of those fetches (also counted in `bytes_h2d`)."""
    device_wait_seconds: float = 0.0
    """Seconds the device sat idle waiting for the host: on an accelerator, the time the compute
    stream stalled at the next forward's per-bucket waits for copy-backs, measured with timing
    events recorded just before and after each wait (read later, never blocking); on the
    synchronous CPU device, where the training thread is the device, every second it blocked on
    the host worker."""
    thread_wait_seconds: float = 0.0
    """Seconds the training thread blocked on the host worker (bucket norms at step(), a busy
    bucket before its next gradients). On an accelerator this includes waiting for gradient
    copies, i.e. for the device to finish backward: it is not device idle time."""

    _lock: ClassVar[threading.Lock] = threading.Lock()  # one for all instances: not a field (asdict, pickling)

    def add(self, name: str, amount) -> None:
        """`self.<name> += amount`, safe against another thread adding to the same field."""
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def counts(self) -> dict:
        """The counts alone (what a checkpoint keeps): the wall-clock fields (seconds) describe
        this process's run, and would make two state dicts of the same training differ."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.type in ("int", int)}

    def load_dict(self, values: dict) -> None:
        for f in dataclasses.fields(self):
            if f.name in values:
                setattr(self, f.name, type(f.default)(values[f.name]))
