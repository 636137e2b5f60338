"""The work the host worker does on a bucket. Every method runs in the worker thread.

* `receive`: a gradient round has been queued device->host; wait for it to land, then copy or add
  it in fp32 into the bucket's gradient buffer (the accumulation never happens in low precision),
  with the kernel's own thread pool, never torch's intra-op pool (`accelerate launch` sets it to
  one thread, and its spinning OpenMP workers would steal the cores from the host Adam). A step
  made of one round in the link dtype is not upcast at all: the kernel reads it as it landed.
* `launch`: the bucket's float64 sum of squares; then, when speculating and the step so far still
  admits a commit, its speculative step and copy-back (LAUNCHED -> SPECULATED, else STAGED).
* `step` / `rollback`: after validation, the committed step, or the undoing of a speculative one
  (then its replay with the clip coefficient, if any), each followed by the copy-back.

Compact host state (`compact`): the step is the back end's `compact_step_` (stepper.apply_compact),
a speculative step first keeps the six tensors' bytes (`bytes_copy_`) and a rollback restores
them bit-exactly (quantisation is not invertible), and the copy-back sends `master_bf16` as it is.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from superoffload_hf.engine.state import stepper
from superoffload_hf.engine.state.lifecycle import BucketRuntime, BucketState
from superoffload_hf.engine.state.stepper import StepCall
from superoffload_hf.perf.timeline import D2H, H2D, HOST_ADAM, Timeline


class HostJobs:
    def __init__(self, adam, transfer, adamw: bool, snapshot: bool, counters, copies, timeline: Timeline = None,
                 compact: bool = False):
        self.adam = adam
        self.transfer = transfer
        self.adamw = adamw
        self.compact = compact
        self.snapshot = snapshot or compact  # compact state: rollback restores the pre-step bytes
        self.counters = counters
        self.timeline = timeline if timeline is not None else Timeline.disabled()
        # The copy-back: DeviceCopyBack (one process: after every step and rollback), or under data
        # parallelism the shard's all-gather (engine/dp/gather.py), issued only after validation.
        self.copies = copies

    def _host(self, rt: BucketRuntime, what: str, start: float, **args) -> float:
        """Account host time since `start` (and show it on the timeline); returns now."""
        end = time.perf_counter()
        self.counters.host_step_seconds += end - start
        self.timeline.span(HOST_ADAM, f"{what} b{rt.bucket.index}", start, end, bucket=rt.bucket.index, **args)
        return end

    def receive(self, rt: BucketRuntime, landed: torch.Tensor, event, first: bool, keep: bool,
                issued: float = 0.0) -> None:
        """`keep`: this round is the whole step's gradient; step from `landed` as it is.
        `issued`: when the training thread queued the copy (for the timeline)."""
        self.transfer.wait_host(event)  # the gradient copy into `landed` has finished
        start = time.perf_counter()
        self.timeline.span(D2H, f"grad b{rt.bucket.index}", issued or start, start, bucket=rt.bucket.index,
                           bytes=landed.numel() * landed.element_size(), clock="host (issue to seen landed)")
        if landed is rt.bufs.grad or keep:
            rt.grad_in = landed
            return
        grad = rt.bufs.grad_buffer()  # (allocated here where the policy keeps none: grad_lazy)
        if first:
            self.adam.grad_copy_(grad, landed)
            rt.grad_in = grad
        else:
            self.adam.grad_accumulate_(grad, landed)  # fp32 accumulation over micro-batches
        self._host(rt, "upcast" if first else "accumulate", start)

    def hold_in_fp32(self, rt: BucketRuntime) -> None:
        """A kept round must be accumulated after all (its bucket was re-opened): upcast it
        before the next round lands in the same receive buffer."""
        if rt.grad_in is not rt.bufs.grad:
            grad = rt.bufs.grad_buffer()  # (allocated here where the policy keeps none: grad_lazy)
            self.adam.grad_copy_(grad, rt.grad_in)
            rt.grad_in = grad

    def launch(self, rt: BucketRuntime, spec: Optional[StepCall], budget=None) -> None:
        """Norm of the bucket; then its speculative step if `spec` is given and `budget`
        (a SpeculationBudget) still admits it, which also keeps non-finite gradients out."""
        start = time.perf_counter()
        rt.sumsq = self.adam.sum_squares(rt.grad_in)
        speculate = spec is not None and budget.admit(rt.sumsq)
        rt.spec = spec if speculate else None
        rt.move(BucketState.SPECULATED if speculate else BucketState.STAGED)
        rt.norm_ready.set()  # step() may decide now; anything it queues runs after this job
        self._host(rt, "norm", start)
        if speculate:  # never step a bucket whose own gradient is not finite
            self.step(rt, spec, snapshot=self.snapshot, speculative=True)

    def step(self, rt: BucketRuntime, call: StepCall, snapshot: bool = False, speculative: bool = False) -> None:
        self.transfer.wait_host_before_write(rt.h2d_event)  # the last copy-back still reads master/lowp
        self.transfer.wait_host_before_write(rt.fetch_event, "host_waits_fetch")  # so may a weight-flow fetch
        start = time.perf_counter()
        if snapshot:
            rt.bufs.take_snapshot(self._snapshot_copy)
        self._step(rt, call)
        self._host(rt, "speculative step" if speculative else "step", start, speculative=speculative)
        if speculative:
            self.copies.after_speculative_step(rt, call)
        else:
            self.copy_back(rt, call)

    def rollback(self, rt: BucketRuntime, call: StepCall, redo: Optional[StepCall] = None) -> None:
        """Undo the speculative `call`; then take `redo` (e.g. clipped) if given."""
        self.transfer.wait_host_before_write(rt.h2d_event)
        self.transfer.wait_host_before_write(rt.fetch_event, "host_waits_fetch")
        start = time.perf_counter()
        if self.snapshot:
            rt.bufs.restore_snapshot(self._snapshot_copy, self.adam.lowp_copy_)
        else:
            stepper.apply(self.adam.adam_rollback_, rt.bufs, rt.grad_in, call, self.adamw, rt.bufs.lowp)
        if redo is not None:
            self._step(rt, redo)
        self._host(rt, "rollback + replay" if redo is not None else "rollback", start, rollback=True,
                   replay=redo is not None)
        self.copies.after_rollback(rt, call, redo)

    def _step(self, rt: BucketRuntime, call: StepCall) -> None:
        if rt.bufs.compact:
            stepper.apply_compact(self.adam, rt.bufs, rt.grad_in, call, self.adamw)
        else:
            stepper.apply(self.adam.adam_step_, rt.bufs, rt.grad_in, call, self.adamw, rt.bufs.lowp)

    @property
    def _snapshot_copy(self):
        """The kernel-pool copy a snapshot takes and restores with: fp32 state, or any dtype's bytes."""
        return self.adam.bytes_copy_ if self.compact else self.adam.grad_copy_

    def copy_back(self, rt: BucketRuntime, call: StepCall) -> None:
        self.copies.send(rt, call)


class DeviceCopyBack:
    """One process: a stepped bucket's weights from the host to its device parameters, after
    every step and every rollback (a speculative step's go at once: the forward before step()
    re-opens the bucket if it needs the weights of before)."""

    def __init__(self, transfer, counters, timeline: Timeline, flows: Callable[[torch.Tensor], bool] = lambda p: False):
        self.transfer, self.counters, self.timeline = transfer, counters, timeline
        self.flows = flows  # weight-flow (engine/flow.py): its parameters get no copy-back

    def after_speculative_step(self, rt: BucketRuntime, call: StepCall) -> None:
        self.send(rt, call)

    def after_rollback(self, rt: BucketRuntime, call: StepCall, redo: Optional[StepCall]) -> None:
        self.send(rt, redo or call)

    def send(self, rt: BucketRuntime, call: StepCall) -> None:
        if rt.params_alias_master:
            return  # the parameters are views of master: the step updated them in place
        ks = stepper.run_slots(call)
        kept = [k for k in ks if not self.flows(rt.params[k])]  # weight-flow's: fetched at their next use
        if len(kept) < len(ks):
            if not kept:
                return
            ks = kept
        src = rt.bufs.copy_back_source  # compact state: master_bf16, sent as it is
        start = time.perf_counter()
        rt.h2d_event = self.transfer.params_to_device(
            src, [rt.params[k] for k in ks], [rt.bucket.slots[k].offset for k in ks])
        moved = sum(rt.bucket.slots[k].numel for k in ks) * src.element_size()
        self.counters.add("bytes_h2d", moved)
        self.timeline.span(H2D, f"params b{rt.bucket.index}", start, time.perf_counter(), bucket=rt.bucket.index,
                           bytes=moved, clock="host (issue)")
