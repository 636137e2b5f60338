"""The local route: a host bucket's gradients from the hooks to the host, in one process (the
sharded route is engine/dp/route.py, with the same interface: collect, finish, discard, the global sum
of squares, refreshing the device parameters, checkpoints' pieces). engine/build.py picks one.

A host bucket collects in *rounds*: each gradient is copied into a flat device buffer
(`round_dev`, in the dtype that crosses the link: a slot of the transfer's gradient ring, whose
reuse waits for its last copy) and `p.grad` is released. A round ends when
every parameter of the bucket delivered a gradient, or when one delivers a second one; it is
then flushed: copied to the host and, in the worker, copied or added in fp32 into the bucket's
gradient buffer. The round that completes the last micro-batch launches the bucket. When the
bucket's parameters are views of its master (the CPU, fp32), nothing crosses: each gradient is
copied or added straight into the gradient buffer, and a flush only closes the round. With one
micro-batch per step (BufferPolicy.grad_on_demand) not even that: the bucket keeps autograd's
gradient tensors and the host Adam reads them in place (host/segmented.py), as torch.optim
does; only a parameter's second gradient in one step allocates the fp32 buffer, copies the
kept ones in, and accumulates there from then on.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Mapping, Optional

import torch

from superoffload_hf.engine import checkpoint
from superoffload_hf.engine.state.buffers import BucketBuffers
from superoffload_hf.engine.state.lifecycle import BucketRuntime, BucketState
from superoffload_hf.engine.dp.checkpoint import write_whole
from superoffload_hf.engine.state.stepper import StepCall


class LocalRoute:
    def __init__(self, *, params, buckets, transfer, worker, jobs, waiter, step_state, counters, speculation, policy,
                 live, link_dtype, host_is_device: bool):
        self.params, self.buckets, self.transfer, self.worker, self.jobs = params, buckets, transfer, worker, jobs
        self.waiter, self.step, self.counters, self.speculation = waiter, step_state, counters, speculation
        self.live = live  # read at use: fire_log
        self.link_dtype = link_dtype
        # The CPU device: host jobs run inline, between backward's kernels, where they only slow
        # it down (torch's OpenMP workers still spin there): a norm alone waits for step().
        self.launch_only_to_speculate = host_is_device
        # Nothing is launched from a hook (the CPU device, not speculating) and no rank waits for
        # our gradients: a bucket whose parameters alias its master may take the lean path.
        self.lean_hooks = self.launch_only_to_speculate and policy.mode != "on"

    # what step() and the optimizer ask of a route
    alone = True  # no other rank: a step without a gradient here is empty
    learns_plans = True  # re-plans from the first step (the sharded route keeps the initial plan)

    def describe(self) -> str:
        return ""

    def host_elements(self) -> int:
        """The host state's elements held in this process."""
        return sum(s.numel for rt in self.buckets.host() for s in rt.bucket.slots)

    def wait_for_queued_gathers(self) -> None:
        """Nothing: no all-gathers (the sharded route's ordering of the two threads' collectives)."""

    def release(self) -> None:
        """close(): nothing of its own to free."""

    def collect(self, rt: BucketRuntime, k: int, grad: torch.Tensor) -> None:
        """A host bucket's gradient `k` (the hooks, on autograd's thread)."""
        if rt.launched:
            self.waiter.reopen(rt)
        if rt.state is not BucketState.COLLECTING:
            self.waiter.wait_idle(rt)  # RETURNING without a forward in between: its copy-back
            rt.move(BucketState.COLLECTING)  # job must be done before the state changes hands
        if rt.round_fired[k]:
            self.flush(rt)
        if rt.params_alias_master:
            self.waiter.wait_idle(rt)  # a rollback queued by a re-open still reads the gradient buffer
            # (a float64 gradient, from a model cast after construction, is cast into the buffer:
            # step() then refuses the replaced storage, see BucketSet.check_aliases)
            if rt.bufs.grad is None and not rt.present[k] and grad.dtype == torch.float32:
                rt.autograd_grads[k] = grad  # kept, not copied: the step reads it in place
            else:
                if rt.bufs.grad is None:  # a second gradient (grad_on_demand): accumulate from now
                    rt.accumulate_from_now()
                view = BucketBuffers.view(rt.bufs.grad, rt.bucket.slots[k])
                if rt.present[k]:
                    view.add_(grad)  # accumulated in fp32
                else:
                    view.copy_(grad)
        else:
            if rt.round_dev is None:
                rt.round_dev = self.transfer.grad_slot(rt.bucket.numel, self.link_dtype)
            BucketBuffers.view(rt.round_dev, rt.bucket.slots[k]).copy_(grad)  # casts when the link is fp32
        rt.round_fired[k] = rt.present[k] = True
        rt.fires[k] += 1
        if rt.round_complete:
            launch = rt.bucket.speculative and self.speculation.is_last_micro_batch(rt)
            spec = self.speculation.call(rt) if launch else None
            self.flush(rt, launch=launch and (spec is not None or not self.launch_only_to_speculate), spec=spec)
        # the lean path (on_grad) from the next gradient on: it never launches and never flushes
        # (finish() closes the round at step()), so it is taken only where the full path would
        # not launch either and the step still reads autograd's gradients in place
        rt.lean = (self.lean_hooks and rt.params_alias_master and rt.bufs.grad is None
                   and rt.state is BucketState.COLLECTING and self.live.fire_log is None)


    def flush(self, rt: BucketRuntime, launch: bool = False, spec: Optional[StepCall] = None) -> None:
        """Copy the current round to the host; queue its accumulation (and launch)."""
        first = not rt.staged
        # a round kept in the link dtype, re-opened: upcast it (nothing crosses for aliased buckets)
        if not first and not rt.params_alias_master and rt.grad_in is not rt.bufs.grad:
            self.worker.submit(functools.partial(self.jobs.hold_in_fp32, rt), rt.pending)  # before
        self.waiter.wait_idle(rt)  # the next round lands there; the worker may still read grad / recv
        if rt.params_alias_master:  # the hooks wrote bufs.grad, or kept autograd's gradients
            jobs = []
            if rt.bufs.grad is None:
                rt.grad_in = rt.autograd_grad()  # absent parameters are None: never stepped
            else:
                if first:
                    rt.zero_absent_grads()  # (its jobs are done: waited above)
                rt.grad_in = rt.bufs.grad
            rt.round_fired = [False] * len(rt.round_fired)
        else:
            flat = rt.take_round()
            fp32_direct = first and flat.dtype == torch.float32
            landed = rt.bufs.grad if fp32_direct else self.buckets.landing(rt, flat.dtype, self.waiter.wait_idle)
            issued = time.perf_counter()
            event = self.transfer.grad_to_host(flat, landed)
            self.counters.add("bytes_d2h", flat.numel() * flat.element_size())
            # this round is the step's whole gradient (launched now, or at step() where the CPU
            # device launches only to speculate): no upcast, no fp32 buffer (BufferPolicy.grad_lazy)
            keep = first and (launch or self.speculation.is_last_micro_batch(rt))
            jobs = [functools.partial(self.jobs.receive, rt, landed, event, first, keep, issued)]
        rt.staged = True
        if launch:
            self._mark_launched(rt)
            jobs.append(functools.partial(self.jobs.launch, rt, spec, self.step.budget))
            if spec is not None:
                self.waiter.inflight.add(rt)  # a forward before step() must not read speculative weights
        if jobs:
            self.worker.submit(lambda: [job() for job in jobs], rt.pending)

    def _mark_launched(self, rt: BucketRuntime) -> None:
        rt.move(BucketState.LAUNCHED)
        rt.norm_ready.clear()


    # ---- training thread, at step() -------------------------------------------------------

    def finish(self) -> bool:
        """Flush partial rounds and launch every staged bucket not launched yet. True: there is a step
        (the caller knew there were gradients)."""
        for rt in self.buckets.host():
            if any(rt.round_fired):
                self.flush(rt)
            if rt.staged and not rt.launched:
                self._mark_launched(rt)
                self.worker.submit(functools.partial(self.jobs.launch, rt, None), rt.pending)
        return True

    def discard(self) -> None:
        """Forget this step's gradients (zero_grad() between backward and step()), undoing any
        speculative step taken with them. The caller resets and synchronizes afterwards."""
        for rt in self.buckets.host():
            if rt.round_dev is not None:
                self.transfer.release_grad_slot(rt.take_round())
            if rt.launched:
                self.waiter.reopen(rt)

    def commit_speculative(self, rt: BucketRuntime, call: StepCall) -> None:
        """Nothing: a speculative step's copy-back went with it (HostJobs, DeviceCopyBack)."""

    def global_sum_squares(self, parts: dict[int, float]) -> float:
        """Every bucket's sum of squares, by bucket index."""
        return sum(parts[i] for i in sorted(parts))  # float64, in bucket order: deterministic

    def refresh_device_params(self, skip: Callable[[torch.Tensor], bool]) -> None:
        """Every master weight to its device parameter but `skip`'s (after loading state)."""
        self.buckets.refresh_device_params(skip=skip)

    # ---- checkpoints (the caller waited for the host's jobs) ---------------------------------

    def state_dict(self, groups: list, extras: Mapping[str, Any]) -> dict:
        return checkpoint.state_dict(self.buckets, groups, extras)

    def stepped(self) -> list[int]:
        """The parameters with state (stepped at least once)."""
        return [i for i, step in enumerate(self.buckets.param_steps) if step > 0]

    def param_values(self, index: int) -> tuple:
        """(parameter `index`'s state, its shape, its step)."""
        return self.buckets.export_param(index), tuple(self.params[index].shape), self.buckets.param_steps[index]

    def save(self, directory: str, state_dict: Callable[[], dict]) -> list[str]:
        return write_whole(directory, state_dict)

    def load_state(self, sd: Any, groups: list, adopt_plan: Callable[[dict], None]) -> tuple:
        """The whole state (or every rank's shard files, consolidated). Returns (saved param
        groups, extras)."""
        self.waiter.synchronize()
        return checkpoint.load_state_dict(self.buckets, self.params, groups, sd, adopt_plan)
