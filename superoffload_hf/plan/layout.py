"""The engine's layout decisions, as one frozen value (`Layout`, DESIGN.md section 6): device
dtype, cast location, state precision, bucket size and plan, device buckets, buffer policy and
which units' weights flow; computed once by `decide_layout` from the parameters, the config and
the machine's facts (engine/measure.py `machine_facts` measures them; nothing here calls the
device), and the re-plan after the first step from what the hooks actually did (`Layout.learned`).

Rules (the "auto" choices of SuperOffloadConfig):

* cast "auto": "device" when the device is the CPU; on CUDA, "device" (move fp32, cast on the
  device) when a page-locked host-to-device copy runs at >= FAST_LINK_GBPS (NVLink-C2C class),
  else "host" (the kernel writes the low-precision copy; half the bytes cross the link).
* device_buckets and bucket_size_mb "auto": 0 device buckets when the device is the CPU, and
  (one process) buckets of 32 MB however small the model: host jobs run inline after backward
  there, so more buckets overlap nothing and each costs Python time per step. On an
  accelerator both are chosen after the first step by the cost model (plan/cost_model.py) fed
  with that step's host-clock measurements (engine/learn.py: backward time from the gradient
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

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, TYPE_CHECKING, Mapping, Optional

import torch

from superoffload_hf.plan.memory import DTYPES, NORM_CHUNK, BufferPolicy, FootprintRow, footprint
from superoffload_hf.plan.buckets import AUTO_MIN_BUCKETS, BucketPlan, auto_bucket_numel

if TYPE_CHECKING:
    from superoffload_hf.plan.flow import FlowChoice, FlowPlan

logger = logging.getLogger("superoffload_hf")

FAST_LINK_GBPS = 100.0
DEVICE_MEMORY_FRACTION = 0.25
DEVICE_BYTES_PER_ELEMENT = 16


@dataclass(frozen=True)
class MachineFacts:
    """What the layout is decided from about this machine (engine/measure.py `machine_facts`
    measures it; the dry run states it). `free_bytes` / `total_bytes`: device memory (None where
    the device is the host: nothing to decide there); `params_counted`: `free_bytes` already
    excludes the model's weights (the simulated device counts a parameter from adopt() on; a real
    device holds the model now)."""

    device_type: str = "cpu"
    host_is_device: bool = True
    asynchronous: bool = False  # the transfer's copies are asynchronous (an accelerator, the simulator)
    pin: bool = False  # page-lock what crosses the link (Transfer.pin_memory)
    rounds_pinned: bool = False  # the runtime rounds a page-locked block up to a power of two
    shard_world: Optional[int] = None  # data parallel: ranks sharing each host bucket; None: one process
    h2d_gbps: Optional[float] = None  # measured page-locked host-to-device bandwidth (cast auto, flow)
    free_bytes: Optional[int] = None
    total_bytes: Optional[int] = None
    params_counted: bool = False
    margin_bytes: int = 0  # device memory `weights: auto` leaves free (plan/flow.py device_margin)

    @property
    def inline_host(self) -> bool:
        """The device is the CPU and host jobs run inline (one process)."""
        return self.host_is_device and self.shard_world is None

    @property
    def accelerator(self) -> bool:
        """A device with memory and a link of its own (not the CPU, not the simulator's host memory)."""
        return self.asynchronous and self.device_type != "cpu"


@dataclass(frozen=True)
class Layout:
    """What the engine does with each parameter, decided once (`decide_layout`) from the
    parameters, the config and the measured machine, and consumed by Engine.__init__ in one pass:
    the device dtype, where the cast happens, the host state's precision, the bucket plan (which
    parameters form which bucket, which buckets stay on the device), the buffer policy (which
    buffers exist, their dtypes, page-locked or not) and which units' weights flow from the host
    at which prefetch depth (engine/flow.py, plan/flow.py). Printed by the dry run and
    `describe()`, stored in checkpoints (`to_dict`), compared on load (`differences`). The plan
    changes after the first step (the order the hooks fired in): `learned` returns the new value."""

    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...], ...]  # parameter indices of each param group
    group_labels: tuple[str, ...]
    device_type: str
    device_dtype: torch.dtype
    cast: str  # "device" | "host"
    state_precision: str
    bucket_numel: int
    bucket_plan: BucketPlan
    policy: BufferPolicy
    flow: Optional[FlowPlan] = None  # None: every unit's weights stay on the device
    flow_choice: Optional[FlowChoice] = None  # why these units flow at this depth (weights "auto")
    h2d_gbps: Optional[float] = None  # measured at construction (reused by autoplan)

    # ---- the decisions, read by the parts ------------------------------------------------------

    @property
    def weights(self) -> str:
        return "stationary" if self.flow is None else "flow"

    @property
    def compact(self) -> bool:
        return self.state_precision != "fp32"

    @property
    def align(self) -> int:
        """Compact state: slots start at multiples of the group (memory.BufferPolicy.align)."""
        return self.policy.align

    @property
    def link_dtype(self) -> torch.dtype:
        """The dtype in which gradients cross to the host."""
        return self.policy.link_dtype

    def plan(self, device_buckets: int, ready_order=None, deferred=()) -> BucketPlan:
        """A plan of these parameters with this layout's bucket size and alignment."""
        return BucketPlan.build(self.shapes, self.groups, bucket_numel=self.bucket_numel,
                                device_buckets=device_buckets, ready_order=ready_order,
                                deferred=deferred, group_labels=self.group_labels, align=self.align)

    def with_plan(self, plan: BucketPlan) -> "Layout":
        return dataclasses.replace(self, bucket_plan=plan, bucket_numel=plan.bucket_numel)

    def learned(self, config, log, choice, free_device_bytes: int) -> "Layout":
        """The layout with the plan in the order the first step's hooks fired (`log`: what they
        did, engine/measure.py FireLog: its `order` and `deferred()`). `choice`: the cost
        model's plan (engine/learn.py) on an accelerator, None on the CPU; it sets the "auto"
        bucket size and device-resident buckets, the latter only as many of the last buckets as
        fit, with their real sizes, in DEVICE_MEMORY_FRACTION of the free device memory."""
        deferred = log.deferred()
        layout = self
        if choice is not None and config.bucket_size_mb == "auto":
            layout = dataclasses.replace(self, bucket_numel=choice.bucket_numel)
        n = config.device_buckets
        if n == "auto":
            n = 0
            if choice is not None and self.flow is None:
                draft = layout.plan(0, log.order, deferred)
                affordable = device_buckets_within(draft, int(free_device_bytes * DEVICE_MEMORY_FRACTION))
                n = max(0, min(choice.device_buckets, affordable, len(draft.buckets) // 2))
                logger.info("SuperOffload auto layout from the cost model: %d buckets of <= %d elements, %d "
                            "device-resident (memory allows %d)", len(draft.buckets), layout.bucket_numel, n,
                            affordable)
        return layout.with_plan(layout.plan(n, log.order, deferred))

    # ---- printing and checkpoints --------------------------------------------------------------

    def to_dict(self) -> dict:
        """Primitives only (a checkpoint loads with `weights_only=True`)."""
        p = self.policy
        return {"device_dtype": _dtype_name(self.device_dtype), "cast": self.cast,
                "state_precision": self.state_precision, "bucket_numel": self.bucket_numel,
                "buckets": len(self.bucket_plan.buckets), "device_buckets": self.bucket_plan.num_device_buckets,
                "link_dtype": _dtype_name(p.link_dtype), "pin": p.pin, "snapshot": p.snapshot,
                "micro_batches": p.micro_batches, "shard_world": p.shard_world, "weights": self.weights,
                "flowing": [u.name for u in self.flow.units] if self.flow is not None else [],
                "prefetch_depth": self.flow.depth if self.flow is not None else 0}

    def differences(self, saved: Mapping) -> list[str]:
        """"key: saved -> this" for every decision a saved layout (`to_dict`) made otherwise."""
        ours = self.to_dict()
        changed = []
        for key, value in ours.items():
            if key not in saved:
                continue
            theirs = saved[key]
            if key == "flowing":
                if list(theirs) != value:
                    changed.append(f"flowing units: {_units_note(theirs)} -> {_units_note(value)}")
            elif theirs != value:
                changed.append(f"{key}: {theirs} -> {value}")
        return changed

    def __str__(self) -> str:
        """(No ": " and no line starting with "- ": the dry run's output reads as YAML.)"""
        p, plan = self.policy, self.bucket_plan
        lines = [
            f"layout device {self.device_type} {_dtype_name(self.device_dtype)}, cast on the {self.cast}, gradients "
            f"cross in {_dtype_name(p.link_dtype)}, host state {self.state_precision}",
            f"  buckets {len(plan.buckets)} of <= {self.bucket_numel} elements, {plan.num_device_buckets} "
            f"device-resident" + (f", slots aligned to {plan.align}" if plan.align > 1 else ""),
            f"  buffers in {'page-locked' if p.pin else 'plain'} host memory, snapshot "
            f"{'yes' if p.snapshot else 'no'}, {p.micro_batches} micro-batch{'es' if p.micro_batches != 1 else ''}"
            + ("" if p.shard_world is None else f", host state sharded over {p.shard_world} ranks")
            + (", parameters alias their masters" if p.params_alias_masters else ""),
        ]
        if self.flow is None:
            lines.append("  weights stationary")
        else:
            names = [u.name for u in self.flow.units]
            lines.append(f"  weights flow, {len(names)} units ({_names(names)}), "
                         f"{len(self.flow.stationary)} stationary, prefetch depth {self.flow.depth}")
        if self.flow_choice is not None:
            lines.append("  " + self.flow_choice.describe())
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype).replace("torch.", ""))


def _names(names) -> str:
    names = list(names)
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _units_note(names) -> str:
    names = list(names)
    return "none" if not names else f"{len(names)} ({_names(names)})"


def decide_layout(params: list[torch.Tensor], groups: list[dict], config, machine: MachineFacts,
                  model: Optional[torch.nn.Module] = None, accumulation_steps: Optional[int] = None,
                  all_ranks_fit: Optional[Callable[[bool], bool]] = None) -> Layout:
    """The one layout value of a run (see `Layout` and the module docstring's rules). Pure given
    `machine`: no device calls, no allocation; `params` may live on the meta device (the dry run).
    `accumulation_steps`: micro-batches per step (default: the config's). `all_ranks_fit`: under
    data parallelism, the collective that makes the weights decision every rank's (flow_choice)."""
    dtype = DTYPES[config.device_dtype]
    index_of = {p: i for i, p in enumerate(params)}
    shapes = tuple(tuple(p.shape) for p in params)
    group_indices = tuple(tuple(index_of[p] for p in g["params"]) for g in groups)
    bucket_numel = auto_bucket_numel(config.bucket_size_mb, sum(p.numel() for p in params),
                                     min_buckets=1 if machine.inline_host else AUTO_MIN_BUCKETS)
    steps = config.gradient_accumulation_steps if accumulation_steps is None else accumulation_steps
    flow = config.weights == "flow"
    cast = resolve_cast(config, dtype, machine, flow)
    layout = Layout(shapes=shapes, groups=group_indices, group_labels=tuple(_label(g) for g in groups),
                    device_type=machine.device_type, device_dtype=dtype, cast=cast,
                    state_precision=config.state_precision, bucket_numel=bucket_numel,
                    bucket_plan=BucketPlan((), bucket_numel), h2d_gbps=machine.h2d_gbps,
                    policy=buffer_policy(config, dtype, cast, machine, flow, steps, shard_world=None))
    n = config.device_buckets
    initial = layout.plan(0 if n == "auto" else n)
    # decided from the stationary layout's memory (flow needs the model); data parallel: on every
    # rank's device, one decision for all (`all_ranks_fit`, a collective every rank calls)
    from superoffload_hf.plan.flow import decide_weights

    stationary = layout.policy if machine.shard_world is None else buffer_policy(
        config, dtype, cast, machine, False, steps, shard_world=machine.shard_world)
    if decide_weights(config.weights, initial, stationary, machine, model, config.device_activation_bytes,
                      all_ranks_fit) == "flow" and not flow:
        flow = True
        cast = resolve_cast(config, dtype, machine, flow)
    policy = buffer_policy(config, dtype, cast, machine, flow, steps, shard_world=machine.shard_world)
    flow_plan = choice = None
    if flow:
        # data parallel: every unit flows (a fetch is a collective: the ranks, whose free memory
        # may differ, must flow the same units)
        mode = "flow" if machine.shard_world is not None else config.weights
        flow_plan, choice = place_weights(config, model, params, initial, policy, machine, mode)
    return dataclasses.replace(layout, cast=cast, policy=policy, bucket_plan=initial, flow=flow_plan,
                               flow_choice=choice)


def place_weights(config, model, params, plan: BucketPlan, policy: BufferPolicy, machine: MachineFacts,
                  mode: Optional[str] = None):
    """(FlowPlan, FlowChoice) of a run whose weights flow: every unit under "flow"; under "auto" the
    fewest that fit the device's free memory with the engine's device buffers under `policy` and
    the activations (config `device_activation_bytes`). Prefetch depth 1 until the first step has
    measured the link and the forward (engine/core.py _learn)."""
    from superoffload_hf.plan.flow import choose_flow, flow_plan_of, plan_flow, unit_costs

    every = plan_flow(model, params, element_bytes=policy.device_dtype.itemsize)
    rows = footprint(plan, policy)
    weight_bytes = sum(r.nbytes for r in rows if r.what == "device params")
    # the units that cannot flow (frozen or foreign parameters) stay, with the engine's buffers
    other = (sum(r.nbytes for r in rows if r.place == "device" and r.what != "device params")
             + max(0, weight_bytes - every.nbytes) + config.device_activation_bytes)
    free = machine.free_bytes
    if free is not None and not machine.params_counted:  # a real device: the model is on it now
        free += weight_bytes
    choice = choose_flow(mode or config.weights, unit_costs(model, every.units), other_bytes=other,
                         activation_bytes=config.device_activation_bytes, free_bytes=free,
                         margin_bytes=machine.margin_bytes)
    return flow_plan_of(every, choice), choice


def resolve_cast(config, dtype: torch.dtype, machine: MachineFacts, flow: bool) -> str:
    if flow and dtype != torch.float32 and config.state_precision == "fp32":  # (compact: its bf16 part flows)
        if config.cast == "device":
            raise ValueError(
                f"`weights: flow` with `cast: device` and `device_dtype: {config.device_dtype}`: weight-flow "
                "streams the host's low-precision copy, which only cast \"host\" keeps. Set `cast: host` "
                "(or \"auto\"), or `weights: stationary`.")
        return "host"  # the host Adam writes the low-precision copy the units stream from
    if config.cast != "auto":
        return config.cast
    if not machine.accelerator:  # the CPU, the simulated device: host memory
        return "device"
    if machine.h2d_gbps is None:  # not measured (the dry run): a PCIe-class link
        return "host"
    cast = "device" if machine.h2d_gbps >= FAST_LINK_GBPS else "host"
    logger.info("SuperOffload cast auto: host-to-device %.1f GB/s -> cast on the %s", machine.h2d_gbps, cast)
    return cast


def lowp_dtype(dtype: torch.dtype, cast: str, compact: bool) -> Optional[torch.dtype]:
    """The dtype of the host-side low-precision copy the kernel writes, if any (none under
    compact state: the bf16 part of the master is that copy)."""
    return dtype if cast == "host" and dtype != torch.float32 and not compact else None


def buffer_policy(config, dtype: torch.dtype, cast: str, machine: MachineFacts, flow: bool,
                  accumulation_steps: int, shard_world: Optional[int]) -> BufferPolicy:
    """Which buffers the buckets get, in which dtypes, page-locked or not, and how many
    elements of each host bucket (memory.py). `shard_world`: the ranks that share each host
    bucket under data parallelism (engine/dp/route.py), None in one process."""
    compact = config.state_precision != "fp32"
    return BufferPolicy(device_dtype=dtype, link_dtype=torch.float32 if cast == "device" else dtype,
                        lowp_dtype=lowp_dtype(dtype, cast, compact), pin=machine.pin,
                        # compact state: rollback restores the pre-step bytes (not invertible),
                        # kept only where a step may be speculative
                        snapshot=config.rollback == "snapshot" or (compact and config.speculation != "off"),
                        micro_batches=accumulation_steps, rounds_pinned=machine.rounds_pinned,
                        shard_world=shard_world, state_precision=config.state_precision,
                        # a rank's master holds only its shard of each bucket: never aliased
                        params_alias_masters=(machine.host_is_device and dtype == torch.float32
                                              and shard_world is None and not flow))


def device_bucket_bytes(numel: int) -> int:
    """Device bytes a device-resident bucket of `numel` elements holds at rest (fp32 master,
    moments and gradient) plus its step's transients (the chunked float64 norm)."""
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


def dry_run_machine(accelerator: bool, pin_memory, shard_world: Optional[int] = None, **device) -> MachineFacts:
    """The machine the dry run assumes: an accelerator whose link was not measured (cast "auto"
    taken as "host"), page-locked buffers as Transfer decides; `device`: its memory
    (`free_bytes`, `total_bytes`, as MachineFacts), unknown when not given."""
    return MachineFacts(device_type="cuda" if accelerator else "cpu", host_is_device=not accelerator,
                        asynchronous=accelerator, pin=accelerator and pin_memory in (True, "auto"),
                        rounds_pinned=accelerator, shard_world=shard_world, **device)


def estimate_layout(params: list[torch.Tensor], groups: list[dict], config, accelerator: bool,
                    accumulation_steps: int = 1, shard_world: Optional[int] = None) -> tuple[BucketPlan, BufferPolicy]:
    """The first plan and the buffer policy of `estimate` (the dry run also decides the snapshot
    trade from them, plan/snapshot_trade.py): `decide_layout` on the dry run's machine, with
    the weights stationary (the dry run prints the weight-flow lines of its own: flow adds no
    host buffer, it streams the copy the host Adam writes)."""
    machine = dry_run_machine(accelerator, config.pin_memory, shard_world)
    layout = decide_layout(params, groups, config.replace(weights="stationary"), machine,
                           accumulation_steps=accumulation_steps)
    return layout.bucket_plan, layout.policy
