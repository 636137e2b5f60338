"""Where the training thread waits: for a bucket's worker jobs, and (in stream order) for the
copy-backs a forward is about to read.

`inflight` holds the buckets whose parameters the compute stream may not read yet: a copy-back
was issued that it has not waited for, or the bucket was stepped speculatively before step()
(a forward then must see the weights of before the step: the bucket is re-opened, i.e. rolled
back, first).

Writes between step() and the landing of a copy-back race with it (on CUDA the copy-back's side
stream and the write's compute stream are unordered). The engine writes parameters through `.data`
aliases, which leave their autograd version counters alone; step() bumps each returning parameter's
version once (as torch.optim's in-place step does, so a retained graph still refuses to reuse it) and
records it. A version that moved by landing time is a write through the parameter, `.detach()` or a
view (`with torch.no_grad(): p.copy_(x)`, `p.detach().mul_(...)`): refused, naming
`optimizer.synchronize()`. A write through `p.data` has its own counter and cannot be seen here.
"""

from __future__ import annotations

import functools
import time
from typing import Iterable

import torch

from superoffload_hf.engine.state.lifecycle import BucketRuntime, BucketState
from superoffload_hf.engine.reads import ModuleReads

WRITE_IN_FLIGHT = (
    "parameter {slot} of bucket {bucket} (shape {shape}) was written between optimizer.step() and "
    "the next forward, while the step's updated weights were still being copied into it: the write "
    "and the copy race, and one of them is lost. Call optimizer.synchronize() after step() and before "
    "writing parameters directly (an EMA, `p.copy_(...)` under no_grad); forwards, state_dict() and "
    "load_state_dict() wait by themselves."
)


class Waiter:
    def __init__(self, buckets, worker, transfer, observer, reads: ModuleReads, jobs, step_state):
        self.buckets, self.worker, self.transfer, self.observer = buckets, worker, transfer, observer
        self.reads = reads
        self.jobs, self.step = jobs, step_state  # reopen(): the rollback job, the step's flags
        self.inflight: set[BucketRuntime] = set()
        self.versions: dict[BucketRuntime, list[int]] = {}  # armed by step(), checked at landing

    def arm_write_check(self, updated: Iterable[BucketRuntime]) -> None:
        """Training thread, end of step(): each updated host bucket's parameters get their version
        bumped once for the step's update (see the module docstring), and it is recorded: what it
        must still be when the bucket's copy-back lands."""
        self.versions.clear()
        for rt in updated:
            for p in rt.params:
                torch.autograd.graph.increment_version(p)
            self.versions[rt] = [p._version for p in rt.params]

    def _check_no_write(self, rt: BucketRuntime) -> None:
        expected = self.versions.pop(rt, None)
        if expected is None:
            return
        for k, (p, version) in enumerate(zip(rt.params, expected)):
            if p._version != version:
                self.versions.clear()
                raise RuntimeError(WRITE_IN_FLIGHT.format(slot=k, bucket=rt.bucket.index, shape=tuple(p.shape)))

    def wait(self, event, why: str = "host work") -> None:
        if not event.is_set():
            start = time.perf_counter()
            self.observer.thread_waited(why, start, self.worker.wait(event))
        self.worker.raise_if_failed()

    def wait_idle(self, rt: BucketRuntime) -> None:
        self.wait(rt.pending.idle, f"bucket {rt.bucket.index} busy")

    def wait_for_module(self, module: torch.nn.Module) -> None:
        """Before `module` runs forward: its parameters' buckets must be updated on the device.
        A forward between backward and step() (another micro-batch than configured, an
        evaluation, a checkpointed layer recomputed in backward) must read the weights of
        before the step: a speculatively stepped bucket is rolled back first. Its parameters
        are its own and those its forward reads for submodules that never run (reads.py)."""
        self.wait_for_params(self.reads.of_module(module))

    def wait_for_params(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            rt = self.buckets.runtime_of.get(p)
            if rt is not None and rt in self.inflight:
                self._land(rt)

    def _land(self, rt: BucketRuntime) -> None:
        if rt.launched:
            self.reopen(rt)
        self.wait_idle(rt)
        # queued on the compute stream, not blocking; timed with events (device idle)
        self.observer.around_device_wait(lambda: self.transfer.wait_device(rt.h2d_event))
        self.inflight.discard(rt)
        self._check_no_write(rt)
        if rt.state is BucketState.RETURNING:
            rt.move(BucketState.IDLE)

    def expect_landing(self, returning: Iterable[BucketRuntime]) -> None:
        """End of a step() that returns early: the compute stream may read these buckets only
        after their copy-backs land (in place of the last step's set)."""
        self.inflight.clear()
        self.inflight.update(returning)

    def reopen(self, rt: BucketRuntime) -> None:
        """A gradient arrived for a launched bucket, or a forward needs it before step(): undo
        its speculative step, recount its norm."""
        self.wait_idle(rt)
        if rt.spec is not None:
            spec, rt.spec = rt.spec, None
            self.worker.submit(functools.partial(self.jobs.rollback, rt, spec), rt.pending)
            self.step.speculative = self.step.rolled_back = rt.redo = True
            self.inflight.add(rt)  # the restored weights travel back to the device
        rt.move(BucketState.COLLECTING)
        rt.sumsq, rt.no_spec = None, True
        rt.norm_ready.clear()

    def synchronize(self) -> None:
        """Wait for every queued host job; later device work sees their copy-backs."""
        for rt in self.buckets.runtimes:
            self.wait_idle(rt)
            self.transfer.wait_device(rt.h2d_event)
            if rt.state is BucketState.RETURNING:
                rt.move(BucketState.IDLE)
        self.inflight.clear()
        armed, self.versions = self.versions, {}
        for rt, expected in armed.items():
            self.versions[rt] = expected
            self._check_no_write(rt)
