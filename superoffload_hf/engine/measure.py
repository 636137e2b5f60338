"""What the engine measures for its layout decisions (plan/layout.py decides from them, purely):
`machine_facts` (the link and the device's memory, once, before anything is allocated) and
`FireLog` (what the gradient hooks did during the first step, on the device's clock where it has
one), which `Layout.learned` and engine/learn.py read."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Optional

from superoffload_hf.plan.flow import device_margin
from superoffload_hf.plan.layout import MachineFacts


class FireLog:
    """What the hooks did during the first step.

    Times are host-clock seconds until `use_device_times()`: on an asynchronous device the hooks
    run when autograd *issues* the work (on CUDA up to ~1000 kernels ahead of the device), so the
    host clock measures the CPU. There, each hook call also records a timing event on the current
    (compute) stream, and `use_device_times()` replaces the times by the device's once those
    events have completed."""

    def __init__(self, num_params: int, runtime=None):
        self.order: list[int] = []
        self.first_fired: dict[int, float] = {}  # index -> when its first gradient arrived
        self.counts = [0] * num_params
        self.first_time: Optional[float] = None
        self.last_time: Optional[float] = None
        self._runtime = runtime if runtime is not None and runtime.is_async else None
        self._first_events: dict = {}  # index -> timing event recorded at its first gradient
        self._last_event = None

    def record(self, index: int) -> None:
        now = time.perf_counter()
        event = None
        if self._runtime is not None:  # marks where the device's compute stream is at this hook
            event = self._runtime.new_event(timing=True)
            event.record(self._runtime.current_stream())
            self._last_event = event
        if self.counts[index] == 0:
            self.order.append(index)
            self.first_fired[index] = now
            if event is not None:
                self._first_events[index] = event
        self.counts[index] += 1
        self.first_time = now if self.first_time is None else self.first_time
        self.last_time = now

    def use_device_times(self) -> bool:
        """Replace the host times by device seconds since the first gradient's event, when every
        event has completed (read without blocking: the caller waited for the compute stream
        since). Returns whether it did."""
        if not self._first_events:
            return False
        events = [*self._first_events.values(), self._last_event]
        if not all(e.query() for e in events):
            return False
        start = self._first_events[self.order[0]]
        self.first_fired = {i: start.elapsed_time(e) / 1000.0 for i, e in self._first_events.items()}
        self.first_time, self.last_time = 0.0, start.elapsed_time(self._last_event) / 1000.0
        self._first_events, self._last_event = {}, None
        return True

    def deferred(self) -> list[int]:
        fired = [c for c in self.counts if c > 0]
        typical = Counter(fired).most_common(1)[0][0] if fired else 1
        return [i for i, c in enumerate(self.counts) if c != typical]

    @property
    def seconds(self) -> float:
        return (self.last_time - self.first_time) if self.first_time is not None else 0.0


def machine_facts(runtime, transfer, config, shard_world: Optional[int] = None) -> MachineFacts:
    """Measure what the layout needs, once, before anything is allocated: the link (where cast
    "auto" or weight-flow's prefetch depth needs it, on an accelerator) and the device's memory."""
    facts = MachineFacts(device_type=runtime.device.type, host_is_device=runtime.host_is_device,
                         asynchronous=transfer.is_async, pin=transfer.pin_memory,
                         rounds_pinned=runtime.pinned_rounds_to_power_of_two, shard_world=shard_world,
                         params_counted=getattr(runtime, "counts_params_at_adopt", False))
    changes = {}
    if facts.accelerator and (config.cast == "auto" or config.weights != "stationary"):
        changes["h2d_gbps"] = transfer.measure_h2d_gbps()
    if not runtime.host_is_device:
        changes["free_bytes"], changes["total_bytes"] = (int(b) for b in runtime.memory_info())
        changes["margin_bytes"] = device_margin(changes["total_bytes"], runtime.allocator_slack())
    return dataclasses.replace(facts, **changes)
