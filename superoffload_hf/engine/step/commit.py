"""At step(): the global norm from every bucket's partial sum, then the decision applied to each
bucket (commit a speculative step, roll it back and replay it clipped, step a staged bucket,
or skip), the device-resident buckets stepped on the device, and the step accounted for."""

from __future__ import annotations

import functools

import torch

from superoffload_hf.engine.state import stepper
from superoffload_hf.engine.state.buffers import BucketBuffers
from superoffload_hf.engine.state.lifecycle import BucketRuntime, BucketState
from superoffload_hf.engine.state.stepper import StepCall
from superoffload_hf.engine.step.validate import Decision
from superoffload_hf.host import reference


class Committer:
    def __init__(self, *, buckets, worker, jobs, waiter, step_state, counters, adamw: bool, route, policy,
                 loss_scale):
        self.buckets, self.worker, self.jobs, self.waiter = buckets, worker, jobs, waiter
        self.step, self.counters, self.adamw = step_state, counters, adamw
        self.route, self.policy, self.loss_scale = route, policy, loss_scale

    def global_sum_squares(self) -> float:
        parts = {}
        on_device = [rt for rt in self.buckets.on_device() if any(rt.present)]
        if on_device:
            for rt in on_device:
                for k, slot in enumerate(rt.bucket.slots):
                    if not rt.present[k]:
                        BucketBuffers.view(rt.bufs.grad, slot).zero_()
            sums = torch.stack([stepper.sum_squares_on_device(rt.bufs.grad) for rt in on_device])
            parts.update(zip((rt.bucket.index for rt in on_device), sums.tolist()))  # one host sync
        for rt in self.buckets.host():
            if rt.staged:
                self.waiter.wait(rt.norm_ready, f"norm of bucket {rt.bucket.index}")
                parts[rt.bucket.index] = rt.sumsq
        return self.route.global_sum_squares(parts)  # (data parallel: the host parts are this rank's shards)

    def apply(self, decision: Decision) -> None:
        skip = decision.kind == "skip"
        # Queued in the order the next forward reads the buckets (the reverse of gradient order:
        # the embedding first), so forward starts as soon as its first layers are back.
        for rt in reversed(list(self.buckets.host())):
            if rt.staged:
                self._apply_host(rt, None if skip else self.step.call(rt, decision.clip_coef))
        if not skip:
            for rt in self.buckets.on_device():
                if any(rt.present):
                    self._step_on_device(rt, self.step.call(rt, decision.clip_coef))

    def _apply_host(self, rt: BucketRuntime, call) -> None:
        spec = rt.spec  # written by the launch job before norm_ready, which global_sum_squares waited for
        rt.move(BucketState.VALIDATED)
        if spec is not None:
            self.step.speculative = True
            if call != spec:  # clipped, skipped, or hyperparameters changed since
                self.worker.submit(functools.partial(self.jobs.rollback, rt, spec, call), rt.pending)
                self.step.rolled_back = True
                self.step.replayed |= call is not None
            else:  # committed as it was stepped (data parallel: its shard's all-gather now)
                self.route.commit_speculative(rt, call)
        elif call is not None:
            self.worker.submit(functools.partial(self.jobs.step, rt, call), rt.pending)
            self.step.replayed |= rt.redo

    def _step_on_device(self, rt: BucketRuntime, call: StepCall) -> None:
        # The same math as the host kernel, in stream order on the device.
        stepper.apply(reference.adam_step_, rt.bufs, rt.bufs.grad, call, self.adamw)
        with torch.no_grad():
            for k in stepper.run_slots(call):
                slot = rt.bucket.slots[k]
                rt.params[k].detach().copy_(BucketBuffers.view(rt.bufs.master, slot).view(slot.shape))

    def account(self, decision: Decision) -> None:
        skipped = decision.kind == "skip"
        if not skipped:
            for rt in self.buckets.runtimes:
                for k, slot in enumerate(rt.bucket.slots):
                    self.buckets.param_steps[slot.index] += rt.present[k]
        c, s = self.counters, self.step
        c.steps += not skipped
        c.skips += skipped
        self.account_flags()
        c.replays += s.replayed
        self.policy.record(decision, s.speculating is True, s.rolled_back)
        self.loss_scale.update(skipped)

    def account_flags(self) -> None:
        self.counters.speculative_steps += self.step.speculative
        self.counters.rollbacks += self.step.rolled_back
