"""Building the engine: measure, decide the Layout once, build the parts in dependency order.

    runtime -> Layout -> buckets -> worker -> gather -> jobs(copy_back=gather) -> speculation ->
    waiter(jobs) -> flow(waiter, gather) -> route (local, or sharded: dp.py) -> collector(route) ->
    committer(route) -> forward gate + hooks -> Engine(the parts)

Every part gets the collaborators it uses when it is built, never afterwards, and never the
engine. The config is read here: each part takes the fields it needs, and the engine keeps the
few it reads at run time (`Settings`). The waiter comes after the jobs (not before, as DESIGN.md
section 6 sketches): it re-opens a speculated bucket (a rollback job) when a forward needs it,
and that was the one reason the collector and the waiter needed each other.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
import weakref
from typing import Optional, Sequence, Union

import torch
from torch.utils.weak import WeakIdKeyDictionary

from superoffload_hf.config import SuperOffloadConfig, check_sequence_parallel_size
from superoffload_hf.device import make_runtime
from superoffload_hf.device.collectives import Collectives
from superoffload_hf.device.transfer import Transfer
from superoffload_hf.engine.state.buckets import BucketSet
from superoffload_hf.engine.step.collect import Collector
from superoffload_hf.engine.step.commit import Committer
from superoffload_hf.engine.core import Engine
from superoffload_hf.engine.dp.route import DataParallel, broadcast_params, check_not_ddp, sharding
from superoffload_hf.engine.flow import WeightFlow, flowing
from superoffload_hf.plan.flow import find_units
from superoffload_hf.engine.dp.flow import ShardedWeightFlow
from superoffload_hf.engine.dp.gather import ShardGather
from superoffload_hf.engine.step.hooks import ForwardGate, register_forward_wait, register_param_hooks
from superoffload_hf.engine.host_limit import check_plan_fits
from superoffload_hf.engine.step.jobs import DeviceCopyBack, HostJobs
from superoffload_hf.engine.measure import FireLog, machine_facts
from superoffload_hf.engine.state.precision import cast_params_in_place
from superoffload_hf.plan.layout import common_device, decide_layout
from superoffload_hf.engine.live import LiveInputs
from superoffload_hf.engine.step.loss_scale import DynamicLossScale, FixedLossScale
from superoffload_hf.plan.memory import footprint
from superoffload_hf.engine.observe import StepObserver
from superoffload_hf.engine.placement import bind_current_thread, bound_to, host_placement, pci_numa_node
from superoffload_hf.engine.reads import ModuleReads
from superoffload_hf.engine.step.route import LocalRoute
from superoffload_hf.engine.host_limit import engine_trade
from superoffload_hf.engine.step.speculate import Speculation
from superoffload_hf.engine.step.step_state import StepState
from superoffload_hf.engine.step.validate import SpeculationPolicy
from superoffload_hf.engine.step.waits import Waiter
from superoffload_hf.engine.step.worker import HostWorker, InlineWorker, Pending
from superoffload_hf.host.kernel import default_threads, get_host_adam
from superoffload_hf.metrics import OffloadCounters

logger = logging.getLogger("superoffload_hf")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The config fields the engine reads after construction (re-planning, learning, its summary)."""
    speculation: str
    speculation_max_rollback_rate: float
    host_memory_check: bool
    host_memory_budget: Optional[int]
    bucket_size_mb: Union[str, float]
    device_buckets: Union[str, int]
    state_precision: str
    rollback: str
    device_dtype: str

    @classmethod
    def of(cls, config: SuperOffloadConfig) -> "Settings":
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


# Ownership: each managed parameter names the engine whose hooks it carries (`claim`), weakly
# both ways, keyed by the tensor's identity. Two engines hooking one parameter would both take
# its gradient (the second finds the first's placeholder); so an engine built on parameters a
# live engine manages takes them over (`owners_of` finds that one; take_over closes it).
# parameter -> weakref to the engine whose hooks it carries (weak keys: a dropped model's
# parameters leave; weak values: a dropped optimizer is no owner)
_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()


def claim(params: Sequence[torch.Tensor], engine) -> None:
    ref = weakref.ref(engine)
    for p in params:
        _OWNER[p] = ref


def owners_of(params: Sequence[torch.Tensor]) -> list:
    """The open engines that manage any of `params` now, in the order first found."""
    owners: list = []
    for p in params:
        ref = _OWNER.get(p)
        owner = None if ref is None else ref()
        if owner is not None and not owner.closed and not any(o is owner for o in owners):
            owners.append(owner)
    return owners


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
            "(as a resume does), or close() it first to silence this warning.", UserWarning, stacklevel=5)
        owner.supersede()


def auto_host_threads(cores: int, device_is_host: bool = False) -> int:
    """Every core this process may run on but one, which the training thread (the autograd engine
    feeding the device) needs; at least one. On the CPU device every core: host jobs run inline,
    while the training thread waits for them."""
    return cores if device_is_host else max(1, cores - 1)


def _host_adam(config: SuperOffloadConfig, runtime, collectives, numa_node):
    """The host kernel with its thread count, where its threads run, and a note saying why."""
    threads, note = config.host_threads, "set"
    placement = host_placement(config.host_cores, collectives, numa_node)
    if placement is not None:  # the CPU device: jobs run inline, the training thread's core too
        cores = len(placement.cores) if runtime.host_is_device else placement.threads
        threads = cores if threads == "auto" else threads
        note = placement.note
    elif threads == "auto":
        cores = default_threads()
        threads = auto_host_threads(cores, runtime.host_is_device)
        note = (f"auto: {threads} of {cores} cores, " + ("the device is the CPU: jobs run inline"
                if runtime.host_is_device else "one left for the training thread"))
    with bound_to(placement):  # the kernel's pool threads inherit the creating thread's cores
        adam = get_host_adam(config.host_kernel, threads=threads)
    return adam, placement, note


def build_engine(param_groups: list[dict], adamw: bool, config: SuperOffloadConfig, counters: OffloadCounters,
                 process_group=None, model: Optional[torch.nn.Module] = None) -> Engine:
    params = [p for g in param_groups for p in g["params"]]
    runtime = make_runtime(common_device(params))
    bus_id = runtime.pci_bus_id() if hasattr(runtime, "pci_bus_id") else None
    numa_node = pci_numa_node(bus_id) if bus_id else None
    collectives = Collectives.create(process_group, numa_node=numa_node)
    # SP ranks are data-parallel ranks to the engine (parallel/loss.py scales their gradients)
    check_sequence_parallel_size(config.sequence_parallel_size, 1 if collectives is None else collectives.world)
    check_not_ddp(params)
    take_over(params)  # before anything here touches the parameters
    if collectives is not None:
        broadcast_params(collectives, params)
    transfer = Transfer(runtime, config.pin_memory in (True, "auto"))
    # every layout decision, once, before anything is allocated (plan/layout.py)
    layout = decide_layout(params, param_groups, config, machine_facts(
        runtime, transfer, config, None if collectives is None else collectives.topology.shard_world),
        model, all_ranks_fit=None if collectives is None else collectives.all_ranks_true)
    adam, placement, host_threads_note = _host_adam(config, runtime, collectives, numa_node)
    observer = StepObserver(runtime, counters, config.timeline_dir, config.timeline_steps)
    policy = SpeculationPolicy(config.speculation, config.speculation_window,
                               config.speculation_max_rollback_rate, overlap=not runtime.host_is_device)
    loss_scale = FixedLossScale() if config.device_dtype != "fp16" else DynamicLossScale(
        config.loss_scale_init, config.loss_scale_growth_factor, config.loss_scale_backoff_factor,
        config.loss_scale_growth_interval)
    buffers, initial = layout.policy, layout.bucket_plan
    buckets = BucketSet(params, buffers, runtime,
                        shard_of=None if collectives is None else sharding(collectives, layout.align),
                        codec=adam, pin_mode=config.pin_method, pin_threads=adam.threads)
    # speculation auto with compact state: how many buckets may keep a rollback snapshot
    trade = engine_trade(initial, buffers, config.speculation, runtime,
                         check_memory=config.host_memory_check, host_budget=config.host_memory_budget)
    if config.host_memory_check:  # before anything is allocated: refuse with the table, not the OOM killer
        check_plan_fits(footprint(initial, buffers, trade.snapshot_buckets), runtime,
                        sum(p.numel() for p in params), budget_bytes=config.host_memory_budget)
    buckets.install(initial)
    Engine.reserve_staging(transfer, initial)
    cast_params_in_place(params, layout.device_dtype)
    flows = flowing(layout.flow, params)
    worker = InlineWorker() if runtime.host_is_device else HostWorker()
    if placement is not None and not runtime.host_is_device:  # the worker thread calls the kernel
        worker.submit(functools.partial(bind_current_thread, placement.cores), Pending())
    gather = None if collectives is None else ShardGather(collectives, buckets=buckets, runtime=runtime,
                                                          transfer=transfer, counters=counters,
                                                          timeline=observer.timeline, flows=flows)
    # data parallel: the copy-back is the shard's all-gather, issued only after validation
    copies = DeviceCopyBack(transfer, counters, observer.timeline, flows) if gather is None else gather
    jobs = HostJobs(adam, transfer, adamw, config.rollback == "snapshot", counters, copies, observer.timeline,
                    compact=config.state_precision != "fp32")
    step_state = StepState(param_groups, buckets.param_steps, loss_scale)
    # max_grad_norm (the optimizer keeps it current), sync_source, fire_log (None once
    # learned; data parallel: the initial plan on every rank, no re-planning)
    live = LiveInputs(fire_log=None if collectives else FireLog(len(params), runtime),
                      snapshot_trade=trade if trade.applies else None)
    speculation = Speculation(step_state=step_state, policy=policy, loss_scale=loss_scale, live=live,
                              snapshot=jobs.snapshot, adamw=adamw,
                              gradient_accumulation_steps=config.gradient_accumulation_steps)
    reads = ModuleReads(params)
    waiter = Waiter(buckets, worker, transfer, observer, reads, jobs, step_state)
    flow = None
    if layout.flow is not None and gather is None:
        flow = WeightFlow(layout.flow, params, buckets, runtime, transfer, waiter, counters=counters,
                          timeline=observer.timeline)
    elif layout.flow is not None:  # each fetch all-gathers the unit's buckets from the ranks' shards
        flow = ShardedWeightFlow(layout.flow, params, buckets, runtime, transfer, waiter, gather=gather.gather_for_flow,
                                 all_ranks_true=collectives.all_ranks_true, rank=collectives.topology.rank,
                                 counters=counters, timeline=observer.timeline)
    if flow is not None:  # the host holds the units' weights now: released before the device counts them
        flow.release_all()
    runtime.adopt(params)
    # the route: the one place that picks between one process and data parallelism
    if collectives is None:
        route = LocalRoute(params=params, buckets=buckets, transfer=transfer, worker=worker, jobs=jobs, waiter=waiter,
                           step_state=step_state, counters=counters, speculation=speculation, policy=policy,
                           live=live, link_dtype=layout.link_dtype, host_is_device=runtime.host_is_device)
    else:
        route = DataParallel(collectives, params=params, buckets=buckets, transfer=transfer, runtime=runtime,
                             worker=worker, jobs=jobs, waiter=waiter, step_state=step_state, counters=counters,
                             speculation=speculation, policy=policy, link_dtype=layout.link_dtype, gather=gather)
    handles: list = []
    unhooked: list = []
    collector = Collector(params=params, buckets=buckets, worker=worker, route=route, observer=observer, live=live,
                          unhooked=unhooked, handles=handles)
    committer = Committer(buckets=buckets, worker=worker, jobs=jobs, waiter=waiter, step_state=step_state,
                          counters=counters, adamw=adamw, route=route, policy=policy, loss_scale=loss_scale)
    gate = ForwardGate(observer, collector, waiter)
    unhooked.extend(register_param_hooks(params, collector, buckets.index_of, handles))
    register_forward_wait(gate, reads, handles)
    if flow is not None:  # after the engine's gradient hooks: a unit goes once its gradients have left
        flow.register(dict(find_units(model)), handles, model)
    engine = Engine(
        settings=Settings.of(config), adamw=adamw, counters=counters, groups=param_groups, params=params,
        runtime=runtime, transfer=transfer, layout=layout, host_threads_note=host_threads_note, adam=adam,
        observer=observer, jobs=jobs, policy=policy, loss_scale=loss_scale, buckets=buckets, trade=trade,
        flow=flow, step_state=step_state, live=live, worker=worker, reads=reads, waiter=waiter, route=route,
        handles=handles, unhooked=unhooked, collector=collector, committer=committer, gate=gate)
    claim(params, engine)
    logger.info(engine.summary())
    return engine
