"""The engine's layout decisions: device, dtypes, cast location, bucket size, device buckets,
and the re-plan after the first step from what the hooks actually did.

Rules (the "auto" choices of SuperOffloadConfig):

* cast "auto": "device" when the device is the CPU; on CUDA, "device" (move fp32, cast on the
  device) when a page-locked host-to-device copy runs at >= FAST_LINK_GBPS (NVLink-C2C class),
  else "host" (the kernel writes the low-precision copy; half the bytes cross the link).
* device_buckets and bucket_size_mb "auto": 0 device buckets when the device is the CPU, and
  (one process) buckets of 32 MB however small the model: host jobs run inline after backward
  there, so more buckets overlap nothing and each costs Python time per step. On an
  accelerator both are chosen after the first step by the cost model (perf/cost_model.py) fed
  with that step's host-clock measurements (engine/autoplan.py: backward time from the gradient
  hooks, host Adam rate, link bandwidth, device Adam rate): at most half of the buckets stay on
  the device (offloading stays the point), and only as many of the last buckets as fit, with
  their real sizes, in a quarter of the free device memory (16 bytes per element: fp32 master,
  moments and gradient, plus the chunked float64 norm transient). Before the first step the
  bucket size is 32 MB (on an accelerator, smaller for a small model: at least 4 buckets).
* The first step never speculates: it records the order in which gradients arrive and how often
  each parameter's hook fires. The plan is rebuilt in that order; parameters that fire more or
  less often than most ("deferred": tied or reused parameters, unused ones) get non-speculative
  buckets of their own.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Optional

import torch

from superoffload_hf.engine.memory import BufferPolicy, FootprintRow, footprint
from superoffload_hf.engine.plan import AUTO_MIN_BUCKETS, BucketPlan, auto_bucket_numel

logger = logging.getLogger("superoffload_hf")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FAST_LINK_GBPS = 100.0
DEVICE_MEMORY_FRACTION = 0.25
DEVICE_BYTES_PER_ELEMENT = 16


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


class LayoutBuilder:
    def __init__(self, params: list[torch.Tensor], groups: list[dict], config, inline_host: bool = False):
        """`inline_host`: the device is the CPU and host jobs run inline (one process)."""
        self.config = config
        self.params = params
        self.device = common_device(params)
        self.dtype = DTYPES[config.device_dtype]
        self.shapes = [tuple(p.shape) for p in params]
        index_of = {p: i for i, p in enumerate(params)}
        self.group_indices = [[index_of[p] for p in g["params"]] for g in groups]
        self.group_labels = [_label(g) for g in groups]
        self.bucket_numel = auto_bucket_numel(config.bucket_size_mb, sum(p.numel() for p in params),
                                              min_buckets=1 if inline_host else AUTO_MIN_BUCKETS)
        self.h2d_gbps: Optional[float] = None  # measured for cast "auto" (and reused by autoplan)
        # weight-flow (engine/flow.py) decided: the host keeps the device's copy (cast "host" or
        # fp32), no parameter aliases its master, no bucket is device-resident
        self.flow = False

    def plan(self, device_buckets: int, ready_order=None, deferred=()) -> BucketPlan:
        return BucketPlan.build(self.shapes, self.group_indices, bucket_numel=self.bucket_numel,
                                device_buckets=device_buckets, ready_order=ready_order,
                                deferred=deferred, group_labels=self.group_labels, align=self.align)

    @property
    def compact(self) -> bool:
        return self.config.state_precision != "fp32"

    @property
    def align(self) -> int:
        """Compact state: slots start at multiples of the group (memory.BufferPolicy.align)."""
        from superoffload_hf.host.compact import COMPACT_GROUP

        return COMPACT_GROUP if self.compact else 1

    def initial_plan(self) -> BucketPlan:
        n = self.config.device_buckets
        return self.plan(0 if n == "auto" else n)

    def learned_plan(self, log: FireLog, choice, free_device_bytes: int) -> BucketPlan:
        """The plan in the order the first step's hooks fired. `choice`: the cost model's plan
        (engine/autoplan.py) on an accelerator, None on the CPU; it sets the "auto" bucket size
        and device-resident buckets, the latter only as many of the last buckets as fit, with
        their real sizes, in DEVICE_MEMORY_FRACTION of the free device memory."""
        deferred = log.deferred()
        if choice is not None and self.config.bucket_size_mb == "auto":
            self.bucket_numel = choice.bucket_numel
        n = self.config.device_buckets
        if n == "auto":
            n = 0
            if choice is not None and not self.flow:
                draft = self.plan(0, log.order, deferred)
                affordable = device_buckets_within(draft, int(free_device_bytes * DEVICE_MEMORY_FRACTION))
                n = max(0, min(choice.device_buckets, affordable, len(draft.buckets) // 2))
                logger.info("SuperOffload auto layout from the cost model: %d buckets of <= %d elements, %d "
                            "device-resident (memory allows %d)", len(draft.buckets), self.bucket_numel, n,
                            affordable)
        return self.plan(n, log.order, deferred)

    # ---- dtypes and buffers ---------------------------------------------------------------

    def resolve_cast(self, transfer) -> str:
        if self.flow and self.dtype != torch.float32 and not self.compact:  # (compact: its bf16 part flows)
            if self.config.cast == "device":
                raise ValueError(
                    f"`weights: flow` with `cast: device` and `device_dtype: {self.config.device_dtype}`: weight-flow "
                    "streams the host's low-precision copy, which only cast \"host\" keeps. Set `cast: host` "
                    "(or \"auto\"), or `weights: stationary`.")
            return "host"  # the host Adam writes the low-precision copy the units stream from
        if self.config.cast != "auto":
            return self.config.cast
        if not transfer.is_async or self.device.type == "cpu":  # the simulated device: host memory
            return "device"
        gbps = self.h2d_gbps = transfer.measure_h2d_gbps()
        cast = "device" if gbps >= FAST_LINK_GBPS else "host"
        logger.info("SuperOffload cast auto: host-to-device %.1f GB/s -> cast on the %s", gbps, cast)
        return cast

    def link_dtype(self, cast: str) -> torch.dtype:
        """The dtype in which gradients cross to the host."""
        return torch.float32 if cast == "device" else self.dtype

    def lowp_dtype(self, cast: str) -> Optional[torch.dtype]:
        """The dtype of the host-side low-precision copy the kernel writes, if any (none under
        compact state: the bf16 part of the master is that copy)."""
        return self.dtype if cast == "host" and self.dtype != torch.float32 and not self.compact else None

    def buffer_policy(self, cast: str, pin: bool, rounds_pinned: bool,
                      accumulation_steps: Optional[int] = None, host_is_device: bool = False,
                      shard_world: Optional[int] = None) -> BufferPolicy:
        """Which buffers the buckets get, in which dtypes, page-locked or not, and how many
        elements of each host bucket (memory.py). `shard_world`: the ranks that share each host
        bucket under data parallelism (engine/dp.py), None in one process."""
        steps = self.config.gradient_accumulation_steps if accumulation_steps is None else accumulation_steps
        return BufferPolicy(device_dtype=self.dtype, link_dtype=self.link_dtype(cast),
                            lowp_dtype=self.lowp_dtype(cast), pin=pin,
                            # compact state: rollback restores the pre-step bytes (not invertible),
                            # kept only where a step may be speculative
                            snapshot=self.config.rollback == "snapshot" or (
                                self.compact and self.config.speculation != "off"), micro_batches=steps,
                            rounds_pinned=rounds_pinned, shard_world=shard_world,
                            state_precision=self.config.state_precision,
                            # a rank's master holds only its shard of each bucket: never aliased
                            params_alias_masters=(host_is_device and self.dtype == torch.float32
                                                  and shard_world is None and not self.flow))

    def cast_params_in_place(self) -> None:
        for p in self.params:
            if p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)


def device_bucket_bytes(numel: int) -> int:
    """Device bytes a device-resident bucket of `numel` elements holds at rest (fp32 master,
    moments and gradient) plus its step's transients (the chunked float64 norm)."""
    from superoffload_hf.engine.stepper import NORM_CHUNK

    return DEVICE_BYTES_PER_ELEMENT * numel + 8 * min(numel, NORM_CHUNK)


def device_buckets_within(plan: BucketPlan, budget_bytes: int) -> int:
    """How many of the plan's last buckets (the device-resident candidates, with their real
    sizes: the embedding is often alone in the last one) fit in `budget_bytes`."""
    used, count = 0, 0
    for bucket in reversed(plan.buckets):
        used += device_bucket_bytes(bucket.numel)
        if used > budget_bytes:
            break
        count += 1
    return count


def common_device(params: list[torch.Tensor]) -> torch.device:
    if not params:
        raise ValueError("The optimizer got an empty parameter list; pass the model's parameters.")
    device = params[0].device
    for p in params:
        if p.device != device:
            raise ValueError(
                f"Parameters are on two devices, {device} and {p.device}; SuperOffload needs every "
                "parameter on one device. Move the model with `model.to(device)` before building the optimizer."
            )
        if not p.is_floating_point():
            raise TypeError(f"A parameter has dtype {p.dtype}; SuperOffload optimizes floating-point parameters only.")
    return device


def _label(group: dict) -> str:
    return (f"lr={group['lr']:g} betas={tuple(group['betas'])} eps={group['eps']:g} "
            f"weight_decay={group['weight_decay']:g} ({len(group['params'])} params)")


def estimate(params: list[torch.Tensor], groups: list[dict], config, accelerator: bool,
             accumulation_steps: int = 1, shard_world: Optional[int] = None) -> tuple[BucketPlan, list[FootprintRow]]:
    """The first plan and what it allocates, without a device or a byte of state: `params` may
    live on the meta device (`superoffload train --dry-run`). On an accelerator, cast "auto" is
    taken as "host" (a PCIe-class link) and device_buckets "auto" as 0 (decided after step 1;
    under data parallelism the first plan is kept). `shard_world`: data parallel over that many
    ranks (the rows are one rank's), None for one process."""
    plan, policy = estimate_layout(params, groups, config, accelerator, accumulation_steps, shard_world)
    return plan, footprint(plan, policy)


def estimate_layout(params: list[torch.Tensor], groups: list[dict], config, accelerator: bool,
                    accumulation_steps: int = 1, shard_world: Optional[int] = None) -> tuple[BucketPlan, BufferPolicy]:
    """The first plan and the buffer policy of `estimate` (the dry run also decides the snapshot
    trade from them, engine/snapshot_trade.py)."""
    layout = LayoutBuilder(params, groups, config, inline_host=not accelerator and shard_world is None)
    cast = config.cast if config.cast != "auto" else ("host" if accelerator else "device")
    pin = accelerator and config.pin_memory in (True, "auto")  # as Transfer decides
    policy = layout.buffer_policy(cast, pin, rounds_pinned=accelerator, accumulation_steps=accumulation_steps,
                                  host_is_device=not accelerator, shard_world=shard_world)
    return layout.initial_plan(), policy
