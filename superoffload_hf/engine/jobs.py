"""The work the host worker does on a bucket. Every method runs in the worker thread.

* `receive`: a gradient round has been queued device->host; wait for it to land, then copy or add
  it in fp32 into the bucket's gradient buffer (the accumulation never happens in low precision).
* `launch`: the bucket's float64 sum of squares; then, when speculating and the step so far still
  admits a commit, its speculative step and copy-back (LAUNCHED -> SPECULATED, else STAGED).
* `step` / `rollback`: after validation, the committed step, or the undoing of a speculative one
  (then its replay with the clip coefficient, if any), each followed by the copy-back.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from superoffload_hf.engine import stepper
from superoffload_hf.engine.lifecycle import BucketRuntime, BucketState
from superoffload_hf.engine.stepper import StepCall


class HostJobs:
    def __init__(self, adam, transfer, adamw: bool, snapshot: bool, counters):
        self.adam = adam
        self.transfer = transfer
        self.adamw = adamw
        self.snapshot = snapshot
        self.counters = counters

    def receive(self, rt: BucketRuntime, landed: torch.Tensor, event, first: bool) -> None:
        self.transfer.wait_host(event)  # the gradient copy into `landed` has finished
        if landed is not rt.bufs.grad:
            if first:
                rt.bufs.grad.copy_(landed)
            else:
                rt.bufs.grad.add_(landed)  # fp32 accumulation over micro-batches

    def launch(self, rt: BucketRuntime, spec: Optional[StepCall], budget=None) -> None:
        """Norm of the bucket; then its speculative step if `spec` is given and `budget`
        (a SpeculationBudget) still admits it, which also keeps non-finite gradients out."""
        start = time.perf_counter()
        rt.sumsq = self.adam.sum_squares(rt.bufs.grad)
        speculate = spec is not None and budget.admit(rt.sumsq)
        rt.spec = spec if speculate else None
        rt.move(BucketState.SPECULATED if speculate else BucketState.STAGED)
        rt.norm_ready.set()  # step() may decide now; anything it queues runs after this job
        self.counters.host_step_seconds += time.perf_counter() - start
        if speculate:  # never step a bucket whose own gradient is not finite
            self.step(rt, spec, snapshot=self.snapshot)

    def step(self, rt: BucketRuntime, call: StepCall, snapshot: bool = False) -> None:
        self.transfer.wait_host_before_write(rt.h2d_event)  # the last copy-back still reads master/lowp
        start = time.perf_counter()
        if snapshot:
            rt.bufs.take_snapshot()
        stepper.apply(self.adam.adam_step_, rt.bufs, call, self.adamw, rt.bufs.lowp)
        self.counters.host_step_seconds += time.perf_counter() - start
        self.copy_back(rt, call)

    def rollback(self, rt: BucketRuntime, call: StepCall, redo: Optional[StepCall] = None) -> None:
        """Undo the speculative `call`; then take `redo` (e.g. clipped) if given."""
        self.transfer.wait_host_before_write(rt.h2d_event)
        start = time.perf_counter()
        if self.snapshot:
            rt.bufs.restore_snapshot()
        else:
            stepper.apply(self.adam.adam_rollback_, rt.bufs, call, self.adamw, rt.bufs.lowp)
        if redo is not None:
            stepper.apply(self.adam.adam_step_, rt.bufs, redo, self.adamw, rt.bufs.lowp)
        self.counters.host_step_seconds += time.perf_counter() - start
        self.copy_back(rt, redo or call)

    def copy_back(self, rt: BucketRuntime, call: StepCall) -> None:
        ks = stepper.run_slots(call)
        src = rt.bufs.lowp if rt.bufs.lowp is not None else rt.bufs.master
        rt.h2d_event = self.transfer.params_to_device(
            src, [rt.params[k] for k in ks], [rt.bucket.slots[k].offset for k in ks])
        self.counters.bytes_h2d += sum(rt.bucket.slots[k].numel for k in ks) * src.element_size()
