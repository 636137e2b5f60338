"""Data parallelism inside the engine (ZeRO-style sharded host state; DESIGN.md section 8).

With N ranks (device/collectives.py) every host bucket's host state is cut into N shards
(plan/shard.py) and this rank's buffers hold only its shard: 16/N bytes per parameter of
master and moments, plus its shard of the gradient staging. Per step and host bucket:

  hooks (training thread)   gradients -> one flat device buffer of the whole bucket, padded to
                            a multiple of N (`round_dev`), accumulated there over micro-batches
                            (no communication before the last micro-batch; it is upcast to fp32
                            on the first accumulation: 4 B/param of device memory for the host
                            buckets while accumulating, the same as DDP's gradients)
  launch (training thread)  reduce-scatter of the bucket in the link dtype: the mean over all
                            ranks of this rank's shard (a bucket with a non-finite element sent
                            as all non-finite: every rank's shard shows the certain skip,
                            `spread_nonfinite`); its copy to the host staging; the worker
                            computes the shard's float64 sum of squares and, speculatively, steps
                            the shard (no copy-back yet: the device keeps the old weights)
  step()                    the buckets not launched yet launched (zeros for the gradients this
                            rank lacks), then presence of every parameter (one small all-reduce
                            on a process group of its own: a parameter without a gradient on any
                            rank is not stepped, as in torch), the late buckets launched (below),
                            the device-resident buckets' gradients averaged (they are
                            replicated, not sharded), and the local
                            sums of squares all-reduced (one float64 scalar): clip coefficient
                            and skip decision are identical on every rank; commit /
                            rollback+replay / skip per shard, on every rank together
  copy-back (worker)        after validation only, one per stepped bucket, queued in the same
                            order on every rank: the updated shard to the device and an all-gather
                            of the bucket's weights into the parameters (a separate process group
                            from the training thread's); the next forward waits for it per bucket,
                            and the training thread's next collective waits until every one of
                            them is issued before step() returns (`wait_for_queued_gathers`):
                            one order across the two threads, and against any collective the
                            caller issues after step(), on every rank (device/collectives.py)

Launch order. Collectives on one process group pair up by their order on each rank, so every
rank issues the reduce-scatters in one fixed order, never the order this rank's buckets happen
to complete in: at the first step the plan's bucket order (its guess of the order in backward);
from the second, the order rank 0's buckets completed in at the first (broadcast on the control
group after presence, so every rank switches at the same step). A bucket complete
before one ahead of it is held (`ready`) and launched as soon as everything ahead of it is; at
step() each rank launches the rest of that order, with zeros where it has no gradient, before it
asks the others anything (on gloo a rank blocks inside a reduce-scatter until its peers issue the
same one: a presence all-reduce first would deadlock with a peer that launched during backward).
So a parameter may get its gradient on some ranks only (a conditional branch, an MoE expert, a
layer one rank's data skips): it is averaged with zeros from the others (as DDP's
`find_unused_parameters`), and only overlap is lost, for the buckets held behind it (logged
once). Buckets that had no gradient on any rank at the last step are left out of that order and
launched after the presence all-reduce, only if some rank has a gradient for them now: the
same decision on every rank, and a bucket no rank uses costs no collective after its first step.
With replicas (ranks holding the same shard, each stepping it), a bucket launched at step() is
stepped speculatively where it would have been during backward, so a shard's replicas take the
same path whichever of them held it: one speculative step rolled back and replayed differs from
one step in the last bits (this assumes the hyperparameters do not change between backward and
step(), as they do not under the HF Trainer).

Assumptions, as DDP's: a bucket receives no gradient after its last micro-batch (a re-opened
bucket would need its gradient again: an error says so), and every rank calls step() at the same
point. A peer may wait inside a reduce-scatter until this rank reaches step(): no other
collective on these ranks may run between backward and step(), and zero_grad() in between (a
discard) is safe only where every rank launched the same buckets during backward. The buckets
are the initial plan's on every rank (the learned order changes when they launch, not what they
hold: no re-planning of sharded state, so no cost-model layout under data parallelism).
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Any, Callable, Mapping, Optional

import torch

from superoffload_hf.engine.state.buffers import BucketBuffers
from superoffload_hf.engine.state.lifecycle import BucketRuntime, BucketState
from superoffload_hf.plan.shard import shard_of
from superoffload_hf.engine.checkpoint import _check_layout, _groups_with_indices
from superoffload_hf.plan.memory import COMPACT_KINDS, SCALE_KINDS
from superoffload_hf.engine.state.saved import MASTER_KINDS
from superoffload_hf.engine.dp.checkpoint import FP32_KINDS, RangeSource, shard_state_dict, write_shards
from superoffload_hf.host.compact import COMPACT_GROUP, scale_numel

logger = logging.getLogger("superoffload_hf")

FP32 = torch.float32


class GradientAfterLaunchError(RuntimeError):
    """A gradient arrived for a bucket that was already reduce-scattered."""


def check_not_ddp(params) -> None:
    """The engine averages gradients over ranks itself: a DistributedDataParallel wrapper would
    all-reduce gradients the optimizer has already taken (and every rank's copy twice)."""
    import gc

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not (dist.is_available() and dist.is_initialized()):
        return
    ours = {id(p) for p in params}
    # DDP keeps no registry: look for live wrappers once, at construction
    for ddp in (o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)):
        if any(id(p) in ours for p in ddp.module.parameters()):
            raise RuntimeError(
                "The model is wrapped in torch.nn.parallel.DistributedDataParallel: remove the DDP wrapper. "
                "SuperOffloadAdamW does data parallelism itself (it reduce-scatters each bucket's gradients "
                "over the ranks); DDP would all-reduce gradients the optimizer has already taken. Build the "
                "optimizer from the unwrapped model's parameters and train the unwrapped model.")


def sharding(collectives, align: int = 1) -> Callable:
    """bucket -> this rank's Shard of it (for BucketSet, which is built before DataParallel).
    `align`: the plan's slot alignment (compact state: shards start at group boundaries)."""
    t = collectives.topology
    return functools.partial(shard_of, rank=t.shard_rank, world=t.shard_world, align=align)


def broadcast_params(collectives, params) -> None:
    """Every rank starts from rank 0's weights, as DDP does at construction."""
    with torch.no_grad():
        collectives.broadcast([p.detach() for p in params])


SHARD_EXTRAS = ("format_version", "loss_scale", "speculation", "counters", "layout")


class DataParallel:
    def __init__(self, collectives, *, params, buckets, transfer, runtime, worker, jobs, waiter, step_state,
                 counters, speculation, policy, link_dtype: torch.dtype, gather):
        # The collaborators it uses, never the engine or the collector: a dropped (or closed)
        # data-parallel optimizer frees its buffers without the cyclic collector.
        self.coll, self.params, self.buckets = collectives, params, buckets
        self.transfer, self.runtime = transfer, runtime
        self.worker, self.jobs, self.waiter, self.step_state, self.counters = worker, jobs, waiter, step_state, counters
        self.speculation, self.policy, self.link_dtype = speculation, policy, link_dtype
        self.gather = gather  # engine/dp/gather.py: the copy-backs' and weight-flow's all-gathers
        t = collectives.topology
        self.rank, self.world = t.shard_rank, t.shard_world
        self.shard = sharding(collectives, buckets.plan.align)
        # Launch order (module docstring). Global: the same on every rank, from the plan and
        # presence results only. Host buckets (by index) without a gradient on any rank at the
        # last step: launched after presence, not during backward.
        self._unused_last_step: frozenset[int] = frozenset()
        # The plan's order is a guess (the reverse of the optimizer's parameter order: wrong for
        # the Trainer's decay / no-decay groups, whose buckets then wait for each other). The
        # first step with gradients replaces it with the order rank 0's buckets completed in
        # (broadcast, so every rank launches alike); None until then.
        self._learned: Optional[list[int]] = None
        self._ready_seq: list[int] = []  # this step's buckets, in the order they completed here
        # This step's, until finish() or discard(): the buckets launched during backward in this
        # order (None: not drawn up yet), how many of them are launched, the complete ones.
        self._order: Optional[list[BucketRuntime]] = None
        self._launched = 0
        self._ready: set[int] = set()
        self._held_logged = False

    def _gathers_queued(self) -> None:
        """Copy-backs (the worker's all-gathers) may be queued and not issued yet: after step()'s
        norm all-reduce (Committer.apply queues them next) and refresh_device_params(). The
        collectives' next training-thread collective waits for them first (weakly: no cycle
        through the collectives)."""
        self.coll.queued_gathers.arm(weakref.WeakMethod(self.wait_for_queued_gathers))

    # what step() and the optimizer ask of a route (engine/step/route.py has the local one)
    alone = False  # other ranks may have gradients where this one has none: finish() tells
    learns_plans = False  # every rank keeps the initial plan (no re-planning of sharded state)

    def describe(self) -> str:
        return f", data parallel {self.coll.describe()}, {self.buckets.shard_numel()} host elements here"

    def host_elements(self) -> int:
        """The host state's elements held on this rank (its shards)."""
        return sum(rt.shard.used_numel for rt in self.buckets.host())

    # ---- training thread: gradients in ---------------------------------------------------------

    def collect(self, rt: BucketRuntime, k: int, grad: torch.Tensor) -> None:
        if rt.launched or rt.bucket.index in self._ready:
            raise GradientAfterLaunchError(
                f"A gradient for parameter {rt.bucket.slots[k].index} arrived after its bucket "
                f"{rt.bucket.index} was reduce-scattered, or queued to be (its last micro-batch had "
                "completed). Under data "
                "parallelism a bucket's gradient leaves the rank at its last micro-batch: set "
                "`gradient_accumulation_steps` (or Accelerate's accumulation) to the number of backward "
                "passes per step, and run a forward between backward and step() only in no_grad.")
        if rt.state is not BucketState.COLLECTING:
            self.waiter.wait_idle(rt)  # the bucket's last copy-back / step jobs read its buffers
            rt.move(BucketState.COLLECTING)
        slot = rt.bucket.slots[k]
        if rt.round_dev is None:
            rt.round_dev = self.transfer.device_empty(rt.shard.padded_numel, self.link_dtype).zero_()
        if rt.present[k] and rt.round_dev.dtype != FP32:
            rt.round_dev = rt.round_dev.float()  # accumulation over micro-batches in fp32
        view = BucketBuffers.view(rt.round_dev, slot)
        if rt.present[k]:
            view.add_(grad)
        else:
            view.copy_(grad)  # casts to the link dtype
        rt.present[k] = rt.round_fired[k] = True
        rt.fires[k] += 1
        if rt.round_complete:
            rt.round_fired = [False] * len(rt.bucket.slots)
            if rt.bucket.speculative and self.speculation.is_last_micro_batch(rt):
                self._ready.add(rt.bucket.index)
                self._ready_seq.append(rt.bucket.index)
                self._launch_in_order()

    def _launch_order(self) -> list[BucketRuntime]:
        """The host buckets launched during backward, in the plan's order: the same list on every
        rank (deferred buckets, and those without a gradient anywhere at the last step, launch at
        step(), after presence)."""
        if self._order is None:
            host = list(self.buckets.host())
            if self._learned is not None:
                rank = {index: position for position, index in enumerate(self._learned)}
                host.sort(key=lambda rt: rank.get(rt.bucket.index, len(rank) + rt.bucket.index))
            self._order = [rt for rt in host
                           if rt.bucket.speculative and rt.bucket.index not in self._unused_last_step]
        return self._order

    def _learn_order(self, completed: list[int]) -> None:
        """Once, at the first step with gradients (a collective on the control group, at the same
        point on every rank): rank 0's completion order becomes every rank's launch order."""
        host = [rt.bucket.index for rt in self.buckets.host()]
        seq = self.coll.broadcast_ints(completed, len(host))
        if seq:  # rank 0 saw buckets complete during backward; the rest follow in plan order
            self._learned = seq + [i for i in host if i not in seq]

    def _launch_in_order(self) -> None:
        """Launch the complete buckets with every bucket ahead of them launched (the rest wait:
        another rank may launch the one ahead, and its collective must pair with ours)."""
        order = self._launch_order()
        while self._launched < len(order) and order[self._launched].bucket.index in self._ready:
            rt = order[self._launched]
            self._launched += 1
            self.launch(rt, self.speculation.call(rt))

    def launch(self, rt: BucketRuntime, spec) -> None:
        """Reduce-scatter the bucket; its shard to the host; queue the shard's norm (and step)."""
        self._queue_jobs(rt, self._send(rt), spec)

    def _send(self, rt: BucketRuntime) -> tuple:
        """The bucket's reduce-scatter and the shard's copy to the host (LAUNCHED); returns what
        the receive job needs."""
        link = self.link_dtype
        flat, rt.round_dev = rt.round_dev, None
        if flat is None:  # no gradient here, but on another rank: this rank adds zeros
            flat = self.transfer.device_empty(rt.shard.padded_numel, link).zero_()
        else:
            if flat.dtype != link:
                flat = flat.to(link)
            if rt.bucket.speculative and self.policy.may_speculate():
                flat = spread_nonfinite(flat)
        shard_dev = self.transfer.device_empty(rt.shard.numel, link)
        self._host_collective_ready()
        self.coll.reduce_scatter_mean(flat, shard_dev)
        landed = rt.bufs.grad if link == FP32 else rt.bufs.recv_buffer(link)
        issued = time.perf_counter()
        event = self.transfer.grad_to_host(shard_dev, landed)
        self.runtime.record_stream(shard_dev, self.transfer.d2h)  # dropped now; not reused while d2h reads it
        self.counters.add("bytes_d2h", shard_dev.numel() * shard_dev.element_size())
        rt.staged = True
        rt.move(BucketState.LAUNCHED)
        rt.norm_ready.clear()
        return landed, event, issued

    def _queue_jobs(self, rt: BucketRuntime, sent: tuple, spec) -> None:
        landed, event, issued = sent
        jobs = [functools.partial(self.jobs.receive, rt, landed, event, True, True, issued),
                functools.partial(self.jobs.launch, rt, spec, self.step_state.budget)]
        self.worker.submit(lambda: [job() for job in jobs], rt.pending)

    def finish(self) -> bool:
        """At step(): launch the rest of the launch order (zeros where this rank has no
        gradient), agree on which parameters have a gradient anywhere, launch the late buckets
        some rank has a gradient for, average the device-resident buckets' gradients; every
        collective in the same order on every rank. False when no rank had any gradient."""
        rest = self._launch_order()[self._launched:]
        self._log_held(rest)
        # Sent before presence: a peer may already wait inside one of these reduce-scatters.
        sent = [(rt, self._send(self._collecting(rt))) for rt in rest]
        anywhere = self.presence()
        present = {rt.bucket.index: [bool(anywhere[s.index]) for s in rt.bucket.slots]
                   for rt in self.buckets.runtimes}
        completed = self._ready_seq
        self._new_step()
        if not bool(anywhere.any()):  # (an empty step says nothing about which buckets go unused)
            for rt, copy in sent:
                self._queue_jobs(rt, copy, None)  # the engine waits for them and forgets the step
            return False
        if self._learned is None:
            self._learn_order(completed)
        host = list(self.buckets.host())
        self._unused_last_step = frozenset(rt.bucket.index for rt in host if not any(present[rt.bucket.index]))
        for rt, copy in sent:  # stepped where some rank has a gradient (zeros from the others)
            rt.present = present[rt.bucket.index]
            self._queue_jobs(rt, copy, self._spec_at_step(rt))
        for rt in host:
            if not rt.launched and any(present[rt.bucket.index]):  # the late ones, in plan order
                rt.present = present[rt.bucket.index]
                self._queue_jobs(rt, self._send(self._collecting(rt)), self._spec_at_step(rt))
        self._average_device_buckets(present)
        return True

    def wait_for_queued_gathers(self) -> None:
        """Returns once the host worker has run every job queued so far, so it has issued (on NCCL
        not completed: they run on the h2d stream) every all-gather queued: step()'s copy-backs.
        The engine calls it at the end of step(), and the collectives call it before a
        training-thread collective of the engine's own (Collectives.queued_gathers).

        The hazard: NCCL needs the collectives of different communicators issued in one order on
        every rank, or kernels of two communicators wait for each other (a hang). Code the engine
        does not own issues collectives on other groups between steps: the Trainer gathers the
        token count on the default group at the start of every step (accelerator.gather,
        `average_tokens_across_devices`, on by default), logs, saves and meets at barriers;
        sequence parallelism's all-to-alls run in the forward. Were step() to return with
        all-gathers still queued, such a collective would come before them on one rank and after
        them on another, as the threads' timing falls. Returning from step() only after they are
        issued confines the worker's collectives to the inside of step(), whatever the caller
        issues, on any group, by any means (torch.distributed's functions, functional
        collectives, another library's own calls): no wrapper of torch.distributed could see them
        all. The cost: the next forward no longer overlaps the worker's host work queued at
        step() (the Adam step of a bucket launched at step(), the replay of rolled-back buckets).
        A step whose speculative steps all commit queues only copy-backs, which the worker issues
        back to back."""
        for rt in self.buckets.host():
            self.waiter.wait_idle(rt)

    def _average_device_buckets(self, present: dict) -> None:
        """In bucket order, after presence: the same collectives on every rank."""
        for rt in self.buckets.on_device():
            if not any(present[rt.bucket.index]):
                continue
            for k, slot in enumerate(rt.bucket.slots):
                if not rt.present[k]:
                    BucketBuffers.view(rt.bufs.grad, slot).zero_()  # stale from an earlier step
            rt.present = present[rt.bucket.index]
            self._host_collective_ready()
            self.coll.all_reduce_mean(rt.bufs.grad)

    def _collecting(self, rt: BucketRuntime) -> BucketRuntime:
        if rt.state is not BucketState.COLLECTING:
            self.waiter.wait_idle(rt)
            rt.move(BucketState.COLLECTING)
        return rt

    def _spec_at_step(self, rt: BucketRuntime):
        """With replicas, a bucket launched at step() is stepped speculatively when it would have
        been during backward: its replicas (other ranks holding the same shard, some of which
        may have launched it during backward) must take the same path, bitwise (a speculative
        step rolled back and replayed differs in the last bits from one step). Without replicas
        each shard is stepped on one rank only: no speculation at step(), where it cannot overlap."""
        if self.coll.topology.replicas == 1 or not rt.bucket.speculative:
            return None
        return self.speculation.call(rt)

    def _log_held(self, rest: list[BucketRuntime]) -> None:
        """Once: buckets complete during backward but held behind one this rank had no
        gradient for (their overlap with backward is lost)."""
        held = [rt for rt in rest if rt.bucket.index in self._ready]
        if self._held_logged or not held:
            return
        self._held_logged = True
        ahead = [rt for rt in rest[:rest.index(held[-1])] if rt.bucket.index not in self._ready]
        missing = sorted(s.index for rt in ahead for k, s in enumerate(rt.bucket.slots) if not rt.present[k])
        logger.info("SuperOffload: data parallel: host buckets %s were complete during backward but held "
                    "until step() (no overlap with backward): buckets %s ahead of them in the launch order "
                    "were incomplete here, with no gradient on this rank for parameters %s. Every rank "
                    "reduce-scatters the buckets in one order. Logged once.",
                    [rt.bucket.index for rt in held], [rt.bucket.index for rt in ahead], missing)

    def presence(self) -> torch.Tensor:
        """Per parameter: whether any rank has a gradient for it this step (one all-reduce on the
        control group, after this rank's launches)."""
        local = torch.zeros(len(self.params), dtype=torch.int32)
        for rt in self.buckets.runtimes:
            for k, slot in enumerate(rt.bucket.slots):
                local[slot.index] = int(rt.present[k])
        return self.coll.all_reduce_presence(local)

    def _new_step(self) -> None:
        self._order, self._launched, self._ready, self._ready_seq = None, 0, set(), []

    def discard(self) -> None:
        """zero_grad() between backward and step(): forget the device accumulation; undo the
        speculative steps (their weights never reached the device)."""
        self._new_step()
        for rt in self.buckets.host():
            rt.round_dev = None
            if rt.launched:
                self.waiter.reopen(rt)

    def global_sum_squares(self, parts: dict[int, float]) -> float:
        """Local shards' sum all-reduced over the shard group (one float64 scalar), plus the
        device-resident buckets' (their averaged gradients are the same on every rank).
        `parts`: every bucket's sum of squares here, by bucket index (a host bucket's: its shard's)."""
        host_buckets = {rt.bucket.index for rt in self.buckets.host()}
        host = sum(parts[i] for i in sorted(parts) if i in host_buckets)
        device = sum(parts[i] for i in sorted(parts) if i not in host_buckets)
        total = self.coll.all_reduce_sum(host) + device
        self._gathers_queued()  # step()'s last collective: the copy-backs are queued next
        return total

    def commit_speculative(self, rt: BucketRuntime, call) -> None:
        """The committed shard's all-gather (the speculative step sent nothing: engine/dp/gather.py)."""
        self.worker.submit(functools.partial(self.jobs.copy_back, rt, call), rt.pending)

    def _host_collective_ready(self) -> None:
        """gloo reads device tensors from the host at once: what the current stream has queued
        must have run (NCCL orders its collectives on the stream instead)."""
        if self.coll.backend != "nccl" and self.transfer.is_async:
            rt = self.runtime
            done = rt.new_event()
            done.record(rt.current_stream())
            done.synchronize()

    def release(self) -> None:
        """close(): drop the all-gather buffers (device memory; the worker is stopped) and the
        process groups (their gloo threads end with the last reference)."""
        self.gather.release()
        self.coll.release()

    def refresh_device_params(self, skip: Callable[[torch.Tensor], bool]) -> None:
        """Every host bucket's weights from the shards' masters (after loading state), in bucket
        order on every rank; device-resident buckets from their own masters. (`skip`, weight-flow's
        parameters: the gather knows them.)"""
        self._gathers_queued()
        for rt in self.buckets.host():
            self.worker.submit(functools.partial(self._refresh, rt), rt.pending)
        with torch.no_grad():
            for rt in self.buckets.on_device():
                for p, slot in zip(rt.params, rt.bucket.slots):
                    p.detach().copy_(BucketBuffers.view(rt.bufs.master, slot).view(slot.shape))
        self.waiter.synchronize()

    def _refresh(self, rt: BucketRuntime) -> None:
        self.transfer.wait_host_before_write(rt.h2d_event)
        if rt.bufs.lowp is not None:
            rt.bufs.lowp.copy_(rt.bufs.master)
        if not self.gather.all_flow(rt):
            rt.h2d_event = self.gather.gather_back(rt)

    # ---- checkpoints ------------------------------------------------------------------------------

    def pieces(self):
        """(param index, start, end, shape, step, views) for every piece this rank saves: its
        shard of every bucket (a device-resident bucket is replicated; each rank saves its shard
        of it all the same, so the files never overlap)."""
        for rt in self.buckets.runtimes:
            shard = rt.shard if rt.shard is not None else self.shard(rt.bucket)
            for piece in shard.pieces:
                slot = rt.bucket.slots[piece.slot]
                if rt.shard is not None:
                    lo, hi = piece.offset, piece.offset + piece.numel
                else:
                    lo, hi = slot.offset + piece.param_start, slot.offset + piece.param_end
                yield (piece.index, piece.param_start, piece.param_end, slot.shape,
                       self.buckets.param_steps[piece.index], _range_views(rt.bufs, lo, hi))

    def state_dict(self, groups: list, extras: Mapping[str, Any]) -> dict:
        """This rank's shard (the caller waited for the host's jobs): `extras` less the learned
        plan and the state precision, which a shard file does not keep."""
        extra = {k: v for k, v in extras.items() if k in SHARD_EXTRAS}
        return shard_state_dict(self.pieces(), rank=self.rank, world=self.world,
                                param_groups=_groups_with_indices(groups), extra=extra)

    def stepped(self) -> list[int]:
        """The parameters with state on this rank (a piece of them, stepped)."""
        return sorted({piece[0] for piece in self.pieces() if piece[4] > 0})

    def param_values(self, index: int) -> tuple:
        """(this rank's piece of parameter `index`'s state, its shape: flat, its step)."""
        values = next(piece[5] for piece in self.pieces() if piece[0] == index)
        return values, (-1,), self.buckets.param_steps[index]

    def save(self, directory: str, state_dict: Callable[[], dict]) -> list[str]:
        return write_shards(self.coll, directory, state_dict)

    def load_state(self, sd: Any, groups: list, adopt_plan: Callable[[dict], None]) -> tuple:
        """Any saved layout: this rank reads its own ranges (a saved learned plan is not
        applied: every rank keeps the initial plan). Returns (saved param groups, extras)."""
        source = RangeSource.of(sd)
        _check_layout({"state": {}, "param_groups": source.param_groups, "superoffload": {}}, groups)
        self.load_state_dict(sd)
        return source.param_groups, source.extra

    def load_state_dict(self, state: Any) -> RangeSource:
        """Load this rank's ranges from any saved layout (a list of every rank's shard state
        dicts, one of them when they are one, or a single-process state dict); returns the source
        (its param groups and extras are applied by the caller)."""
        source = RangeSource.of(state)
        for index in source.indices():
            if not 0 <= index < len(self.params) or source.numel(index) != self.params[index].numel():
                raise ValueError(f"The saved optimizer state of parameter {index} has {source.numel(index)} "
                                 f"elements; this optimizer's parameter {index} has "
                                 f"{self.params[index].numel() if 0 <= index < len(self.params) else 'none'}. "
                                 "Is this checkpoint from another model?")
        self.waiter.synchronize()
        if any(any(rt.present) for rt in self.buckets.runtimes):
            raise RuntimeError("load_state_dict() was called between backward and step(); load a checkpoint "
                               "before the backward of the step that should use it (or call zero_grad() first).")
        converted: dict[tuple[str, str], int] = {}
        for rt in self.buckets.runtimes:
            on_host = rt.shard is not None
            pieces = rt.shard.pieces if on_host else [self._whole(rt, k) for k in range(len(rt.bucket.slots))]
            ours = self.buckets.policy.state_precision if rt.bufs.compact else "fp32"
            for piece in pieces:
                slot = rt.bucket.slots[piece.slot]
                lo = piece.offset if on_host else slot.offset
                hi = lo + piece.numel
                values, changed = {}, False
                if source.step(piece.index):
                    values, changed = source.read_state(piece.index, piece.param_start, piece.param_end, ours,
                                                        self.buckets.codec)
                if changed:
                    key = (source.precision(piece.index), ours)
                    converted[key] = converted.get(key, 0) + 1
                # never stepped, or torch.optim's: keep the master, zero moments
                for kind, view in _range_views(rt.bufs, lo, hi, kinds=True).items():
                    if kind in values:
                        view.copy_(values[kind])
                    elif kind not in MASTER_KINDS:
                        view.zero_()
                if rt.bufs.lowp is not None:
                    rt.bufs.lowp[lo:hi].copy_(rt.bufs.master[lo:hi])
        for index in range(len(self.params)):
            self.buckets.param_steps[index] = source.step(index)
        for (saved, ours), count in sorted(converted.items()):
            logger.warning("SuperOffload: converted %d piece%s of the saved optimizer state from %s to %s (this "
                           "optimizer's state precision there)", count, "" if count == 1 else "s", saved, ours)
        return source

    @staticmethod
    def _whole(rt: BucketRuntime, k: int):
        from superoffload_hf.plan.shard import Piece

        slot = rt.bucket.slots[k]
        return Piece(slot=k, index=slot.index, param_start=0, param_end=slot.numel, offset=slot.offset)


def spread_nonfinite(flat: torch.Tensor) -> torch.Tensor:
    """In place: `flat` unchanged (bitwise) where every element is finite; else its largest |x|
    (inf, or NaN where one is NaN) in every element. Reduce-scattered, a non-finite gradient then
    reaches every rank's shard, not only the one holding the element: each rank sees at this
    bucket's norm that the step will be skipped and speculates neither it nor any bucket after
    it, as one process does. (A peer that did not see it stepped those speculatively and the skip
    rolled them back; the inverse rollback restores a moment only to within an ulp of the step's
    term, so an element whose moments were far smaller, a rarely seen embedding row's, came back
    far off, and the next step moved it by up to lr.) The step is skipped either way (this
    gradient is never used) and the global norm is inf or NaN as before. On the device, without
    a host synchronisation."""
    worst = torch.linalg.vector_norm(flat, float("inf"))
    return torch.where(torch.isfinite(worst), flat, worst, out=flat)


def _range_views(bufs: BucketBuffers, lo: int, hi: int, kinds: bool = False) -> dict[str, torch.Tensor]:
    """Views of elements [lo, hi) of a bucket's (or shard's) state: its six compact kinds (the
    scales of the groups from `lo`, a multiple of the group: shard.py), or the fp32 master and
    moments, keyed as the shard files are (`kinds`: by buffer kind)."""
    if bufs.compact:
        return {kind: (getattr(bufs, kind)[lo // COMPACT_GROUP:scale_numel(hi)] if kind in SCALE_KINDS
                       else getattr(bufs, kind)[lo:hi]) for kind in COMPACT_KINDS}
    return {(kind if kinds else key): getattr(bufs, kind)[lo:hi] for key, kind in FP32_KINDS.items()}
