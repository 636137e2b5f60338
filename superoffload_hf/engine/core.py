"""The engine: gradients in (autograd hooks), speculative host steps, validation at step().

The optimizer facade owns one Engine. Threads: hooks run on autograd's thread, step() on the
training thread (never at the same time: backward() blocks the caller), host jobs on the
worker (runtime.HostJobs). Data flow and the bucket lifecycle: runtime.py's docstring.

Ordering guarantees the engine relies on, each enforced where noted:
* A bucket's host buffers are touched by at most one party at a time: the training thread
  waits for the bucket's queued jobs (`_wait_idle`) before it copies new gradients into them.
* The worker waits for a bucket's last copy-back before it modifies master/lowp again
  (HostJobs.step / rollback).
* A forward waits for the buckets of its module's parameters (`wait_for_module`); every
  optimizer entry point that exposes state (state_dict, load, close) waits for everything.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch

from superoffload_hf.engine import stepper
from superoffload_hf.host import reference
from superoffload_hf.engine.buffers import BucketBuffers
from superoffload_hf.config import SuperOffloadConfig
from superoffload_hf.engine.hooks import HeldGrad, register_forward_wait, register_param_hooks, remove_handles
from superoffload_hf.host.kernel import get_host_adam
from superoffload_hf.engine.layout import FireLog, LayoutBuilder
from superoffload_hf.engine.loss_scale import make_loss_scale
from superoffload_hf.metrics import OffloadCounters
from superoffload_hf.engine.lifecycle import BucketRuntime, HostJobs
from superoffload_hf.engine.validate import Decision, SpeculationBudget, SpeculationPolicy, decide
from superoffload_hf.engine.stepper import Hyper, StepCall, plan_runs
from superoffload_hf.device import make_runtime
from superoffload_hf.device.transfer import Transfer
from superoffload_hf.engine.worker import HostWorker

logger = logging.getLogger("superoffload_hf")


def _invertible(h: Hyper, adamw: bool) -> bool:
    """Whether adam_rollback_ can undo a step with these hyperparameters (it divides by them)."""
    return h.beta1 > 0 and h.beta2 > 0 and (not adamw or h.lr * h.weight_decay != 1.0)


class _StepFlags:
    def __init__(self):
        self.speculative = self.rolled_back = self.replayed = False


class Engine:
    def __init__(self, param_groups: list[dict], adamw: bool, config: SuperOffloadConfig,
                 counters: OffloadCounters):
        self.config, self.adamw, self.counters = config, adamw, counters
        self.groups = param_groups  # the optimizer's live list: hyperparameters are read at use
        self.params = [p for g in param_groups for p in g["params"]]
        self.index_of = {p: i for i, p in enumerate(self.params)}
        self.layout = LayoutBuilder(self.params, param_groups, config)
        self.runtime = make_runtime(self.layout.device)
        self.runtime.adopt(self.params)
        self.transfer = Transfer(self.runtime, config.pin_memory in (True, "auto"))
        self.cast = self.layout.resolve_cast(self.transfer)
        self.adam = get_host_adam(config.host_kernel, threads=None if config.host_threads == "auto"
                                  else config.host_threads)
        self.jobs = HostJobs(self.adam, self.transfer, adamw, config.rollback == "snapshot", counters)
        self.policy = SpeculationPolicy(config.speculation, config.speculation_window,
                                        config.speculation_max_rollback_rate)
        self.loss_scale = make_loss_scale(config)
        self.param_steps = [0] * len(self.params)
        self.sync_source: Optional[Callable[[], bool]] = None
        self.fire_log: Optional[FireLog] = FireLog(len(self.params))  # None once learned
        self._host_seconds_before_learning = counters.host_step_seconds
        self.learned: Optional[dict] = None  # the learned plan's inputs, for checkpoints
        self.runtimes: list[BucketRuntime] = []
        self._install(self.layout.initial_plan(), self._initial_state)
        self.layout.cast_params_in_place()
        self.worker = HostWorker()
        self.inflight: set[BucketRuntime] = set()
        self.step_returns_early = self.transfer.is_async  # CPU: step() finishes all host work
        self._speculating: Optional[bool] = None
        self._budget: Optional[SpeculationBudget] = None
        self.max_grad_norm: Optional[float] = None  # the optimizer keeps it current
        self._flags = _StepFlags()
        self._handles: list = []
        self._unhooked = register_param_hooks(self.params, self, self._handles)
        register_forward_wait(self, self._handles)
        logger.info(self.summary())

    # ---- layout ---------------------------------------------------------------------------

    def _install(self, plan, state_of: Callable) -> None:
        """Build buffers for `plan` and fill them through state_of(param index, slot, bufs)."""
        self.plan = plan
        self.runtimes = []
        self.where: dict[int, tuple[BucketRuntime, int]] = {}
        for bucket in plan.buckets:
            bufs = self.layout.allocate(bucket, self.transfer, self.cast)
            rt = BucketRuntime(bucket, bufs, [self.params[s.index] for s in bucket.slots])
            for k, slot in enumerate(bucket.slots):
                state_of(slot.index, slot, bufs)
                self.where[slot.index] = (rt, k)
            self.runtimes.append(rt)
        self.runtime_of = {self.params[i]: rt for i, (rt, _) in self.where.items()}

    def _initial_state(self, index: int, slot, bufs: BucketBuffers) -> None:
        # fp32 masters from the parameters as given (an fp32 model keeps full precision).
        bufs.view(bufs.master, slot).copy_(self.params[index].detach().reshape(-1))
        if bufs.lowp is not None:
            bufs.view(bufs.lowp, slot).copy_(bufs.view(bufs.master, slot))

    def replan(self, plan) -> None:
        """Move every parameter's state into the buffers of a new plan (between steps)."""
        if plan == self.plan:
            return
        self.synchronize()
        old = {s.index: (rt, s) for rt in self.runtimes for s in rt.bucket.slots}
        left = {rt: len(rt.bucket.slots) for rt in self.runtimes}

        def move(index: int, slot, bufs: BucketBuffers) -> None:
            rt, old_slot = old[index]
            bufs.copy_param_from(rt.bufs, old_slot, slot)
            left[rt] -= 1
            if left[rt] == 0:
                rt.bufs = None  # free it now: peak memory stays near one copy of the state

        self._install(plan, move)

    def summary(self) -> str:
        return (f"SuperOffload: {len(self.plan.buckets)} buckets ({self.plan.num_device_buckets} "
                f"device-resident) of <= {self.plan.bucket_numel} elements, device {self.runtime.name} "
                f"{self.config.device_dtype}, cast {self.cast}, speculation {self.config.speculation}, "
                f"rollback {self.config.rollback}, host Adam {self.adam.name}/{self.adam.isa} "
                f"x{self.adam.threads} threads")

    # ---- gradients in (autograd thread) ---------------------------------------------------

    def on_grad_accumulated(self, p: torch.Tensor) -> None:
        self.worker.raise_if_failed()
        index = self.index_of[p]
        rt, k = self.where[index]
        grad = p.grad.detach().reshape(-1)
        p.grad = HeldGrad(p)  # any later use of p.grad raises (e.g. clip_grad_norm_)
        if self.fire_log is not None:
            self.fire_log.record(index)
        if rt.bucket.device_resident:
            self._accumulate_on_device(rt, k, grad)
        else:
            self._collect_for_host(rt, k, grad)

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
            self._reopen(rt)
        if rt.round_fired[k]:
            self._flush(rt)
        if rt.round_dev is None:
            rt.round_dev = self.transfer.device_empty(rt.bucket.numel, self.layout.link_dtype(self.cast))
        BucketBuffers.view(rt.round_dev, rt.bucket.slots[k]).copy_(grad)  # casts when the link is fp32
        rt.round_fired[k] = rt.present[k] = True
        rt.fires[k] += 1
        if rt.round_complete:
            launch = rt.bucket.speculative and self._is_last_micro_batch(rt)
            self._flush(rt, launch=launch, spec=self._speculative_call(rt) if launch else None)

    def _is_last_micro_batch(self, rt: BucketRuntime) -> bool:
        if self.sync_source is not None:
            return bool(self.sync_source())
        return max(rt.fires) >= self.config.gradient_accumulation_steps

    def _speculative_call(self, rt: BucketRuntime) -> Optional[StepCall]:
        if self._speculating is None:  # one decision per step, at its first launch
            self._speculating = self.fire_log is None and self.policy.should_speculate()
            self._budget = SpeculationBudget(self.max_grad_norm, self.loss_scale.scale)
        if not self._speculating or rt.no_spec or not all(rt.present):
            return None
        call = self._call(rt, 1.0)
        return call if self.jobs.snapshot or _invertible(call.hyper, self.adamw) else None

    def _call(self, rt: BucketRuntime, clip_coef: float) -> StepCall:
        return StepCall(plan_runs(rt.bucket, rt.present, self.param_steps),
                        Hyper.of_group(self.groups[rt.bucket.group]), clip_coef / self.loss_scale.scale)

    def _flush(self, rt: BucketRuntime, launch: bool = False, spec: Optional[StepCall] = None) -> None:
        """Copy the current round to the host; queue its accumulation (and launch)."""
        self._wait_idle(rt)  # the worker may still read this bucket's grad / recv buffers
        flat = rt.take_round()
        first = not rt.staged
        fp32_direct = first and flat.dtype == torch.float32
        landed = rt.bufs.grad if fp32_direct else rt.bufs.recv_buffer(flat.dtype)
        event = self.transfer.grad_to_host(flat, landed)
        self.counters.bytes_d2h += flat.numel() * flat.element_size()
        rt.staged = True
        jobs = [functools.partial(self.jobs.receive, rt, landed, event, first)]
        if launch:
            rt.launched = True
            rt.norm_ready.clear()
            jobs.append(functools.partial(self.jobs.launch, rt, spec, self._budget))
            if spec is not None:
                self.inflight.add(rt)  # a forward before step() must not read speculative weights
        self.worker.submit(lambda: [job() for job in jobs], rt.pending)

    def _reopen(self, rt: BucketRuntime) -> None:
        """A gradient arrived for a launched bucket: undo its speculative step, recount its norm."""
        self._wait_idle(rt)
        if rt.spec is not None:
            spec, rt.spec = rt.spec, None
            self.worker.submit(functools.partial(self.jobs.rollback, rt, spec), rt.pending)
            self._flags.speculative = self._flags.rolled_back = rt.redo = True
            self.inflight.add(rt)  # the restored weights travel back to the device
        rt.launched, rt.sumsq, rt.no_spec = False, None, True
        rt.norm_ready.clear()

    # ---- step (training thread) -----------------------------------------------------------

    def step(self, max_grad_norm: Optional[float]) -> Decision:
        self.worker.raise_if_failed()
        self.transfer.fence()  # CUDA: this step's copy-backs wait for kernels queued before step()
        self._adopt_unhooked_grads()
        self._finish_collection()
        decision = decide(self._global_sum_squares(), self.loss_scale.scale, max_grad_norm)
        self._apply(decision)
        self._account(decision)
        for rt in self.runtimes:
            rt.reset()
        self._speculating, self._flags = None, _StepFlags()
        if self.fire_log is not None and self.fire_log.order:
            self._learn()
        if self.step_returns_early:
            self.inflight = {rt for rt in self.runtimes if not rt.bucket.device_resident}
        else:
            self.synchronize()
        return decision

    def _adopt_unhooked_grads(self) -> None:
        """Parameters frozen at construction and unfrozen since: hook them; take their grads."""
        for p in [p for p in self._unhooked if p.requires_grad]:
            self._unhooked.remove(p)
            register_param_hooks([p], self, self._handles)
            if p.grad is not None and not isinstance(p.grad, HeldGrad):
                self.on_grad_accumulated(p)

    def _finish_collection(self) -> None:
        for rt in self._host_runtimes():
            if any(rt.round_fired):
                self._flush(rt)
            if rt.staged and not rt.launched:
                rt.launched = True
                rt.norm_ready.clear()
                self.worker.submit(functools.partial(self.jobs.launch, rt, None), rt.pending)

    def _global_sum_squares(self) -> float:
        parts = {}
        on_device = [rt for rt in self.runtimes if rt.bucket.device_resident and any(rt.present)]
        if on_device:
            for rt in on_device:
                for k, slot in enumerate(rt.bucket.slots):
                    if not rt.present[k]:
                        BucketBuffers.view(rt.bufs.grad, slot).zero_()
            sums = torch.stack([stepper.sum_squares_on_device(rt.bufs.grad) for rt in on_device])
            parts.update(zip((rt.bucket.index for rt in on_device), sums.tolist()))  # one host sync
        for rt in self._host_runtimes():
            if rt.staged:
                self._wait(rt.norm_ready)
                parts[rt.bucket.index] = rt.sumsq
        return sum(parts[i] for i in sorted(parts))  # float64, in bucket order: deterministic

    def _apply(self, decision: Decision) -> None:
        skip = decision.kind == "skip"
        for rt in self._host_runtimes():
            if not rt.staged:
                continue
            call = None if skip else self._call(rt, decision.clip_coef)
            if rt.spec is not None:
                self._flags.speculative = True
                if call != rt.spec:  # clipped, skipped, or hyperparameters changed since
                    self.worker.submit(functools.partial(self.jobs.rollback, rt, rt.spec, call), rt.pending)
                    self._flags.rolled_back = True
                    self._flags.replayed |= call is not None
            elif call is not None:
                self.worker.submit(functools.partial(self.jobs.step, rt, call), rt.pending)
                self._flags.replayed |= rt.redo
        if not skip:
            for rt in self.runtimes:
                if rt.bucket.device_resident and any(rt.present):
                    self._step_on_device(rt, self._call(rt, decision.clip_coef))

    def _step_on_device(self, rt: BucketRuntime, call: StepCall) -> None:
        # The same math as the host kernel, in stream order on the device.
        stepper.apply(reference.adam_step_, rt.bufs, call, self.adamw)
        with torch.no_grad():
            for k in stepper.run_slots(call):
                slot = rt.bucket.slots[k]
                rt.params[k].detach().copy_(BucketBuffers.view(rt.bufs.master, slot).view(slot.shape))

    def _account(self, decision: Decision) -> None:
        skipped = decision.kind == "skip"
        if not skipped:
            for rt in self.runtimes:
                for k, slot in enumerate(rt.bucket.slots):
                    self.param_steps[slot.index] += rt.present[k]
        c, f = self.counters, self._flags
        c.steps += not skipped
        c.skips += skipped
        c.speculative_steps += f.speculative
        c.rollbacks += f.rolled_back
        c.replays += f.replayed
        self.policy.record(decision)
        self.loss_scale.update(skipped)

    def _learn(self) -> None:
        """After the first step: re-plan from the order the hooks fired in."""
        self.synchronize()
        log, self.fire_log = self.fire_log, None
        host_seconds = self.counters.host_step_seconds - self._host_seconds_before_learning
        self.replan(self.layout.learned_plan(log, host_seconds, self.transfer))
        self.learned = {"ready_order": list(log.order), "deferred": log.deferred(),
                        "device_buckets": self.plan.num_device_buckets}

    def adopt_learned(self, learned: dict) -> None:
        """Take the plan a checkpoint's optimizer had learned (so a resumed run continues
        exactly as the original would have)."""
        self.fire_log = None
        self.learned = {"ready_order": [int(i) for i in learned["ready_order"]],
                        "deferred": [int(i) for i in learned["deferred"]],
                        "device_buckets": int(learned["device_buckets"])}
        self.replan(self.layout.plan(self.learned["device_buckets"], self.learned["ready_order"],
                                     self.learned["deferred"]))

    def refresh_device_params(self) -> None:
        """Copy every master weight to its device parameter (after loading state)."""
        self.synchronize()
        with torch.no_grad():
            for rt in self.runtimes:
                for p, slot in zip(rt.params, rt.bucket.slots):
                    p.detach().copy_(BucketBuffers.view(rt.bufs.master, slot).view(slot.shape))

    # ---- waiting --------------------------------------------------------------------------

    def _host_runtimes(self) -> list[BucketRuntime]:
        return [rt for rt in self.runtimes if not rt.bucket.device_resident]

    def _wait(self, event) -> None:
        if not event.is_set():
            self.counters.device_wait_seconds += self.worker.wait(event)
        self.worker.raise_if_failed()

    def _wait_idle(self, rt: BucketRuntime) -> None:
        self._wait(rt.pending.idle)

    def wait_for_module(self, module: torch.nn.Module) -> None:
        """Before `module` runs forward: its parameters' buckets must be updated on the device.
        A forward between backward and step() (another micro-batch than configured, an
        evaluation, a checkpointed layer recomputed in backward) must read the weights of
        before the step: a speculatively stepped bucket is rolled back first."""
        for p in module.parameters(recurse=False):
            rt = self.runtime_of.get(p)
            if rt is not None and rt in self.inflight:
                if rt.launched:
                    self._reopen(rt)
                self._wait_idle(rt)
                self.transfer.wait_device(rt.h2d_event)
                self.inflight.discard(rt)

    def synchronize(self) -> None:
        """Wait for every queued host job; later device work sees their copy-backs."""
        for rt in self.runtimes:
            self._wait_idle(rt)
            self.transfer.wait_device(rt.h2d_event)
        self.inflight.clear()

    # ---- discarding, closing ----------------------------------------------------------------

    def has_pending_gradients(self) -> bool:
        return any(any(rt.present) for rt in self.runtimes)

    def discard_gradients(self) -> None:
        """zero_grad() between backward and step(): forget the accumulated gradients (torch
        semantics), undoing any speculative step taken with them."""
        if not self.has_pending_gradients():
            return
        for rt in self._host_runtimes():
            if any(rt.round_fired):
                rt.take_round()
            if rt.launched:
                self._reopen(rt)
        self._account_discard()
        if self.fire_log is not None:
            self.fire_log = FireLog(len(self.params))
        for rt in self.runtimes:
            rt.reset()
        self._speculating, self._flags = None, _StepFlags()
        self.synchronize()

    def _account_discard(self) -> None:
        f = self._flags
        self.counters.speculative_steps += f.speculative
        self.counters.rollbacks += f.rolled_back

    def close(self) -> None:
        remove_handles(self._handles)
        try:
            if self.worker.failure is None:
                self.synchronize()
        finally:
            self.worker.stop()
