"""The engine: wires the parts of the data flow together and runs step().

    hooks ─> Collector (gradients in, launch, speculate) ─> HostWorker running HostJobs
    step(): Committer (global norm, commit | rollback+replay | skip, account)
    forward / synchronize: Waiter (per-bucket waits, in stream order)
    BucketSet (plan, buffers, param state) · Layout (the decisions, one value) · Transfer (device seam)
    with N > 1 ranks: DataParallel (dp.py) collects, reduce-scatters, all-gathers; shards (plan/shard.py)

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
import functools
import logging
import warnings
import weakref
from typing import Callable, Optional

import torch

from superoffload_hf.config import SuperOffloadConfig, check_sequence_parallel_size
from superoffload_hf.device import make_runtime
from superoffload_hf.device.collectives import Collectives
from superoffload_hf.device.transfer import Transfer
from superoffload_hf.engine.autoplan import measured_machine, measured_workload
from superoffload_hf.engine.buckets import BucketSet
from superoffload_hf.engine.collect import Collector
from superoffload_hf.engine.commit import Committer
from superoffload_hf.engine.dp import DataParallel, broadcast_params, check_not_ddp, sharding
from superoffload_hf.engine.flow import WeightFlow
from superoffload_hf.plan.flow import choose_depth, find_units
from superoffload_hf.engine.placement import bind_current_thread, bound_to, host_placement, pci_numa_node
from superoffload_hf.engine.hooks import claim, owners_of, register_forward_wait, register_param_hooks, remove_handles
from superoffload_hf.engine.jobs import HostJobs
from superoffload_hf.engine.host_limit import check_plan_fits
from superoffload_hf.engine.measure import FireLog, machine_facts
from superoffload_hf.engine.precision import cast_params_in_place
from superoffload_hf.plan.layout import common_device, decide_layout
from superoffload_hf.engine.live import LiveInputs
from superoffload_hf.engine.lifecycle import BucketState
from superoffload_hf.engine.loss_scale import make_loss_scale
from superoffload_hf.plan.memory import footprint
from superoffload_hf.engine.observe import StepObserver
from superoffload_hf.engine.reads import ModuleReads
from superoffload_hf.engine.host_limit import engine_trade
from superoffload_hf.engine.step_state import StepState
from superoffload_hf.engine.validate import Decision, SpeculationPolicy, decide
from superoffload_hf.engine.waits import Waiter
from superoffload_hf.engine.worker import HostWorker, InlineWorker, Pending
from superoffload_hf.host.kernel import default_threads, get_host_adam
from superoffload_hf.metrics import OffloadCounters
from superoffload_hf.plan.cost_model import BUCKET_SIZES_MB, choose_plan, predict

logger = logging.getLogger("superoffload_hf")

EMPTY_STEP = Decision("empty", 0.0, 1.0)


def weak_method(method: Callable) -> Callable:
    """`method`, called through a weak reference to its object (which outlives every call)."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)


def _live_input(name: str) -> property:
    """An engine attribute that is the LiveInputs field `name` (read and written through)."""
    return property(lambda engine: getattr(engine.live, name), lambda engine, value: setattr(engine.live, name, value))


def take_over(params: list) -> None:
    """Close every open engine that manages any of `params` (a newer optimizer built on them),
    saying so: two engines hooking one parameter would both take its gradient."""
    for owner in owners_of(params):
        shared = len({id(p) for p in params} & {id(p) for p in owner.params})
        warnings.warn(
            f"SuperOffload: this optimizer took over {shared} parameter{'s' if shared != 1 else ''} that another "
            "SuperOffload optimizer (still referenced: an earlier optimizer or Trainer on this model) managed. "
            "That one is closed now: its hooks are removed, its gradients dropped and its state freed, and "
            "its step() raises. Take its state_dict() before building the new optimizer to keep its state "
            "(as a resume does), or close() it first to silence this warning.", UserWarning, stacklevel=4)
        owner.supersede()


def auto_host_threads(cores: int, device_is_host: bool = False) -> int:
    """Every core this process may run on but one, which the training thread (the autograd engine
    feeding the device) needs; at least one. On the CPU device every core: host jobs run inline,
    while the training thread waits for them."""
    return cores if device_is_host else max(1, cores - 1)


class Engine:
    def __init__(self, param_groups: list[dict], adamw: bool, config: SuperOffloadConfig,
                 counters: OffloadCounters, process_group=None, model: Optional[torch.nn.Module] = None):
        self.config, self.adamw, self.counters = config, adamw, counters
        self.groups = param_groups  # the optimizer's live list: hyperparameters are read at use
        self.params = [p for g in param_groups for p in g["params"]]
        self.runtime = make_runtime(common_device(self.params))
        bus_id = self.runtime.pci_bus_id() if hasattr(self.runtime, "pci_bus_id") else None
        numa_node = pci_numa_node(bus_id) if bus_id else None
        collectives = Collectives.create(process_group, numa_node=numa_node)
        # SP ranks are data-parallel ranks to the engine (parallel/loss.py scales their gradients)
        check_sequence_parallel_size(config.sequence_parallel_size, 1 if collectives is None else collectives.world)
        self.dp: Optional[DataParallel] = None  # built below, from the parts it uses
        check_not_ddp(self.params)
        take_over(self.params)  # before anything here touches the parameters
        if collectives is not None:
            broadcast_params(collectives, self.params)
        self.transfer = Transfer(self.runtime, config.pin_memory in (True, "auto"))
        # every layout decision, once, before anything is allocated (plan/layout.py)
        self.layout = decide_layout(self.params, param_groups, config, machine_facts(
            self.runtime, self.transfer, config, None if collectives is None else collectives.topology.shard_world),
            model, all_ranks_fit=None if collectives is None else collectives.all_ranks_true)
        self.cast = self.layout.cast
        self.host_threads_note = "set"
        threads = config.host_threads
        placement = host_placement(self.config.host_cores, collectives, numa_node)
        if placement is not None:  # the CPU device: jobs run inline, the training thread's core too
            cores = len(placement.cores) if self.runtime.host_is_device else placement.threads
            threads = cores if threads == "auto" else threads
            self.host_threads_note = placement.note
        elif threads == "auto":
            cores = default_threads()
            threads = auto_host_threads(cores, self.runtime.host_is_device)
            self.host_threads_note = (f"auto: {threads} of {cores} cores, " + ("the device is the CPU: jobs run inline"
                                      if self.runtime.host_is_device else "one left for the training thread"))
        with bound_to(placement):  # the kernel's pool threads inherit the creating thread's cores
            self.adam = get_host_adam(config.host_kernel, threads=threads)
        self.observer = StepObserver(self.runtime, counters, config.timeline_dir, config.timeline_steps)
        self.jobs = HostJobs(self.adam, self.transfer, adamw, config.rollback == "snapshot", counters,
                             self.observer.timeline, compact=config.state_precision != "fp32")
        self.policy = SpeculationPolicy(config.speculation, config.speculation_window,
                                        config.speculation_max_rollback_rate, overlap=not self.runtime.host_is_device)
        self.loss_scale = make_loss_scale(config)
        buffers = self.layout.policy
        self.buckets = BucketSet(self.params, buffers, self.runtime,
                                 shard_of=None if collectives is None else sharding(collectives, self.layout.align),
                                 codec=self.adam, pin_mode=config.pin_method, pin_threads=self.adam.threads)
        initial = self.layout.bucket_plan
        # speculation auto with compact state: how many buckets may keep a rollback snapshot
        self.trade = engine_trade(initial, buffers, config.speculation, self.runtime,
                                  check_memory=config.host_memory_check, host_budget=config.host_memory_budget)
        if config.host_memory_check:  # before anything is allocated: refuse with the table, not the OOM killer
            check_plan_fits(footprint(initial, buffers, self.trade.snapshot_buckets), self.runtime,
                            sum(p.numel() for p in self.params), budget_bytes=config.host_memory_budget)
        self.buckets.install(initial)
        self._reserve_staging()
        cast_params_in_place(self.params, self.layout.device_dtype)
        self.flow: Optional[WeightFlow] = None
        if self.layout.flow is not None:  # the host holds the units' weights now: released before the device counts them
            self.flow = WeightFlow(self.layout.flow, self.params, self.buckets, self.runtime,
                                   self.transfer, counters=counters, timeline=self.observer.timeline)
            self.flow.release_all()
            self.jobs.flows = self.flow.flows
        self.runtime.adopt(self.params)
        self.step_state = StepState(param_groups, self.buckets.param_steps, self.loss_scale)
        # max_grad_norm (the optimizer keeps it current), sync_source, fire_log (None once
        # learned; data parallel: the initial plan on every rank, no re-planning)
        self.live = LiveInputs(fire_log=None if collectives else FireLog(len(self.params), self.runtime),
                               snapshot_trade=self.trade if self.trade.applies else None)
        self._host_seconds_before_learning = counters.host_step_seconds
        self.learned: Optional[dict] = None  # the learned plan's inputs, for checkpoints
        self.worker = InlineWorker() if self.runtime.host_is_device else HostWorker()
        if placement is not None and not self.runtime.host_is_device:  # the worker thread calls the kernel
            self.worker.submit(functools.partial(bind_current_thread, placement.cores), Pending())
        self.reads = ModuleReads(self.params)
        self.waiter = Waiter(self.buckets, self.worker, self.transfer, self.observer, None, self.reads)  # reopen set below
        if self.flow is not None:
            self.flow.waiter = self.waiter
        if collectives is not None:
            self.dp = DataParallel(collectives, params=self.params, buckets=self.buckets, transfer=self.transfer,
                                   runtime=self.runtime, worker=self.worker, jobs=self.jobs, waiter=self.waiter,
                                   step_state=self.step_state, counters=counters)
            self.jobs.gather = weak_method(self.dp.gather_back)  # weakly: the data-parallel part holds the jobs
            if self.flow is not None:  # each fetch all-gathers the unit's buckets from the ranks' shards
                self.dp.flows = self.flow.flows
                self.flow.gather = weak_method(self.dp.gather_for_flow)
                self.flow.all_ranks_true = collectives.all_ranks_true
                self.flow.rank = collectives.topology.rank  # rank 0 keeps what fetch_weights() gathers
        self.handles: list = []
        self.unhooked: list = []
        # The parts get the collaborators they use, never the engine: no reference cycle, so a
        # dropped (or closed) optimizer frees its buffers at once, without the cyclic collector.
        self.collector = Collector(
            params=self.params, buckets=self.buckets, transfer=self.transfer, worker=self.worker, jobs=self.jobs,
            waiter=self.waiter, step_state=self.step_state, counters=counters,
            gradient_accumulation_steps=config.gradient_accumulation_steps, link_dtype=self.layout.link_dtype,
            host_is_device=self.runtime.host_is_device, policy=self.policy, loss_scale=self.loss_scale, dp=self.dp,
            observer=self.observer, live=self.live, unhooked=self.unhooked, handles=self.handles)
        self.waiter.reopen = weak_method(self.collector.reopen)  # weakly: the collector holds the waiter
        if self.dp is not None:
            self.dp.use_collector(self.collector)  # weakly: the collector holds the dp part
        self.committer = Committer(
            buckets=self.buckets, worker=self.worker, jobs=self.jobs, waiter=self.waiter, step_state=self.step_state,
            counters=counters, adamw=adamw, dp=self.dp, policy=self.policy, loss_scale=self.loss_scale)
        self.step_returns_early = self.transfer.is_async  # CPU: step() finishes all host work
        self.closed = False
        self.superseded = False  # closed because a newer engine took the parameters over
        self.unhooked.extend(register_param_hooks(self.params, self.collector, self.buckets.index_of, self.handles))
        register_forward_wait(self, self.reads, self.handles)
        if self.flow is not None:  # after the engine's gradient hooks: a unit goes once its gradients have left
            self.flow.register(dict(find_units(model)), self.handles, model)
        claim(self.params, self)
        logger.info(self.summary())

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
        dp = "" if self.dp is None else f", {self.dp.describe()}"
        n = len(self.plan.buckets)
        return (f"SuperOffload: {n} bucket{'s' if n != 1 else ''} ({self.plan.num_device_buckets} "
                f"device-resident) of <= {self.plan.bucket_numel} elements, device {self.runtime.name} "
                f"{self.config.device_dtype}, cast {self.cast}, speculation {self.config.speculation}, "
                f"rollback {self._rollback_note()}, state {self.state_note()}, host Adam {self.adam.name}/{self.adam.isa} "
                f"x{self.adam.threads} threads ({self.host_threads_note}){dp}"
                + (f", {self.flow.note()}" if self.flow is not None else ""))

    def _rollback_note(self) -> str:
        if not self.buckets.policy.compact:
            return self.config.rollback
        trade = "" if not self.trade.applies else (f"; speculates {self.trade.speculated_buckets} of "
                                                   f"{self.trade.host_buckets} host buckets")
        return f"snapshot (compact bytes{trade})"

    def state_note(self) -> str:
        """The state precision and the host state's bytes per parameter, as the Ledger holds them."""
        kinds = self.buckets.policy.state_kinds
        held = sum(self.buckets.ledger.bytes(place, kind) for place in ("host", "pinned") for kind in kinds)
        n = (sum(s.numel for rt in self.buckets.host() for s in rt.bucket.slots) if self.dp is None
             else sum(rt.shard.used_numel for rt in self.buckets.host()))  # this rank's elements
        per_param = f" {held / n:.3f} B/param" if n else ""
        return f"{self.config.state_precision}{per_param}"

    # ---- the hooks' entry points ----------------------------------------------------------

    def on_forward(self) -> None:
        self.observer.open_step()

    def wait_for_module(self, module: torch.nn.Module) -> None:
        self.waiter.wait_for_module(module)

    # ---- step (training thread) -----------------------------------------------------------

    def step(self, max_grad_norm: Optional[float]) -> Decision:
        self.worker.raise_if_failed()
        self.buckets.check_aliases()
        # torch semantics: no gradient, no update; no step counted, no loss-scale growth
        if self.dp is None and not self.has_pending_gradients() and not any(
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
            self.waiter.inflight = {rt for rt in self.buckets.host() if rt.state is BucketState.RETURNING}
            if not self.reads.learned:
                self.reads.learn()
            self.waiter.wait_for_params(self.reads.orphans)  # no forward hook waits for these
        else:
            self.synchronize()
        if self.dp is not None:  # before the caller's own collectives (DataParallel.wait_for_queued_gathers)
            self.dp.wait_for_queued_gathers()
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
        from superoffload_hf.engine.host_limit import host_bytes

        held = self.footprint()
        self.trade = engine_trade(plan, self.buckets.policy, self.config.speculation, self.runtime,
                                  check_memory=self.config.host_memory_check, host_budget=self.config.host_memory_budget,
                                  held_bytes=host_bytes(held, self.runtime.host_is_device), **(measured or {}))
        self.live.snapshot_trade = self.trade if self.trade.applies else None
        if plan == self.plan:
            return
        if self.config.host_memory_check:
            check_plan_fits(footprint(plan, self.buckets.policy, self.trade.snapshot_buckets), self.runtime,
                            sum(p.numel() for p in self.params), held=held, budget_bytes=self.config.host_memory_budget)
        self.buckets.replan(plan)
        self.layout = self.layout.with_plan(plan)
        self._reserve_staging()
        self.runtime.host_empty_cache()  # the old gradient ring and staging (the CPU device: host memory)

    def _reserve_staging(self) -> None:
        """The copy-back staging buffer is sized to the plan's largest host bucket."""
        self.transfer.reserve(max((b.numel for b in self.plan.buckets if not b.device_resident), default=0))

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
                                     self.config.speculation_max_rollback_rate / 2)
        choice = None
        if self.transfer.is_async and self.layout.device_type != "cpu":
            sizes = BUCKET_SIZES_MB if self.config.bucket_size_mb == "auto" else (float(self.config.bucket_size_mb),)
            choice = choose_plan(machine, workload, bucket_sizes_mb=sizes, casts=(self.cast,))
        # the snapshot trade from what the first step measured: the host step's bandwidth (its
        # bytes per element: read and write the state, read the gradient) and the backward
        policy = self.buckets.policy
        state_bytes = sum(self.buckets.ledger.bytes(place, kind) for place in ("host", "pinned")
                          for kind in policy.state_kinds)
        step_bytes = (2 * state_bytes / max(host_elements, 1) + torch.empty((), dtype=policy.link_dtype).element_size())
        measured = {"host_bytes_per_second": machine.host_adam_rate * step_bytes, "backward_seconds": workload.backward_s}
        self.replan(self.layout.learned(self.config, log, choice, int(machine.device_free_bytes)).bucket_plan,
                    measured)
        if self.flow is not None and choice is not None:  # an accelerator: the link and the forward measured
            self._choose_prefetch_depth(machine, workload)
        predicted = predict(machine, workload, bucket_numel=self.plan.bucket_numel,
                            device_buckets=self.plan.num_device_buckets, cast=self.cast,
                            speculate=self.config.speculation != "off")
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
        self.flow.plan = self.layout.flow
        logger.info("SuperOffload weight-flow: prefetch depth %d (link %.1f GB/s, forward %.4fs): predicted exposed "
                    "transfer %.4fs a step", chosen.depth, link / 1e9, workload.forward_s, chosen.exposed_s)

    def adopt_learned(self, learned: dict) -> None:
        """Take the plan a checkpoint's optimizer had learned (so a resumed run continues
        exactly as the original would have)."""
        self.fire_log = None
        if self.dp is not None:
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

    # ---- per-parameter state (checkpoints) ---------------------------------------------------

    def export_param(self, index: int) -> dict[str, torch.Tensor]:
        return self.buckets.export_param(index)

    def import_param(self, index: int, values: dict[str, torch.Tensor], step: int) -> bool:
        """Returns whether the state was converted (another state precision than its bucket's)."""
        converted = self.buckets.import_param(index, values)
        self.buckets.param_steps[index] = int(step)
        return converted

    def refresh_device_params(self) -> None:
        """Copy every master weight to its device parameter (after loading state: the loader
        synchronized before it wrote the host buffers, and queued nothing since)."""
        if self.flow is not None:
            self.flow.release_resident()  # fetched again, from the loaded state, at their next use
        if self.dp is not None:
            return self.dp.refresh_device_params()
        self.buckets.refresh_device_params(skip=self.flow.flows if self.flow is not None else lambda p: False)

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
            if self.dp is not None:
                self.dp.release()
            self.transfer.reserve(0)  # the gradient ring and the copy-back staging buffers go
            self.runtime.host_empty_cache()  # page-locked blocks freed so far go back to the system
