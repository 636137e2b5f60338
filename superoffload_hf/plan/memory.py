"""Where the bytes go: the buffers a plan needs, per kind and place, and the layout of the host
arenas that hold them (pure: the arenas themselves and the Ledger are engine/state/arenas.py). The same
code sizes the allocations (`HostArena`, `BucketSet`) and the estimate that
`superoffload train --dry-run` and `optimizer.describe()` print (`footprint`), so the two cannot
drift apart.

Kinds of a host bucket, each one arena (one allocation, or a few power-of-two segments where
the runtime rounds page-locked blocks up) that the buckets are views into:

* `master`     fp32; page-locked when it crosses the link (cast "device": copied to the device)
* `exp_avg`,   fp32, plain host memory: the moments never cross the link
  `exp_avg_sq`
* `grad`       fp32 gradient staging; page-locked when gradients land in it (an fp32 link).
               None at rest on the CPU with fp32 and one micro-batch (`grad_on_demand`): the
               host Adam reads autograd's gradients in place, as torch.optim does; none either
               with one micro-batch over a low-precision link (`grad_lazy`): the step reads
               the landing buffer
* `lowp`       (cast "host") the low-precision copy the kernel writes; page-locked, it crosses

Under compact state (`BufferPolicy.state_precision`, host/compact.py) the three fp32 state kinds
of a host bucket are six: `master_bf16` (the bf16 part of the master, the copy-back's source as
it is: page-locked where it crosses the link; there is no `lowp` then), `master_err` (int8, int16
for "compact32"), `exp_avg_q` (int8), `exp_avg_sq_q` (uint8 of sqrt(v)), and the per-group bf16
`exp_avg_scale` / `exp_avg_sq_scale` (ceil(n / 32) elements for a bucket of n), plain memory.
Device-resident buckets keep fp32 state on the device.

Besides: `snapshot` (rollback "snapshot", and always under compact state: master and moments, or
the six compact kinds' bytes, before a speculative step, plain),
`landing` (a gradient copy that is cast or added to `grad` lands here first: a low-precision
link, or accumulation over micro-batches; page-locked), the device-resident buckets (fp32
master, moments and gradient on the device), the device parameters, and the transient buffers
of one bucket in flight (a gradient round and a copy-back staging buffer, on the device).

Under data parallelism over N ranks (`BufferPolicy.shard_world`, engine/dp/route.py) every host
bucket's buffers hold this rank's shard of it (shard.py: ceil(numel / N) elements), and the
device side has buffers of its own instead of the gradient ring and the copy-back staging:
each host bucket's flat gradient (padded to N shards) from its first gradient until its
reduce-scatter, the shard the reduce-scatter lands in, and the all-gathers' shard and flat bucket.

Places: "device", "pinned" (page-locked host), "host" (plain host). On the CPU runtime the
device is the host and nothing is pinned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from superoffload_hf.plan.buckets import BucketPlan
from superoffload_hf.plan.shard import shard_numel
from superoffload_hf.host.compact import COMPACT_GROUP, scale_numel, spec_of

ALIGN_NUMEL = 64  # every bucket starts 64 elements (>= one cache line, any dtype) into its arena
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
# compact host state (host/compact.py), in the order of the back end's compact_* arguments
COMPACT_KINDS = ("master_bf16", "master_err", "exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale")
SCALE_KINDS = ("exp_avg_scale", "exp_avg_sq_scale")  # one element per group of COMPACT_GROUP
HOST_KINDS = STATE_KINDS + ("grad", "lowp")
FP32 = torch.float32
# config `device_dtype` -> the device copy's dtype
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NORM_CHUNK = 1 << 22  # elements: bounds the float64 transient of a device norm to 32 MB (engine/state/stepper.py)
ALL_GATHERS_LIVE = 1  # data parallel: all-gather buffer pairs (flat bucket + shard), reused (engine/dp/route.py)


def _size(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True)
class BufferPolicy:
    """The engine's decisions that fix which buffers exist, their dtypes and whether they are
    page-locked (from the config and the runtime; see plan/layout.py decide_layout)."""

    device_dtype: torch.dtype
    link_dtype: torch.dtype  # the dtype in which gradients cross to the host
    lowp_dtype: Optional[torch.dtype]  # cast "host": the host-side low-precision copy
    pin: bool  # page-lock what crosses the link (an accelerator with pin_memory on)
    snapshot: bool  # rollback "snapshot"
    micro_batches: int  # backward passes per step (gradient accumulation)
    rounds_pinned: bool = False  # the runtime rounds a page-locked block up to a power of two
    params_alias_masters: bool = False  # the CPU device with fp32: host buckets' parameters ARE the masters
    shard_world: Optional[int] = None  # data parallel (engine/dp/route.py): ranks sharing each host bucket; None: one process
    state_precision: str = "fp32"  # host buckets' state: "fp32", or compact ("compact", "compact32": host/compact.py)

    @property
    def compact(self) -> bool:
        return self.state_precision != "fp32"

    @property
    def align(self) -> int:
        """Elements every parameter slot starts at a multiple of (plan.py): the compact group."""
        return COMPACT_GROUP if self.compact else 1

    @property
    def state_kinds(self) -> tuple[str, ...]:
        """The kinds that hold a host bucket's master and moments."""
        return COMPACT_KINDS if self.compact else STATE_KINDS

    @property
    def copy_back_dtype(self) -> torch.dtype:
        """What the copy-back sends: compact state's bf16 master, the cast "host" copy, or fp32."""
        return torch.bfloat16 if self.compact else (self.lowp_dtype or FP32)

    @staticmethod
    def kind_numel(kind: str, numel: int) -> int:
        """Elements of a buffer of `kind` for a bucket (or shard) of `numel` elements."""
        return scale_numel(numel) if kind in SCALE_KINDS else numel

    @property
    def accumulates(self) -> bool:
        return self.micro_batches > 1

    @property
    def grad_on_demand(self) -> bool:
        """No gradient buffer at rest: the parameters are the masters and one micro-batch makes a
        step, so the host Adam reads autograd's gradients in place (host/segmented.py), which
        live until step() ends as in torch. A bucket gets its fp32 buffer only for a step in
        which one of its parameters receives a second gradient (engine/step/collect.py)."""
        return self.params_alias_masters and not self.accumulates

    @property
    def grad_lazy(self) -> bool:
        """No fp32 gradient arena: `grad_on_demand`, or one micro-batch whose gradients cross the
        link in low precision (cast "host"), which the step reads from the landing buffer as it
        is. A bucket whose round is re-opened (a tied or reused parameter) gets its fp32 buffer
        then (BucketBuffers.grad_buffer, jobs.py) and keeps it."""
        return self.grad_on_demand or (self.link_dtype != FP32 and not self.accumulates
                                       and self.shard_world is None)

    def host_numel(self, numel: int) -> int:
        """Elements of a host bucket of `numel` elements in this rank's buffers: its shard's
        under data parallelism (shard.py; padding included), else all of them."""
        return numel if self.shard_world is None else shard_numel(numel, self.shard_world, self.align)

    def host_kinds(self) -> dict[str, tuple[torch.dtype, bool]]:
        """kind -> (dtype, page-locked) of every arena a host bucket has."""
        if self.compact:  # the bf16 master crosses the link as it is; the rest never does
            kinds = {"master_bf16": (torch.bfloat16, self.pin), "master_err": (spec_of(self.state_precision).err_dtype, False),
                     "exp_avg_q": (torch.int8, False), "exp_avg_scale": (torch.bfloat16, False),
                     "exp_avg_sq_q": (torch.uint8, False), "exp_avg_sq_scale": (torch.bfloat16, False)}
        else:
            kinds = {"master": (FP32, self.pin and self.lowp_dtype is None),
                     "exp_avg": (FP32, False), "exp_avg_sq": (FP32, False)}
        if not self.grad_lazy:
            kinds["grad"] = (FP32, self.pin and self.link_dtype == FP32)
        if self.lowp_dtype is not None:
            kinds["lowp"] = (self.lowp_dtype, self.pin)
        if self.landing:  # a copy target: page-locked; one arena, so no power-of-two block per bucket
            kinds["recv"] = (self.link_dtype, self.pin)
        return kinds

    @property
    def landing(self) -> bool:
        """Whether host buckets need a landing buffer for gradient copies (see collect.flush)."""
        return self.link_dtype != FP32 or self.accumulates


# ---- arena layout ----------------------------------------------------------------------------------


def _aligned(numel: int) -> int:
    return -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def arena_layout(numels: Sequence[int], power_of_two: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """Segments of an arena holding buffers of `numels` elements, and each buffer's
    (segment, offset). One segment, unless `power_of_two` (the runtime rounds every block up to
    a power of two): then segments of power-of-two sizes that buffers do not straddle, so the
    rounding wastes less than one buffer per segment instead of up to the arena's size."""
    sizes = [_aligned(n) for n in numels]
    if not power_of_two:
        return [sum(sizes)], [(0, sum(sizes[:k])) for k in range(len(sizes))]
    segments: list[int] = []
    used: list[int] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    rest = sum(sizes)
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):  # largest first: least waste
        if not segments or used[-1] + sizes[k] > segments[-1]:
            segments.append(max(_pow2_floor(rest), _pow2_ceil(sizes[k])))
            used.append(0)
        places[k] = (len(segments) - 1, used[-1])
        used[-1] += sizes[k]
        rest -= sizes[k]
    return segments, places


# ---- the estimate ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FootprintRow:
    what: str
    place: str  # "device", "pinned", "host"
    nbytes: int
    transient: bool = False


def spare_landing_numel(plan: BucketPlan, policy: BufferPolicy) -> int:
    """Elements of the one spare landing buffer (engine/state/buckets.py) where the policy has no landing
    arena and a second gradient round would land through the link: the largest host bucket; 0
    where none is needed (landing arenas, aliased masters, data parallelism: engine/dp/route.py)."""
    if policy.landing or policy.params_alias_masters or policy.shard_world is not None:
        return 0
    return max((b.numel for b in plan.buckets if not b.device_resident), default=0)


def footprint(plan: BucketPlan, policy: BufferPolicy, snapshot_buckets: Optional[frozenset] = None) -> list[FootprintRow]:
    """What the engine allocates for `plan` under `policy`, row by row (the allocation's own
    arithmetic: `arena_layout`, the buffer kinds of `policy`, and `policy.host_numel`: the
    per-rank shard of each host bucket under data parallelism). `snapshot_buckets`: the indices
    of the buckets that may speculate and so keep a snapshot (plan/snapshot_trade.py); None: all."""
    host_buckets = [b for b in plan.buckets if not b.device_resident]
    host = [policy.host_numel(b.numel) for b in host_buckets]
    on_device = sum(b.numel for b in plan.buckets if b.device_resident)
    largest = max((b.numel for b in plan.buckets), default=0)
    aliased = sum(host) if policy.params_alias_masters else 0
    # aliased parameters are views of their masters (counted below): no memory of their own
    rows = [FootprintRow("device params", "device", (plan.param_numel - aliased) * _size(policy.device_dtype))]
    if on_device:  # replicated under data parallelism, not sharded
        rows.append(FootprintRow("device-resident buckets", "device", on_device * 4 * 4))
    for kind, (dtype, pinned) in policy.host_kinds().items():
        segments, _ = arena_layout([policy.kind_numel(kind, n) for n in host], policy.rounds_pinned and pinned)
        rows.append(FootprintRow({"grad": "grad staging", "recv": "grad landing"}.get(kind, kind),
                                 "pinned" if pinned else "host", sum(segments) * _size(dtype)))
    spare = spare_landing_numel(plan, policy)
    if spare:
        segments, _ = arena_layout([spare], policy.rounds_pinned and policy.pin)
        rows.append(FootprintRow("grad landing (spare)", "pinned" if policy.pin else "host",
                                 sum(segments) * _size(policy.link_dtype)))
    snapshotted = [n for b, n in zip(host_buckets, host) if snapshot_buckets is None or b.index in snapshot_buckets]
    if policy.snapshot and snapshotted:  # one buffer per state kind and host bucket (buffers.py take_snapshot)
        kinds = policy.host_kinds()
        rows.append(FootprintRow("snapshot", "host", sum(policy.kind_numel(kind, n) * _size(kinds[kind][0])
                                                         for n in snapshotted for kind in policy.state_kinds)))
    largest_host = max(host, default=0)
    if largest_host and policy.shard_world is not None:
        rows += _data_parallel_rows(host_buckets, host, policy)
    elif largest_host and not policy.params_alias_masters:  # allocated once, kept (device/transfer.py)
        from superoffload_hf.device.transfer import GRAD_RING_SLOTS

        # allocated at their first use, then kept (not in the Ledger of the state at rest)
        rows.append(FootprintRow(f"gradient ring ({GRAD_RING_SLOTS} slots)", "device",
                                 GRAD_RING_SLOTS * largest_host * _size(policy.link_dtype), transient=True))
        rows.append(FootprintRow("copy-back staging", "device",
                                 largest_host * _size(policy.copy_back_dtype), transient=True))
    if not largest_host:
        rows.append(FootprintRow("transient (one bucket)", "device",
                                 largest * (_size(policy.link_dtype) + _size(policy.copy_back_dtype)),
                                 transient=True))
    if policy.grad_on_demand:  # autograd's, read in place; from backward until step() ends, as in torch
        # (a step with more backwards than declared micro-batches also allocates the fp32
        # gradient buffers of the buckets that get a second gradient, for that step: lifecycle.py)
        rows.append(FootprintRow("gradients (autograd's)", "device", sum(host) * 4, transient=True))
    return rows


def _data_parallel_rows(host_buckets, shards: Sequence[int], policy: BufferPolicy) -> list[FootprintRow]:
    """The device buffers of engine/dp/route.py (allocated at use, outside the Ledger), at their peak.
    `shards`: each host bucket's shard numel; the bucket's flat device gradient is N of them."""
    link, padded = _size(policy.link_dtype), [n * policy.shard_world for n in shards]
    if not policy.accumulates:
        # a bucket's gradient lives from its first gradient to its reduce-scatter: with the plan
        # in ready order, one open bucket per param group (each group packs its own buckets)
        open_per_group: dict[int, int] = {}
        for b, n in zip(host_buckets, padded):
            open_per_group[b.group] = max(open_per_group.get(b.group, 0), n)
        nbytes, what = sum(open_per_group.values()) * link, f"grad buckets ({len(open_per_group)} open)"
    elif link == 4:  # fp32 from the first micro-batch on: every host bucket until its reduce-scatter
        nbytes, what = sum(padded) * 4, "grad buckets (all, fp32)"
    elif policy.micro_batches == 2:
        # every bucket holds the first micro-batch in the link dtype; at the second each is upcast
        # to fp32, then cast back for its reduce-scatter: one bucket in fp32 on top at a time
        nbytes, what = sum(padded) * link + max(padded) * 4, "grad buckets (all)"
    else:  # upcast at the second micro-batch: all in fp32; one cast back for its reduce-scatter
        nbytes, what = sum(padded) * 4 + max(padded) * link, "grad buckets (all, fp32)"
    # one pair of all-gather buffers (the largest bucket and its shard), reused by every copy-back
    gathered = ALL_GATHERS_LIVE * (max(padded) + max(shards)) * _size(policy.device_dtype)
    return [FootprintRow(what, "device", nbytes, transient=True),
            FootprintRow("reduce-scatter shard", "device", max(shards) * link, transient=True),
            FootprintRow("all-gather", "device", gathered)]


HOST_PLACES = ("pinned", "host")
SCRATCH_ROWS = ("grad staging", "grad landing", "grad landing (spare)")  # footprint rows of buckets.SCRATCH_KINDS
CALLERS_ROWS = ("device params",)  # allocated by the caller before the optimizer exists


def host_bytes(rows: Sequence[FootprintRow], host_is_device: bool) -> int:
    """Host bytes the engine allocates for a footprint: pinned and plain host rows, and the
    device's where the device is this host (the CPU runtime), but not the parameters."""
    places = HOST_PLACES + (("device",) if host_is_device else ())
    return sum(r.nbytes for r in rows if r.place in places and r.what not in CALLERS_ROWS)


def replan_transient(rows: Sequence[FootprintRow]) -> int:
    """What a re-plan holds on top of the state at rest (engine/state/buckets.py BucketSet.replan): it
    frees the gradient staging and landing arenas first, then allocates each kind's new arena
    before the old one goes: the largest state arena less the scratch arenas freed."""
    host = [r for r in rows if r.place in HOST_PLACES and not r.transient]
    largest = max((r.nbytes for r in host if r.what not in SCRATCH_ROWS), default=0)
    return max(0, largest - sum(r.nbytes for r in host if r.what in SCRATCH_ROWS))


def format_footprint(rows: Sequence[FootprintRow], num_params: int) -> str:
    lines = [f"  {'buffer':<26}{'place':<8}{'GB':>10}{'B/param':>9}"]
    for r in rows:
        lines.append(f"  {r.what:<26}{r.place:<8}{r.nbytes / 1e9:>10.3f}{r.nbytes / max(num_params, 1):>9.2f}")
    for place in ("device", "pinned", "host"):
        total = sum(r.nbytes for r in rows if r.place == place)
        if total:
            lines.append(f"  {'total ' + place:<26}{'':<8}{total / 1e9:>10.3f}{total / max(num_params, 1):>9.2f}")
    return "\n".join(lines)
