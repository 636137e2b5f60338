"""The buckets at run time: the plan, each bucket's runtime and buffers, which parameter lives
where, and each parameter's Adam step count. Also the per-parameter state interface that
checkpoints go through (`export_param`, `import_param`).

Host buffers are one arena per kind (plan/memory.py, engine/state/arenas.py), device-resident buckets' buffers are device
tensors of their own; every allocation goes through the Ledger, whose figures `footprint`
predicts. Re-planning first frees the gradient staging and landing arenas (they hold nothing
between steps), then moves one kind at a time (allocate the new plan's buffers of that kind,
copy, free the old, return the freed page-locked blocks to the system), so the host never holds
more than the state plus one kind's arena.

Compact host state (plan/memory.py, host/compact.py): host buckets hold six compact kinds instead of
the fp32 master and moments, encoded from the parameters at install by the host Adam back end
(`codec`); every new compact arena is zeroed first (the padding between slots stays zero). A
re-plan moves a parameter's bytes unchanged, except where it moves between a compact host bucket
and an fp32 device-resident one: then its state is converted (engine/state/precision.py).

When the device is this host's memory (the CPU runtime) and the device dtype is fp32, a host
bucket's parameters are views into its fp32 master buffer (`alias_params`): a host step updates
them in place, nothing is copied back, and there is no second copy of the weights. With one
micro-batch per step there is no gradient buffer either (BufferPolicy.grad_on_demand): 12 B/param.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, NamedTuple, Optional

import torch

from superoffload_hf.engine.state import precision
from superoffload_hf.engine.state.buffers import BucketBuffers
from superoffload_hf.engine.state.lifecycle import BucketRuntime
from superoffload_hf.engine.state.arenas import HostArena, Ledger
from superoffload_hf.plan.memory import COMPACT_KINDS, STATE_KINDS, BufferPolicy, footprint, spare_landing_numel
from superoffload_hf.engine.state.pin_method import PinMethod, choose_pin_method
from superoffload_hf.plan.buckets import BucketPlan, ParamSlot

logger = logging.getLogger("superoffload_hf")
FP32 = torch.float32
SCRATCH_KINDS = ("grad", "recv")  # host kinds that hold nothing between steps
ENCODE_CHUNK = 1 << 16  # elements per compact encode call at install: a multiple of the group
DEVICE_KINDS = STATE_KINDS + ("grad",)  # a device-resident bucket's buffers (fp32)


class BucketSet:
    def __init__(self, params: list[torch.Tensor], policy: BufferPolicy, runtime, shard_of=None, codec=None,
                 pin_mode: str = "alloc", pin_threads: int = 1):
        self.params = params
        self._pin_mode, self._pin_threads = pin_mode, pin_threads
        self.pin_method: Optional[PinMethod] = None  # chosen at the first install (engine/state/pin_method.py)
        self.codec = codec  # the host Adam back end: compact_encode_ / compact_decode (compact state)
        self.index_of = {p: i for i, p in enumerate(params)}
        self.policy, self.runtime = policy, runtime
        self.shard_of = shard_of  # data parallel (engine/dp/route.py): bucket -> this rank's Shard
        if (shard_of is None) != (policy.shard_world is None):
            raise ValueError(f"`shard_of` is {shard_of!r} but `policy.shard_world` is {policy.shard_world!r}: "
                             "both are set under data parallelism, neither in one process.")
        self.ledger = Ledger()
        self.param_steps = [0] * len(params)
        self.runtimes: list[BucketRuntime] = []
        self.arenas: dict[str, HostArena] = {}
        self.plan: BucketPlan = None  # set by install()
        # (never for sharded masters: a rank's master holds only its shard of each bucket)
        self.aliases_masters = policy.params_alias_masters and shard_of is None
        self._aliases: list[tuple[int, int]] = []  # (param index, data_ptr) of aliased parameters
        self.spare_landing = None  # see _reserve_spare_landing
        self._spare_owner = None  # the bucket whose round last landed in it

    def install(self, plan: BucketPlan) -> None:
        """Buffers for `plan`, masters from the parameters as given (an fp32 model keeps full
        precision), moments zero."""
        bufs = self._new_buffers(plan)
        if self.pin_method is None:
            pinned = sum(r.nbytes for r in footprint(plan, self.policy) if r.place == "pinned")
            self.pin_method = choose_pin_method(self.runtime, self._pin_mode, self._pin_threads, pinned)
        pin_seconds = self.ledger.pin_seconds
        for kind in self._kinds():
            self._allocate_kind(plan, bufs, kind)
            for b, bb in zip(plan.buckets, bufs):
                flat = getattr(bb, kind)
                if flat is None:
                    continue
                if kind == "master":
                    for dst, src in self._master_sources(b, flat):
                        dst.copy_(src)
                elif kind == "lowp":
                    flat.copy_(bb.master)
                else:
                    flat.zero_()
        if self.policy.compact:
            self._encode_masters(plan, bufs)
        self._set_runtimes(plan, bufs)
        self._reserve_spare_landing(plan)
        self._log_pinning(self.ledger.pin_seconds - pin_seconds)

    def _encode_masters(self, plan: BucketPlan, bufs: list[BucketBuffers]) -> None:
        """Compact host buckets: the parameters' values (fp32, or as the model holds them) encoded
        with zero moments (the padding encodes zeros), ENCODE_CHUNK elements per back-end call.
        The fp32 inputs are chunk-sized, not bucket-sized: freed bucket-sized temporaries (12
        B/param of the largest bucket) stayed in the C allocator's heap, resident, for the
        life of the process."""
        master = torch.empty(ENCODE_CHUNK, dtype=FP32)
        # (distinct: the kernel refuses aliased outputs; read only, so zeroed once)
        exp_avg, exp_avg_sq = torch.zeros(ENCODE_CHUNK, dtype=FP32), torch.zeros(ENCODE_CHUNK, dtype=FP32)
        for b, bb in zip(plan.buckets, bufs):
            if b.device_resident:
                continue
            pieces = self._master_pieces(b)
            for start in range(0, bb.numel, ENCODE_CHUNK):
                end = min(start + ENCODE_CHUNK, bb.numel)
                chunk = master[:end - start].zero_()
                for offset, src in pieces:
                    lo, hi = max(start, offset), min(end, offset + src.numel())
                    if lo < hi:
                        chunk[lo - start:hi - start].copy_(src[lo - offset:hi - offset])
                compact = [BucketBuffers.kind_view(kind, getattr(bb, kind), _Span(start, end - start))
                           for kind in COMPACT_KINDS]
                self.codec.compact_encode_(*compact, chunk, exp_avg[:end - start], exp_avg_sq[:end - start])

    def _log_pinning(self, seconds: float) -> None:
        pinned = self.ledger.bytes("pinned")
        if pinned:
            logger.info("SuperOffload: page-locking %.3f GB of host buffers took %.2fs by %s", pinned / 1e9, seconds,
                        self.pin_method.describe())

    def _master_sources(self, b, flat: torch.Tensor):
        """(buffer view, parameter values) pairs that initialise a bucket's master."""
        return [(flat[offset:offset + src.numel()], src) for offset, src in self._master_pieces(b)]

    def _master_pieces(self, b) -> list[tuple[int, torch.Tensor]]:
        """(offset in the bucket's buffers, flat parameter values) of each piece of a bucket."""
        shard = self._shard(b)
        if shard is None:
            return [(s.offset, self.params[s.index].detach().reshape(-1)) for s in b.slots]
        return [(p.offset, self.params[p.index].detach().reshape(-1)[p.param_start:p.param_end]) for p in shard.pieces]

    def _shard(self, b):
        return None if self.shard_of is None or b.device_resident else self.shard_of(b)

    def _numel(self, b) -> int:
        """Elements of a bucket's buffers here: its shard's under data parallelism (the
        arithmetic the estimate uses, memory.BufferPolicy.host_numel)."""
        return b.numel if b.device_resident else self.policy.host_numel(b.numel)

    def shard_numel(self) -> int:
        return sum(self._numel(rt.bucket) for rt in self.host())

    def replan(self, plan: BucketPlan) -> None:
        """Move every parameter's state into the buffers of a new plan, one kind at a time.
        The caller has waited for every queued job (nothing may touch the old buffers any more)."""
        if self.shard_of is not None:
            raise NotImplementedError("Re-planning sharded state (data parallelism) is not supported.")
        old = {s.index: (rt.bufs, s) for rt in self.runtimes for s in rt.bucket.slots}
        old_bufs = [rt.bufs for rt in self.runtimes]
        # compact state: a parameter moving between a compact host bucket and an fp32 device one
        # is converted (a copy of its state, held until the new buffers exist; a few buckets' worth)
        residency = {s.index: b.device_resident for b in plan.buckets for s in b.slots}
        converted = {i: {k: v.clone() for k, v in self.export_param(i).items()} for i, (bb, _) in old.items()
                     if self.policy.compact and bb.on_host == residency[i]}
        for rt in self.runtimes:
            rt.bufs.drop_transients()
            rt.grad_in = None  # a view of the old grad / recv arena
        bufs = self._new_buffers(plan)
        # The gradient staging and landing arenas hold nothing between steps: freed before any new
        # arena is allocated, so the peak is the state at rest plus one kind's new arena.
        self.spare_landing, self._spare_owner = None, None  # scratch too
        for kind in SCRATCH_KINDS:
            self.arenas.pop(kind, None)
            self._free_old(kind, old_bufs)
        for kind in self._kinds():
            if kind not in SCRATCH_KINDS:
                self.arenas.pop(kind, None)  # the old arena goes with the old views below
            self._allocate_kind(plan, bufs, kind)
            for b, bb in zip(plan.buckets, bufs):
                flat = getattr(bb, kind)
                if flat is None:
                    continue
                if self.policy.compact:
                    flat.zero_()  # the padding between slots (and what a converted slot gets next)
                if kind in STATE_KINDS or kind in COMPACT_KINDS:
                    for slot in b.slots:
                        theirs, their_slot = old[slot.index]
                        if slot.index in converted:
                            continue  # another precision there: converted below
                        BucketBuffers.kind_view(kind, flat, slot).copy_(
                            BucketBuffers.kind_view(kind, getattr(theirs, kind), their_slot))
                elif kind == "lowp":
                    flat.copy_(bb.master)
                else:
                    flat.zero_()
            if kind not in SCRATCH_KINDS:
                self._free_old(kind, old_bufs)
        self._set_runtimes(plan, bufs)
        for index, values in converted.items():
            self.import_param(index, values)
        del old, old_bufs, converted
        self.runtime.host_empty_cache()  # what the old buckets' runtimes still held
        self._reserve_spare_landing(plan)

    def _reserve_spare_landing(self, plan: BucketPlan) -> None:
        """Where the policy has no landing arena (an fp32 link, one micro-batch) only a second
        gradient round of a step needs one (a tied or reused parameter, a second backward): one
        buffer of the largest host bucket, allocated here, not page-locked by the autograd thread
        in the middle of backward (memory.spare_landing_numel)."""
        numel = spare_landing_numel(plan, self.policy) if self.shard_of is None else 0
        self.spare_landing, self._spare_owner = None, None
        if numel:
            dtype, pinned = self.policy.link_dtype, self.policy.pin
            self.spare_landing = HostArena("grad landing (spare)", [numel], dtype, pinned, self.policy.rounds_pinned,
                                           self.runtime, self.ledger).view(0)

    def landing(self, rt: BucketRuntime, dtype: torch.dtype, wait_idle) -> torch.Tensor:
        """Training thread: the host buffer a gradient round that is added to `grad` lands in:
        the bucket's own (its "recv" arena view), or the shared spare. `wait_idle(rt)` waits for
        a bucket's queued jobs: the spare changes hands only after the last one's read it."""
        spare = self.spare_landing
        if rt.bufs.recv is not None or spare is None or spare.dtype != dtype:
            return rt.bufs.recv_buffer(dtype)
        if self._spare_owner is not None and self._spare_owner is not rt:
            wait_idle(self._spare_owner)  # its accumulate job reads the spare
        self._spare_owner = rt
        return spare[:rt.bufs.numel]

    def _free_old(self, kind: str, old_bufs: list[BucketBuffers]) -> None:
        for bb in old_bufs:
            setattr(bb, kind, None)  # the last views of the old buffers of this kind: freed now
        # torch's host allocator caches freed page-locked blocks forever: give them back now, or
        # the old arena of this kind stays held next to its new one
        self.runtime.host_empty_cache()

    def release(self) -> None:
        """close(): drop every buffer (the caller has waited for every job and copy). Aliased
        parameters keep their values: they are views of the masters' memory, now the model's."""
        self.runtimes, self.arenas, self.where, self.runtime_of, self._aliases = [], {}, {}, {}, []
        self.spare_landing, self._spare_owner = None, None

    def _kinds(self) -> tuple[str, ...]:
        # master before lowp (lowp is filled from it); grad last (it holds nothing between steps);
        # under compact state the fp32 kinds are the device-resident buckets' only
        compact = COMPACT_KINDS if self.policy.compact else ()
        return tuple(k for k in ("master", "lowp", "exp_avg", "exp_avg_sq", *compact, "grad", "recv")
                     if k in self.policy.host_kinds() or k in DEVICE_KINDS)

    def _new_buffers(self, plan: BucketPlan) -> list[BucketBuffers]:
        host_kinds = self.policy.state_kinds
        return [BucketBuffers(self._numel(b), not b.device_resident, self._transient_alloc(self._numel(b)),
                              STATE_KINDS if b.device_resident else host_kinds)
                for b in plan.buckets]

    def _transient_alloc(self, numel: int):
        # closes over the ledger, not `self`: the buffers it serves belong to `self` (no cycle)
        ledger, runtime, pin = self.ledger, self.runtime, self.policy.pin

        def alloc(kind: str, dtype: torch.dtype, pinned: bool, n: Optional[int] = None) -> torch.Tensor:
            place = "pinned" if pinned and pin else "host"
            return ledger.allocate(runtime, kind, place, numel if n is None else n, dtype)
        return alloc

    def _allocate_kind(self, plan: BucketPlan, bufs: list[BucketBuffers], kind: str) -> None:
        """The new plan's buffers of one kind: a host arena for the host buckets, a device
        tensor per device-resident bucket (master, moments and gradient only)."""
        host = [k for k, b in enumerate(plan.buckets) if not b.device_resident]
        kinds = self.policy.host_kinds()
        if kind in kinds and host:
            dtype, pinned = kinds[kind]
            with self.pin_method.applied(self.runtime) if pinned and self.policy.pin else contextlib.nullcontext():
                arena = HostArena(kind, [self.policy.kind_numel(kind, self._numel(plan.buckets[k])) for k in host],
                                  dtype, pinned, self.policy.rounds_pinned, self.runtime, self.ledger)
            self.arenas[kind] = arena
            for j, k in enumerate(host):
                setattr(bufs[k], kind, arena.view(j))
        if kind in DEVICE_KINDS:  # device-resident buckets neither cast nor land copies; fp32 state
            for k, b in enumerate(plan.buckets):
                if b.device_resident:
                    setattr(bufs[k], kind, self.ledger.allocate(self.runtime, kind, "device", b.numel, FP32))

    def _set_runtimes(self, plan: BucketPlan, bufs: list[BucketBuffers]) -> None:
        self.plan = plan
        self.runtimes = [BucketRuntime(b, bb, [self.params[s.index] for s in b.slots])
                         for b, bb in zip(plan.buckets, bufs)]
        for rt in self.runtimes:
            rt.shard = self._shard(rt.bucket)
        self.where: dict[int, tuple[BucketRuntime, int]] = {
            s.index: (rt, k) for rt in self.runtimes for k, s in enumerate(rt.bucket.slots)}
        self.runtime_of = {self.params[i]: rt for i, (rt, _) in self.where.items()}
        self.alias_params()

    def alias_params(self) -> None:
        """Point each host bucket's parameters at its fp32 master (when `aliases_masters`): after
        install(), so a re-plan re-points them into the new buffers."""
        self._aliases = []
        if not self.aliases_masters:
            return
        with torch.no_grad():
            for rt in self.host():
                master = rt.bufs.master.numpy()  # the same memory; keeps the buffer alive
                for p, slot in zip(rt.params, rt.bucket.slots):
                    p.data = _param_over(master, slot)
                    self._aliases.append((slot.index, p.data_ptr()))
                rt.params_alias_master = True
                rt.grad_on_demand = self.policy.grad_on_demand

    def check_aliases(self) -> None:
        """Raise if user code replaced an aliased parameter's storage since alias_params()."""
        for index, ptr in self._aliases:
            p = self.params[index]
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"Parameter {index} (shape {tuple(p.shape)}, {p.dtype}) no longer shares memory with "
                    "the optimizer's fp32 master weight: its storage was replaced after the optimizer was "
                    "built (`p.data = ...`, `model.to(dtype)`, `model.half()`, ...). On the CPU with fp32 "
                    "the parameters are views of the master weights, so the optimizer would update a "
                    "tensor the model no longer uses. Move or cast the model before building the "
                    "optimizer; to set new values, write them in place after `optimizer.synchronize()` "
                    "(`with torch.no_grad(): p.copy_(...)`, which the race check sees, unlike `p.data.copy_`; "
                    "or `model.load_state_dict(...)`).")

    def host(self) -> Iterator[BucketRuntime]:
        return (rt for rt in self.runtimes if not rt.bucket.device_resident)

    def on_device(self) -> Iterator[BucketRuntime]:
        return (rt for rt in self.runtimes if rt.bucket.device_resident)

    # ---- per-parameter state (checkpoints) -------------------------------------------------

    def slot_of(self, index: int) -> tuple[BucketRuntime, ParamSlot]:
        rt, k = self.where[index]
        return rt, rt.bucket.slots[k]

    def export_param(self, index: int) -> dict[str, torch.Tensor]:
        """The parameter's state as its bucket holds it: fp32 master / exp_avg / exp_avg_sq shaped
        like the parameter, or the six compact kinds; views of the live host buffers (see
        BucketBuffers.export_param)."""
        rt, slot = self.slot_of(index)
        return rt.bufs.export_param(slot)

    def precision_of(self, index: int) -> str:
        """The state precision of the bucket holding parameter `index` (device-resident: fp32)."""
        rt, _ = self.slot_of(index)
        return self.policy.state_precision if rt.bufs.compact else "fp32"

    def import_param(self, index: int, values: dict[str, torch.Tensor]) -> bool:
        """Copy a parameter's state in, converting it when it is another precision than its
        bucket's (engine/state/precision.py); returns whether it converted."""
        rt, slot = self.slot_of(index)
        target = self.precision_of(index)
        converted = precision.precision_of(values) != target
        rt.bufs.import_param(slot, precision.convert(values, target, self.codec) if converted else values)
        return converted

    def refresh_device_params(self, skip=lambda p: False) -> None:
        """Copy every master weight to its device parameter (after loading state; the caller
        has synchronized), except those `skip(p)` names (weight-flow's: fetched at use)."""
        with torch.no_grad():
            for rt in self.runtimes:
                if rt.params_alias_master:
                    continue  # the parameters are the masters
                weights = rt.bufs.master_bf16 if rt.bufs.compact else rt.bufs.master  # compact: as it is
                for p, slot in zip(rt.params, rt.bucket.slots):
                    if skip(p):
                        continue
                    p.detach().copy_(BucketBuffers.view(weights, slot).view(slot.shape))


class _Span(NamedTuple):
    """An element range of a bucket's buffers, as BucketBuffers.kind_view reads a slot."""
    offset: int
    numel: int


def _param_over(master, slot: ParamSlot) -> torch.Tensor:
    """A tensor over the slot's elements of `master` (a numpy view of a bucket's fp32 master) with
    a storage of its own: savers that keep only one of the tensors sharing a storage
    (accelerate's save_model, safetensors' save_model) must see every parameter as separate."""
    if slot.numel == 0:
        return torch.empty(slot.shape, dtype=torch.float32)
    return torch.frombuffer(master, dtype=torch.float32, count=slot.numel,
                            offset=slot.offset * master.itemsize).view(slot.shape)
