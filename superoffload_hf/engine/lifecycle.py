"""BucketRuntime: one bucket's buffers, parameters and per-step bookkeeping, and the host jobs
that run on it in the worker thread.

Lifecycle of a host bucket in one accumulation step (training thread unless noted):

1. Each gradient of the bucket is copied into a transient flat device buffer (`round_dev`,
   in the dtype that crosses the link) and `p.grad` is released. A *round* ends when every
   parameter of the bucket delivered a gradient, or when one delivers a second one; the round
   is then flushed: copied to the host and, in the worker, copied or added in fp32 into
   `bufs.grad` (the accumulation never happens in low precision).
2. The round that completes the last micro-batch *launches* the bucket: the worker computes
   its float64 sum of squares and, when speculating and finite, steps it at once (`spec`
   records the call) and copies the new weights back to the device.
3. step() validates with the global norm and commits, rolls back and replays, or skips.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch

from superoffload_hf.engine import stepper
from superoffload_hf.engine.buffers import BucketBuffers
from superoffload_hf.engine.plan import Bucket
from superoffload_hf.engine.stepper import StepCall
from superoffload_hf.engine.worker import Pending


class BucketRuntime:
    def __init__(self, bucket: Bucket, bufs: BucketBuffers, params: list[torch.Tensor]):
        self.bucket = bucket
        self.bufs = bufs
        self.params = params  # the device parameters, in slot order
        self.pending = Pending()  # worker jobs queued on this bucket
        self.norm_ready = threading.Event()
        self.h2d_event = None  # the last copy-back to the device (None: nothing in flight)
        self.reset()

    def reset(self) -> None:
        """Forget this accumulation step (after step() or a discard)."""
        n = len(self.bucket.slots)
        self.present = [False] * n  # got a gradient in this accumulation step
        self.fires = [0] * n  # gradients delivered in this accumulation step
        self.round_fired = [False] * n
        self.round_dev: Optional[torch.Tensor] = None
        self.staged = False  # bufs.grad holds gradients of this accumulation step
        self.launched = False  # a norm job was queued for the current contents of bufs.grad
        self.sumsq: Optional[float] = None
        self.spec: Optional[StepCall] = None  # the speculative step taken, if any
        self.no_spec = False  # a gradient arrived after launch: no more speculation this step
        self.redo = False  # a speculative step was rolled back before step(): stepping is a replay
        self.norm_ready.clear()

    @property
    def round_complete(self) -> bool:
        return all(self.round_fired)

    def take_round(self) -> torch.Tensor:
        """The round's flat device gradient, absent parameters zeroed; starts a new round."""
        flat = self.round_dev
        for k, fired in enumerate(self.round_fired):
            if not fired:
                BucketBuffers.view(flat, self.bucket.slots[k]).zero_()
        self.round_dev = None
        self.round_fired = [False] * len(self.bucket.slots)
        return flat


class HostJobs:
    """The work the host worker does on buckets. Methods run in the worker thread."""

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
        rt.norm_ready.set()  # step() may decide now; anything it queues runs after this job
        self.counters.host_step_seconds += time.perf_counter() - start
        if speculate:  # never step a bucket whose own gradient is not finite
            self.step(rt, spec, snapshot=self.snapshot)

    def step(self, rt: BucketRuntime, call: StepCall, snapshot: bool = False) -> None:
        self.transfer.wait_host_before_write(rt.h2d_event)  # the previous copy-back still reads master/lowp
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
