"""The cost model (plan.cost_model) fed with what the first step measured: the machine (link
bandwidth, host and device Adam rates, free device memory) and the workload (forward and
backward time, when each gradient arrived). `Layout.learned` (plan/layout.py) uses it for the "auto"
bucket size and device-resident buckets on an accelerator, and keeps its predicted step time,
which the engine reports beside the measured one.

The measurements are host-clock timings of one step (the first, which does not speculate) and
a few one-off copies and a device Adam call: good enough to rank layouts, not a benchmark.
`superoffload probe` measures the same quantities carefully.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from superoffload_hf.engine.measure import FireLog
from superoffload_hf.plan.cost_model import Bandwidth, Machine, Workload

PROBE_ELEMENTS = 1 << 20  # one-off measurements at construction or after the first step: 4 MB


def measure_device_adam_rate(runtime, elements: int = PROBE_ELEMENTS) -> float:
    """Elements per second of the engine's device-side Adam (device-resident buckets)."""
    from superoffload_hf.host import reference

    p, m, v, g = (runtime.device_empty(elements, torch.float32).fill_(0.5) for _ in range(4))
    done = runtime.new_event()

    def once() -> float:
        start = time.perf_counter()
        reference.adam_step_(p, m, v, g, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                             adamw=True, bias_correction=True, grad_scale=1.0)
        done.record(runtime.current_stream())
        done.synchronize()  # a one-off measurement, between steps
        return time.perf_counter() - start

    once()  # warm-up
    return elements / max(once(), 1e-9)


def measured_machine(transfer, host_elements: int, host_seconds: float, lowp_bytes: int,
                     h2d_gbps: Optional[float]) -> Machine:
    runtime = transfer.runtime
    free, _ = runtime.memory_info()
    # the probes' device buffers take at most a quarter of what is free (weight-flow exists for
    # devices the weights do not fit)
    probe_elements = max(1024, min(PROBE_ELEMENTS, int(free) // 64))
    if h2d_gbps is None:
        h2d_gbps = transfer.measure_h2d_gbps(megabytes=probe_elements * 4 / 2**20, repeats=2)
    link = Bandwidth.constant(max(h2d_gbps, 1e-3))
    host_rate = host_elements / host_seconds if host_seconds > 0 else 1e9
    return Machine(name=runtime.name, h2d=link, d2h=link, host_adam_rate=host_rate,
                   host_adam_rate_busy=host_rate,  # the first step's host work ran after backward, alone
                   device_adam_rate=measure_device_adam_rate(runtime, probe_elements), device_free_bytes=float(free),
                   host_is_device=transfer.runtime.device.type == "cpu", lowp_bytes=lowp_bytes)


def measured_workload(log: FireLog, numels: list[int], step_seconds: float, rollback_rate: float) -> Workload:
    """Backward: from the first to the last gradient hook; forward: the rest of the step."""
    total = sum(numels)
    backward = log.seconds
    profile, done = [], 0
    for index in log.order:
        done += numels[index]
        when = log.first_fired.get(index)
        if when is not None and backward > 0:
            profile.append((done / total, (when - log.first_time) / backward))
    return Workload(num_params=max(total, 1), forward_s=max(step_seconds - backward, 0.0), backward_s=backward,
                    ready_profile=tuple(profile), rollback_rate=min(max(rollback_rate, 0.0), 1.0))
