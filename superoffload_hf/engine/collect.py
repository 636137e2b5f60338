"""Gradients in: from the autograd hooks into each bucket's host buffers, launching (and, when
speculating, stepping) a bucket as soon as its last micro-batch's gradients are complete.

Runs on autograd's thread (the hooks) and on the training thread (step(), zero_grad()); never
both at once, since backward() blocks its caller.

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
from typing import Callable, Optional

import torch

from superoffload_hf.engine.buffers import BucketBuffers
from superoffload_hf.engine.hooks import HeldGrad, register_param_hooks
from superoffload_hf.engine.lifecycle import BucketRuntime, BucketState
from superoffload_hf.engine.stepper import Hyper, StepCall
from superoffload_hf.engine.validate import SpeculationBudget

FP32 = torch.float32


def invertible(h: Hyper, adamw: bool) -> bool:
    """Whether adam_rollback_ can undo a step with these hyperparameters (it divides by them)."""
    return h.beta1 > 0 and h.beta2 > 0 and (not adamw or h.lr * h.weight_decay != 1.0)


class Collector:
    def __init__(self, *, params, buckets, transfer, worker, jobs, waiter, step_state, counters,
                 gradient_accumulation_steps: int, link_dtype, host_is_device: bool, policy, loss_scale,
                 dp, observer, live, unhooked: list, handles: list):
        self.params, self.buckets, self.transfer, self.worker, self.jobs = params, buckets, transfer, worker, jobs
        self.waiter, self.step, self.counters = waiter, step_state, counters
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.policy, self.loss_scale, self.dp, self.observer = policy, loss_scale, dp, observer
        self.live = live  # read at use: fire_log, max_grad_norm, sync_source change over time
        self.unhooked, self.handles = unhooked, handles  # frozen parameters; every hook's handle
        self.link_dtype = link_dtype
        # The CPU device: host jobs run inline, between backward's kernels, where they only slow
        # it down (torch's OpenMP workers still spin there): a norm alone waits for step().
        self.launch_only_to_speculate = host_is_device
        self.held: list[Optional[HeldGrad]] = [None] * len(params)  # one placeholder per parameter
        self.held_out = False  # a p.grad may be a placeholder (cleared by the next forward)
        # Nothing is launched from a hook (the CPU device, not speculating) and no rank waits for
        # our gradients: a bucket whose parameters alias its master may take the lean path.
        self.lean_hooks = (self.launch_only_to_speculate and policy.mode != "on" and dp is None)

    # ---- autograd thread ------------------------------------------------------------------

    def on_grad(self, index: int, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook of parameter `index` (hooks.py).

        Lean path (`rt.lean`, set below once the bucket's first gradient of this step came through
        the full path): a parameter's first gradient of the step is kept as autograd made it and
        nothing else happens until step(), whose finish() closes the round. It runs inside
        backward, between kernels, where every Python statement runs from a cold cache (about
        25 us for the full path on a small model's parameter): keep it this short."""
        rt, k = self.buckets.where[index]
        if rt.lean and not rt.present[k]:
            grad = p.grad
            held = self.held[index]
            if grad.dtype is FP32 and held is not None and grad.is_contiguous():
                try:
                    p.grad = held  # any later use of p.grad raises (e.g. clip_grad_norm_)
                except RuntimeError:  # the parameter was resized under us: the full path says so
                    pass
                else:
                    self.held_out = True
                    rt.autograd_grads[k] = grad  # read in place by the step
                    rt.present[k] = rt.round_fired[k] = True
                    rt.fires[k] += 1
                    return
        self.observer.open_step()
        self.on_grad_accumulated(p, index)

    def on_grad_accumulated(self, p: torch.Tensor, index: Optional[int] = None) -> None:
        self.worker.raise_if_failed()
        if index is None:
            index = self.buckets.index_of[p]
        rt, k = self.buckets.where[index]
        grad = p.grad.detach().reshape(-1)
        slot = rt.bucket.slots[k]
        if grad.numel() != slot.numel:
            raise RuntimeError(
                f"Parameter {index} has a gradient of {grad.numel()} elements (shape {tuple(p.shape)}), but "
                f"the optimizer was built when it had {slot.numel} (shape {tuple(slot.shape)}): it was "
                "replaced or resized after the optimizer was built (`p.data = ...`). Build the optimizer "
                "from the final model; to set new values, write them in place after `optimizer.synchronize()` "
                "(`with torch.no_grad(): p.copy_(...)`, which the race check sees, unlike `p.data.copy_`).")
        held = self.held[index]
        if held is None or held.dtype != p.dtype or held.shape != p.shape:
            held = self.held[index] = HeldGrad(p)
        p.grad = held  # any later use of p.grad raises (e.g. clip_grad_norm_)
        self.held_out = True
        if self.live.fire_log is not None:
            self.live.fire_log.record(index)
        if rt.bucket.device_resident:
            self._accumulate_on_device(rt, k, grad)
        elif self.dp is not None:
            self.dp.collect(rt, k, grad)
        else:
            self._collect_for_host(rt, k, grad)

    def release_held(self) -> None:
        """Before a forward: every placeholder back to None, so that this forward's backward
        accumulates into a fresh gradient (the held ones are the optimizer's already)."""
        self.held_out = False
        for p in self.params:
            if type(p.grad) is HeldGrad:
                p.grad = None

    def _accumulate_on_device(self, rt: BucketRuntime, k: int, grad: torch.Tensor) -> None:
        view = BucketBuffers.view(rt.bufs.grad, rt.bucket.slots[k])
        if rt.present[k]:
            view.add_(grad)  # fp32 += low precision: summed in fp32
        else:
            view.copy_(grad)
        rt.present[k] = True
        rt.fires[k] += 1

    def _collect_for_host(self, rt: BucketRuntime, k: int, grad: torch.Tensor) -> None:
        if rt.launched:
            self.reopen(rt)
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
            launch = rt.bucket.speculative and self._is_last_micro_batch(rt)
            spec = self._speculative_call(rt) if launch else None
            self.flush(rt, launch=launch and (spec is not None or not self.launch_only_to_speculate), spec=spec)
        # the lean path (on_grad) from the next gradient on: it never launches and never flushes
        # (finish() closes the round at step()), so it is taken only where the full path would
        # not launch either and the step still reads autograd's gradients in place
        rt.lean = (self.lean_hooks and rt.params_alias_master and rt.bufs.grad is None
                   and rt.state is BucketState.COLLECTING and self.live.fire_log is None)

    def _is_last_micro_batch(self, rt: BucketRuntime) -> bool:
        sync_source: Optional[Callable[[], bool]] = self.live.sync_source
        if sync_source is not None:
            return bool(sync_source())
        return max(rt.fires) >= self.gradient_accumulation_steps

    def _speculative_call(self, rt: BucketRuntime) -> Optional[StepCall]:
        s = self.step
        if s.speculating is None:  # one decision per step, at its first launch
            s.speculating = self.live.fire_log is None and self.policy.should_speculate()
            s.budget = SpeculationBudget(self.live.max_grad_norm, self.loss_scale.scale)
        if not s.speculating or rt.no_spec or not all(rt.present):
            return None
        trade = self.live.snapshot_trade  # compact state, speculation auto: the snapshot it can afford
        if trade is not None and not trade.allows(rt.bucket.index):
            return None
        call = s.call(rt, 1.0)
        return call if self.jobs.snapshot or invertible(call.hyper, self.jobs.adamw) else None

    # ---- both threads ---------------------------------------------------------------------

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
            keep = first and (launch or self._is_last_micro_batch(rt))
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

    def reopen(self, rt: BucketRuntime) -> None:
        """A gradient arrived for a launched bucket (or a forward needs it before step()): undo
        its speculative step, recount its norm."""
        self.waiter.wait_idle(rt)
        if rt.spec is not None:
            spec, rt.spec = rt.spec, None
            self.worker.submit(functools.partial(self.jobs.rollback, rt, spec), rt.pending)
            self.step.speculative = self.step.rolled_back = rt.redo = True
            self.waiter.inflight.add(rt)  # the restored weights travel back to the device
        rt.move(BucketState.COLLECTING)
        rt.sumsq, rt.no_spec = None, True
        rt.norm_ready.clear()

    # ---- training thread, at step() -------------------------------------------------------

    def adopt_unhooked_grads(self) -> None:
        """Parameters frozen at construction and unfrozen since: hook them; take their grads."""
        for p in [p for p in self.unhooked if p.requires_grad]:
            self.unhooked.remove(p)
            register_param_hooks([p], self, self.buckets.index_of, self.handles)
            if p.grad is not None and not isinstance(p.grad, HeldGrad):
                self.on_grad_accumulated(p)

    def finish(self) -> bool:
        """Flush partial rounds and launch every staged bucket not launched yet. False when
        there is nothing to step (data parallel: no rank had a gradient)."""
        if self.dp is not None:
            return self.dp.finish()
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
        if self.dp is not None:
            return self.dp.discard()
        for rt in self.buckets.host():
            if rt.round_dev is not None:
                self.transfer.release_grad_slot(rt.take_round())
            if rt.launched:
                self.reopen(rt)
