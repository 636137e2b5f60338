"""The engine: holds the parts engine/build.py built, in dependency order, and runs step().

    hooks ─> Collector (gradients in) ─> route (rounds, launch; Speculation) ─> HostWorker running HostJobs
    step(): Committer (global norm, commit | rollback+replay | skip, account)
    forward / synchronize: Waiter (per-bucket waits, in stream order)
    BucketSet (plan, buffers, param state) · Layout (the decisions, one value) · Transfer (device seam)
    the route (picked by build.py): local (route.py), or with N > 1 ranks sharded (dp.py: collects,
    reduce-scatters, all-gathers; shards, shard.py)

Threads: hooks run on autograd's thread, step() on the training thread (never at the same time:
backward() blocks the caller), host jobs on the worker. Each bucket's lifecycle is the state
machine of lifecycle.py. Ordering guarantees the engine relies on, each enforced where noted:
* A bucket's host buffers are touched by at most one party at a time: the training thread waits
  for the bucket's queued jobs (`Waiter.wait_idle`) before it copies new gradients into them.
* The worker waits for a bucket's last copy-back before it modifies master/lowp again
  (HostJobs.step / rollback).
* A forward waits for the buckets of its module's parameters (`Waiter.wait_for_module`); every
  optimizer entry point that exposes state (state_dict, load, close) waits for everything.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from superoffload_hf.engine import checkpoint
from superoffload_hf.engine.learn import measured_machine, measured_workload
from superoffload_hf.plan.flow import choose_depth
from superoffload_hf.engine.step.hooks import remove_handles
from superoffload_hf.engine.host_limit import check_plan_fits, host_bytes
from superoffload_hf.engine.measure import FireLog
from superoffload_hf.engine.state.lifecycle import BucketState
from superoffload_hf.plan.memory import footprint
from superoffload_hf.engine.state.saved import FORMAT_VERSION
from superoffload_hf.engine.host_limit import engine_trade
from superoffload_hf.engine.step.validate import Decision, decide
from superoffload_hf.plan.cost_model import BUCKET_SIZES_MB, choose_plan, predict

logger = logging.getLogger("superoffload_hf")

EMPTY_STEP = Decision("empty", 0.0, 1.0)


def _live_input(name: str) -> property:
    """An engine attribute that is the LiveInputs field `name` (read and written through)."""
    return property(lambda engine: getattr(engine.live, name), lambda engine, value: setattr(engine.live, name, value))


class Engine:
    """Holds the parts engine/build.py built (each named as its keyword: buckets, waiter,
    collector, committer, ...) and sequences them: step, replan, synchronize, close."""

    def __init__(self, **parts):
        self.__dict__.update(parts)
        self._host_seconds_before_learning = self.counters.host_step_seconds
        self.learned: Optional[dict] = None  # the learned plan's inputs, for checkpoints
        self.step_returns_early = self.transfer.is_async  # CPU: step() finishes all host work
        self.closed = False
        self.superseded = False  # closed because a newer engine took the parameters over

    # the values the parts read at use (LiveInputs), set by the optimizer and by _learn
    max_grad_norm = _live_input("max_grad_norm")
    sync_source = _live_input("sync_source")
    fire_log = _live_input("fire_log")

    @property
    def plan(self):
        return self.buckets.plan

    @property
    def runtimes(self):
        return self.buckets.runtimes

    @property
    def param_steps(self) -> list[int]:
        return self.buckets.param_steps

    @property
    def inflight(self) -> set:
        return self.waiter.inflight

    def summary(self) -> str:
        n = len(self.plan.buckets)
        return (f"SuperOffload: {n} bucket{'s' if n != 1 else ''} ({self.plan.num_device_buckets} "
                f"device-resident) of <= {self.plan.bucket_numel} elements, device {self.runtime.name} "
                f"{self.settings.device_dtype}, cast {self.layout.cast}, speculation {self.settings.speculation}, "
                f"rollback {self._rollback_note()}, state {self.state_note()}, host Adam {self.adam.name}/{self.adam.isa} "
                f"x{self.adam.threads} threads ({self.host_threads_note}){self.route.describe()}"
                + (f", {self.flow.note()}" if self.flow is not None else ""))

    def _rollback_note(self) -> str:
        if not self.buckets.policy.compact:
            return self.settings.rollback
        trade = "" if not self.trade.applies else (f"; speculates {self.trade.speculated_buckets} of "
                                                   f"{self.trade.host_buckets} host buckets")
        return f"snapshot (compact bytes{trade})"

    def state_note(self) -> str:
        """The state precision and the host state's bytes per parameter, as the Ledger holds them."""
        kinds = self.buckets.policy.state_kinds
        held = sum(self.buckets.ledger.bytes(place, kind) for place in ("host", "pinned") for kind in kinds)
        n = self.route.host_elements()  # (data parallel: this rank's elements)
        per_param = f" {held / n:.3f} B/param" if n else ""
        return f"{self.settings.state_precision}{per_param}"

    # ---- step (training thread) -----------------------------------------------------------

    def step(self, max_grad_norm: Optional[float]) -> Decision:
        self.worker.raise_if_failed()
        self.buckets.check_aliases()
        # torch semantics: no gradient, no update; no step counted, no loss-scale growth
        if self.route.alone and not self.has_pending_gradients() and not any(
                p.requires_grad and p.grad is not None for p in self.unhooked):
            return EMPTY_STEP  # (data parallel: other ranks may have gradients; finish() tells)
        started = self.observer.step_begins()
        if self.flow is not None:
            self.flow.release_resident()  # units fetched since backward hold the weights before this step
        self.transfer.fence()  # this step's copy-backs wait for kernels queued before step()
        self.collector.adopt_unhooked_grads()
        if not self.collector.finish():  # data parallel: no rank had a gradient
            self._forget_step()  # the buckets each rank launched with zeros before it knew
            self.observer.step_ends(started, EMPTY_STEP, self.step_state)
            return EMPTY_STEP
        decision = decide(self.committer.global_sum_squares(), self.loss_scale.scale, max_grad_norm)
        self.committer.apply(decision)
        self.committer.account(decision)
        self.observer.step_ends(started, decision, self.step_state)
        updated = [] if decision.kind == "skip" else [rt for rt in self.buckets.host() if any(rt.present)]
        for rt in self.runtimes:
            if rt.state is BucketState.VALIDATED:
                rt.move(BucketState.RETURNING)
            rt.reset()
        self.step_state.reset()
        if self.fire_log is not None and self.fire_log.order:
            self._learn()
        self.waiter.arm_write_check(updated)
        if self.step_returns_early:
            self.waiter.expect_landing(rt for rt in self.buckets.host() if rt.state is BucketState.RETURNING)
            if not self.reads.learned:
                self.reads.learn()
            self.waiter.wait_for_params(self.reads.orphans)  # no forward hook waits for these
        else:
            self.synchronize()
        self.route.wait_for_queued_gathers()  # before the caller's own collectives (engine/dp/route.py)
        return decision

    # ---- layout ---------------------------------------------------------------------------

    def replan(self, plan, measured: Optional[dict] = None) -> None:
        """Move every parameter's state into the buffers of a new plan (between steps).
        `measured`: the first step's host bandwidth and backward time, for the snapshot trade."""
        if plan == self.plan and not measured:
            return
        # The copy-backs in flight belong to the old runtimes, which no forward waits for after
        # the move (cheap when the caller has synchronized, as _learn and load_state_dict have).
        self.synchronize()
        held = self.footprint()
        self.trade = engine_trade(plan, self.buckets.policy, self.settings.speculation, self.runtime,
                                  check_memory=self.settings.host_memory_check, host_budget=self.settings.host_memory_budget,
                                  held_bytes=host_bytes(held, self.runtime.host_is_device), **(measured or {}))
        self.live.snapshot_trade = self.trade if self.trade.applies else None
        if plan == self.plan:
            return
        if self.settings.host_memory_check:
            check_plan_fits(footprint(plan, self.buckets.policy, self.trade.snapshot_buckets), self.runtime,
                            sum(p.numel() for p in self.params), held=held, budget_bytes=self.settings.host_memory_budget)
        self.buckets.replan(plan)
        self.layout = self.layout.with_plan(plan)
        self.reserve_staging(self.transfer, plan)
        self.runtime.host_empty_cache()  # the old gradient ring and staging (the CPU device: host memory)

    @staticmethod
    def reserve_staging(transfer, plan) -> None:
        """The copy-back staging buffer is sized to the plan's largest host bucket."""
        transfer.reserve(max((b.numel for b in plan.buckets if not b.device_resident), default=0))

    def _learn(self) -> None:
        """After the first step: re-plan from the order the hooks fired in, with the cost model
        choosing the "auto" layout on an accelerator; keep its predicted step time."""
        self.synchronize()
        log, self.fire_log = self.fire_log, None
        host_seconds = self.counters.host_step_seconds - self._host_seconds_before_learning
        numels = [p.numel() for p in self.params]
        host_elements = sum(rt.bucket.numel for rt in self.buckets.host())
        lowp_bytes = self.layout.device_dtype.itemsize
        machine = measured_machine(self.transfer, host_elements, host_seconds, lowp_bytes, self.layout.h2d_gbps)
        # Device time, not host issue time: measured_machine waited for the compute stream, so the
        # first step's timing events have completed (read without blocking).
        device_span = self.observer.device_step_span()
        log.use_device_times()
        workload = measured_workload(log, numels, self.observer.last_step_span if device_span is None else device_span,
                                     self.settings.speculation_max_rollback_rate / 2)
        choice = None
        if self.transfer.is_async and self.layout.device_type != "cpu":
            sizes = BUCKET_SIZES_MB if self.settings.bucket_size_mb == "auto" else (float(self.settings.bucket_size_mb),)
            choice = choose_plan(machine, workload, bucket_sizes_mb=sizes, casts=(self.layout.cast,))
        # the snapshot trade from what the first step measured: the host step's bandwidth (its
        # bytes per element: read and write the state, read the gradient) and the backward
        policy = self.buckets.policy
        state_bytes = sum(self.buckets.ledger.bytes(place, kind) for place in ("host", "pinned")
                          for kind in policy.state_kinds)
        step_bytes = (2 * state_bytes / max(host_elements, 1) + torch.empty((), dtype=policy.link_dtype).element_size())
        measured = {"host_bytes_per_second": machine.host_adam_rate * step_bytes, "backward_seconds": workload.backward_s}
        self.replan(self.layout.learned(self.settings, log, choice, int(machine.device_free_bytes)).bucket_plan,
                    measured)
        if self.flow is not None and choice is not None:  # an accelerator: the link and the forward measured
            self._choose_prefetch_depth(machine, workload)
        predicted = predict(machine, workload, bucket_numel=self.plan.bucket_numel,
                            device_buckets=self.plan.num_device_buckets, cast=self.layout.cast,
                            speculate=self.settings.speculation != "off")
        self.counters.predicted_step_seconds = predicted.step_s
        logger.info("SuperOffload cost model: predicted step %.4fs (forward %.4fs, backward %.4fs, exposed "
                    "host %.4fs, exposed transfers %.4fs) for %s", predicted.step_s, predicted.forward_s,
                    predicted.backward_s, predicted.exposed_host_s, predicted.exposed_transfer_s, machine.name)
        self.learned = {"ready_order": list(log.order), "deferred": log.deferred(),
                        "device_buckets": self.plan.num_device_buckets}

    def _choose_prefetch_depth(self, machine, workload) -> None:
        """Weight-flow's prefetch depth from the first step's link speed and forward time
        (plan/flow.py choose_depth), within the device memory free now; the flow reads
        the new plan's depth from its next prefetch on."""
        flow_choice = self.layout.flow_choice
        units = [u for u, f in zip(flow_choice.units, flow_choice.flowing) if f]
        link = machine.h2d.gbps(max(u.nbytes for u in units)) * 1e9
        # the forward's time shared by matrix-multiply elements (the first step's forward also
        # waited for fetches at depth 1: an over-estimate of the compute, so a shallower prefetch)
        per_element = workload.forward_s / max(sum(u.compute for u in flow_choice.units), 1)
        headroom = max(0, int(self.runtime.memory_info()[0]) - flow_choice.margin_bytes)  # (the margin stays free)
        chosen = choose_depth(flow_choice, link, per_element, headroom_bytes=headroom)
        self.layout = dataclasses.replace(self.layout, flow=dataclasses.replace(self.layout.flow, depth=chosen.depth),
                                          flow_choice=chosen)
        self.flow.use_plan(self.layout.flow)
        logger.info("SuperOffload weight-flow: prefetch depth %d (link %.1f GB/s, forward %.4fs): predicted exposed "
                    "transfer %.4fs a step", chosen.depth, link / 1e9, workload.forward_s, chosen.exposed_s)

    def adopt_learned(self, learned: dict) -> None:
        """Take the plan a checkpoint's optimizer had learned (so a resumed run continues
        exactly as the original would have)."""
        self.fire_log = None
        if not self.route.learns_plans:
            logger.info("SuperOffload: data parallel: the checkpoint's learned plan is not applied (every "
                        "rank keeps the initial plan)")
            return
        self.learned = {"ready_order": [int(i) for i in learned["ready_order"]],
                        "deferred": [int(i) for i in learned["deferred"]],
                        "device_buckets": int(learned["device_buckets"])}
        self.replan(self.layout.plan(self.learned["device_buckets"], self.learned["ready_order"],
                                     self.learned["deferred"]))

    def footprint(self) -> list:
        """What the current plan allocates, per buffer kind (memory.footprint: the arithmetic
        the allocation itself uses); `self.buckets.ledger` has what the engine holds now."""
        return footprint(self.plan, self.buckets.policy, self.trade.snapshot_buckets)

    # ---- checkpoints (engine/checkpoint.py; the route's pieces) ---------------------------------

    def checkpoint_extras(self) -> dict:
        return {"format_version": FORMAT_VERSION, "state_precision": self.settings.state_precision,
                "loss_scale": self.loss_scale.state_dict(), "speculation": self.policy.state_dict(),
                "counters": self.counters.counts(), "plan": self.learned, "layout": self.layout.to_dict()}

    def state_dict(self, groups: list[dict]) -> dict:
        self.synchronize()
        return self.route.state_dict(groups, self.checkpoint_extras())

    def load_state_dict(self, groups: list[dict], sd) -> None:
        saved_groups, extra = self.route.load_state(checkpoint.by_position(sd), groups, self.adopt_learned)
        checkpoint.load_extras(groups, saved_groups, extra, loss_scale=self.loss_scale, policy=self.policy,
                               counters=self.counters, layout=self.layout)
        self.refresh_device_params()

    def state_view(self) -> checkpoint.ParamStateView:
        """`optimizer.state` (read-only fp32 copies, per parameter)."""
        return checkpoint.ParamStateView(self.route, self.params, self.buckets.index_of, lambda: not self.closed,
                                         self.synchronize, self.buckets.codec)

    def refresh_device_params(self) -> None:
        """Copy every master weight to its device parameter (after loading state: the loader
        synchronized before it wrote the host buffers, and queued nothing since)."""
        if self.flow is not None:
            self.flow.release_resident()  # fetched again, from the loaded state, at their next use
        self.route.refresh_device_params(skip=self.flow.flows if self.flow is not None else lambda p: False)

    # ---- waiting, discarding, closing -------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every queued host job; later device work sees their copy-backs."""
        self.waiter.synchronize()

    def has_pending_gradients(self) -> bool:
        return any(any(rt.present) for rt in self.runtimes)

    def discard_gradients(self) -> None:
        """zero_grad() between backward and step(): forget the accumulated gradients (torch
        semantics), undoing any speculative step taken with them."""
        if not self.has_pending_gradients():
            return
        self.collector.discard()
        self.committer.account_flags()
        if self.fire_log is not None:
            self.fire_log = FireLog(len(self.params), self.runtime)
        self._forget_step()

    def _forget_step(self) -> None:
        """Wait for the buckets' jobs; every bucket idle, nothing collected."""
        self.synchronize()
        for rt in self.runtimes:
            rt.move(BucketState.IDLE)
            rt.reset()
        self.step_state.reset()

    def write_timeline(self) -> dict:
        """Write the step timeline now (config `timeline_dir`); the paths written."""
        self.synchronize()
        return self.observer.close()

    def supersede(self) -> None:
        """A newer engine takes these parameters over: forget this step's gradients (undoing any
        speculative step: on the CPU the parameters are the masters), then close."""
        self.superseded = True
        if not self.closed:
            self.discard_gradients()
            self.collector.release_held()
            self.close()

    def close(self) -> None:
        """Stop the worker, remove the hooks, and free every buffer (host arenas, device buffers,
        the transfer's ring and staging) now, whoever still holds the optimizer."""
        with self.runtime.thread_device():  # it may run on any thread: a finalizer, a user's closer
            self._close()

    def _close(self) -> None:
        remove_handles(self.handles)
        try:
            if self.worker.failure is None:
                # the hooks are gone: no later forward waits for the copy-backs in flight, so
                # order the compute stream after them here
                self.synchronize()
                if self.flow is not None and self.flow.restore() == "host":
                    logger.warning("SuperOffload: the model's flowing weights do not fit on the device: after close() "
                                   "they are host tensors (move the model where it fits before using it)")
                self.observer.close()
        finally:
            self.worker.stop()
            if self.worker.failure is not None and self.flow is not None and self.flow.restore_after_failure():
                logger.warning("SuperOffload: the host worker failed; the flowing weights are host tensors after "
                               "close(), as the host last wrote them (a failed step's bucket may be part-updated)")
            self.closed = True
            self.waiter.inflight.clear()
            self.waiter.versions.clear()  # (it names the bucket runtimes, and they their buffers)
            self.buckets.release()
            self.route.release()
            self.transfer.reserve(0)  # the gradient ring and the copy-back staging buffers go
            self.runtime.host_empty_cache()  # page-locked blocks freed so far go back to the system
