"""The sharded route's all-gathers: a host bucket's updated shard back into the whole bucket's
weights on the device (the worker's copy-back, `gather_back`), and a bucket's whole weights for a
weight-flow fetch (`gather_for_flow`, on the training thread). Built before the host jobs (whose
copy-back it is, under data parallelism) and weight-flow (whose fetch it is): it needs neither.
DESIGN.md section 8; the ordering rules across the two threads are device/collectives.py's."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from superoffload_hf.engine.state.buffers import BucketBuffers
from superoffload_hf.engine.state.lifecycle import BucketRuntime
from superoffload_hf.engine.state.stepper import StepCall
from superoffload_hf.perf.timeline import H2D, Timeline


class ShardGather:
    def __init__(self, collectives, *, buckets, runtime, transfer, counters, timeline: Timeline,
                 flows: Callable[[torch.Tensor], bool]):
        self.coll, self.buckets, self.runtime, self.transfer, self.counters = (collectives, buckets, runtime,
                                                                              transfer, counters)
        self.timeline = timeline
        self.flows = flows  # weight-flow (engine/flow.py): its parameters are gathered at each fetch
        self._gather_pairs: dict[torch.dtype, tuple] = {}  # worker thread only (_gather_buffers)

    # ---- the host jobs' copy-back (engine/step/jobs.py; worker thread) ---------------------------------
    # Issued only after validation (a speculative step or a mere rollback leaves the device weights
    # as they were), so every rank issues the same all-gathers in the same order.

    def after_speculative_step(self, rt: BucketRuntime, call: StepCall) -> None:
        """Nothing: the device keeps the weights of before until step() validates (dp.py commits)."""

    def after_rollback(self, rt: BucketRuntime, call: StepCall, redo: Optional[StepCall]) -> None:
        if redo is not None:  # replayed (clipped): its weights go; a mere rollback changed nothing there
            self.send(rt, redo)

    def send(self, rt: BucketRuntime, call: StepCall) -> None:
        if self.all_flow(rt):
            return  # weight-flow: every rank's next fetch gathers them (no all-gather here on any rank)
        start = time.perf_counter()
        rt.h2d_event = self.gather_back(rt)
        self.timeline.span(H2D, f"all-gather b{rt.bucket.index}", start, time.perf_counter(),
                           bucket=rt.bucket.index, clock="host (issue)")

    def gather_back(self, rt: BucketRuntime):
        """The updated shard to the device; all-gather the bucket's weights into its parameters.
        Returns the event the next forward waits on. The host must not write the shard's
        master/lowp before that event (HostJobs waits for it)."""
        runtime, transfer = self.runtime, self.transfer
        src = rt.bufs.copy_back_source  # compact state: the bf16 part of the master, as it is
        dtype = rt.params[0].dtype if rt.params else src.dtype
        with torch.no_grad(), runtime.thread_device(), runtime.on_stream(transfer.h2d):
            fence = getattr(transfer, "_fence", None)
            if fence is not None:  # copy-backs wait for kernels queued before step() (see Transfer.fence)
                transfer.h2d.wait_event(fence)
            flat_dev, shard_dev = self._gather_buffers(dtype, rt.shard.padded_numel, rt.shard.numel)
            if self.coll.backend == "nccl" or not transfer.is_async:
                runtime.copy_(shard_dev, src)  # casts fp32 masters to the parameters' dtype on the way
                self.coll.all_gather(shard_dev, flat_dev)  # NCCL: in stream order on h2d
            else:  # gloo with an asynchronous device (the simulated one): gather in host memory
                flat_host = runtime.host_empty(rt.shard.padded_numel, dtype)
                self.coll.all_gather(src.to(dtype), flat_host)
                runtime.copy_(flat_dev, flat_host)
            for p, slot in zip(rt.params, rt.bucket.slots):
                if self.flows(p):
                    continue  # released between uses: its next fetch gathers the new weights
                # through .data: the engine's own write leaves p's version to step() (waits.py)
                runtime.copy_(p.data, BucketBuffers.view(flat_dev, slot).view(p.shape))
                runtime.record_stream(p.detach(), transfer.h2d)
            done = runtime.new_event()
            done.record(transfer.h2d)
        self.counters.add("bytes_h2d", src.numel() * src.element_size())
        return done

    def all_flow(self, rt: BucketRuntime) -> bool:
        """Every parameter of the bucket flows: no copy-back all-gather (the same answer on every rank)."""
        return all(self.flows(p) for p in rt.params)

    def gather_for_flow(self, rt: BucketRuntime) -> torch.Tensor:
        """Training thread, on the current stream (weight-flow's): the bucket's weights, whole
        (padded), from every rank's shard of its copy-back source. A collective (on the gather
        group, Collectives.all_gather_training): every rank fetches the same units in the same
        order (the forward's, then the backward's). On gloo a collective blocks until the peers
        issue it, so the fetches and the reduce-scatters launched during backward must interleave
        alike on every rank: they do where every rank has the same parameters' gradients (as DDP
        without `find_unused_parameters`); otherwise the ranks wait for each other until the
        process group's timeout (never a fetch paired with a reduce-scatter)."""
        runtime, transfer = self.runtime, self.transfer
        src = rt.bufs.copy_back_source  # the shard: lowp (cast host), fp32 master, or compact's bf16 part
        dtype = rt.params[0].dtype
        if self.coll.backend == "nccl" or not transfer.is_async:
            flat = runtime.device_empty(rt.shard.padded_numel, dtype)
            shard_dev = runtime.device_empty(rt.shard.numel, dtype)
            runtime.copy_(shard_dev, src)  # casts fp32 masters to the parameters' dtype on the way
            self.coll.all_gather_training(shard_dev, flat)  # NCCL: in stream order
            return flat
        # gloo with an asynchronous device (the simulated one): gathered in host memory, which
        # the fetch's copies read (the copy source is kept alive until they run)
        flat_host = runtime.host_empty(rt.shard.padded_numel, dtype)
        self.coll.all_gather_training(src.to(dtype), flat_host)
        return flat_host

    def _gather_buffers(self, dtype: torch.dtype, padded: int, numel: int) -> tuple:
        """Views of this rank's two all-gather buffers (the whole bucket, the rank's shard), one
        pair per dtype sized to the largest host bucket, reused by every copy-back: a fresh pair
        per call stays alive until the process group drops the finished collective's work (gloo
        does so from its own thread, a moment later), so the memory held would depend on timing.
        Reuse is safe: every use is on the host-to-device stream, in copy-back order (NCCL's own
        stream waits for it before the collective, and it for NCCL after)."""
        pair = self._gather_pairs.get(dtype)
        if pair is None:
            host = [rt.shard for rt in self.buckets.host()]
            runtime = self.runtime
            pair = self._gather_pairs[dtype] = (
                runtime.device_empty(max(sh.padded_numel for sh in host), dtype),
                runtime.device_empty(max(sh.numel for sh in host), dtype))
        return pair[0][:padded], pair[1][:numel]


    def release(self) -> None:
        """close(): drop the all-gather buffers (device memory; the worker is stopped)."""
        self._gather_pairs.clear()
