"""Where the training thread waits: for a bucket's worker jobs, and (in stream order) for the
copy-backs a forward is about to read.

`inflight` holds the buckets whose parameters the compute stream may not read yet: a copy-back
was issued that it has not waited for, or the bucket was stepped speculatively before step()
(a forward then must see the weights of before the step: the bucket is re-opened, i.e. rolled
back, first).
"""

from __future__ import annotations

from typing import Callable, Iterable

import time

import torch

from superoffload_hf.engine.lifecycle import BucketRuntime, BucketState
from superoffload_hf.engine.reads import ModuleReads


class Waiter:
    def __init__(self, buckets, worker, transfer, observer, reopen: Callable[[BucketRuntime], None],
                 reads: ModuleReads):
        self.buckets, self.worker, self.transfer, self.observer = buckets, worker, transfer, observer
        self.reads = reads
        self.reopen = reopen
        self.inflight: set[BucketRuntime] = set()

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
        if rt.state is BucketState.RETURNING:
            rt.move(BucketState.IDLE)

    def synchronize(self) -> None:
        """Wait for every queued host job; later device work sees their copy-backs."""
        for rt in self.buckets.runtimes:
            self.wait_idle(rt)
            self.transfer.wait_device(rt.h2d_event)
            if rt.state is BucketState.RETURNING:
                rt.move(BucketState.IDLE)
        self.inflight.clear()
