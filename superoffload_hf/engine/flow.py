"""Weight-flow (DESIGN.md section 11): the low-precision weights of a unit (a decoder block; the
embedding, the head and every other module owning parameters outside the blocks, one unit each,
modules sharing a parameter, a tied embedding and head, as one unit) live on the host and stream
in for each use.

    forward of unit k:  [wait its buckets' host jobs] fetch k (side stream `flow`) ─> event
                        compute waits the event ─> forward ─> release k (event on compute,
                        storage resized to 0) ─> prefetch k+1 .. k+depth (forward order)
    backward of unit k: a gradient hook on k's outputs: fetch k (if not prefetched), compute
                        waits, prefetch k-1 ..; once the post-accumulate hook of each of k's
                        parameters has fired (its gradient left by the bucket path), release k

The host copy that flows is the one the host Adam writes (the bucket's copy-back source: the
low-precision copy under cast "host", the fp32 master under fp32): no copy of its own. Autograd's
saved tensors are the parameters themselves, so releasing storage (as FSDP does) keeps them valid
and the refetch refills them; writes go through `p.data`, whose version counter is its own, so
autograd sees no in-place change. Under gradient checkpointing the recomputed forward runs inside
backward: it fetches (or finds the unit fetched by the gradient hook) and does not release; the
unit goes when its gradients have left, so recomputation and backward share one fetch (reentrant
checkpointing: the first forward ran under no_grad, so the recomputation is what marks them awaited).

Synchronisations (transfer.FLOW_SYNCS; the mutation tests remove each):
* `device_waits_fetch`: the compute stream waits for a unit's fetch before its forward/backward.
* `fetch_waits_release`: every fetch waits for the last release's event (recorded on compute
  after the kernels that read the released weights were queued): the caching allocator may hand
  the released memory to the fetch at once.
* `host_waits_fetch`: the worker writes a bucket's master/lowp only after the last fetch that
  reads it (an evaluation forward between backward and step() fetches, then the step writes).
  The simulator cannot catch its removal: its compute stream runs a waited-for copy at once.

`FlowPlan` is pure data (which units flow, their bytes, the prefetch depth), printed by the
summary and the dry run. Units whose parameters are not all given to the optimizer (frozen or
foreign ones) stay on the device.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

DEFAULT_DEPTH = 1  # units fetched ahead of the one running


@dataclass(frozen=True)
class UnitSpec:
    name: str
    params: tuple[int, ...]  # indices into the engine's parameters
    nbytes: int  # device bytes of its weights


@dataclass(frozen=True)
class FlowPlan:
    units: tuple[UnitSpec, ...]  # the flowing units, in model order
    stationary: tuple[str, ...] = ()  # units kept on the device, and why
    depth: int = DEFAULT_DEPTH

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def peak_bytes(self) -> int:
        """The most flowing weight bytes on the device at once: a unit and the `depth` after it
        (backward: before it) in model order, or a unit used at both ends (tied) and those."""
        sizes = [u.nbytes for u in self.units]
        window = self.depth + 1
        if not sizes:
            return 0
        spans = [sum(sizes[i:i + window]) for i in range(max(1, len(sizes) - window + 1))]
        return max(spans) + (max(sizes) if any("+" in u.name for u in self.units) else 0)

    def describe(self) -> str:
        if not self.units:
            return "weights stationary"
        kept = f", {len(self.stationary)} stationary" if self.stationary else ""
        return (f"weights flow: {len(self.units)} units{kept}, prefetch depth {self.depth}, "
                f"{self.nbytes / 1e6:.3f} MB on the host, <= {self.peak_bytes / 1e6:.3f} MB on the device")


def find_units(model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Module]]]:
    """(name, root modules) per unit: each child of the largest ModuleList (by parameters: the
    decoder blocks), then every other module owning parameters directly, merged where they share
    a parameter (a tied embedding and head)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    blocks_name, blocks = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()), default=(None, None))
    units: list[tuple[str, list[torch.nn.Module]]] = []
    inside = set()
    if blocks is not None:
        for j, block in enumerate(blocks):
            units.append((f"{blocks_name}.{j}", [block]))
            inside.update(id(m) for m in block.modules())
    others: list[tuple[str, list[torch.nn.Module], set]] = []
    for name, module in model.named_modules():
        if id(module) in inside or not any(True for _ in module.parameters(recurse=False)):
            continue
        owned = {id(p) for p in module.parameters(recurse=False)}
        merged = next((o for o in others if o[2] & owned), None)
        if merged is None:
            others.append((name, [module], owned))
        else:
            others[others.index(merged)] = (f"{merged[0]}+{name}", merged[1] + [module], merged[2] | owned)
    return units + [(name, modules) for name, modules, _ in others]


def unit_params(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    seen, params = set(), []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def plan_flow(model: torch.nn.Module, params: list[torch.Tensor], depth: int = DEFAULT_DEPTH,
              element_bytes: Optional[int] = None) -> FlowPlan:
    """`element_bytes`: of the device dtype (default: as the parameters are now)."""
    index_of = {id(p): i for i, p in enumerate(params)}
    flowing, kept = [], []
    for name, modules in find_units(model):
        ps = unit_params(modules)
        if not all(id(p) in index_of and p.requires_grad for p in ps):
            kept.append(f"{name} (parameters the optimizer does not train)")
            continue
        flowing.append(UnitSpec(name, tuple(index_of[id(p)] for p in ps),
                                sum(p.numel() * (element_bytes or p.element_size()) for p in ps)))
    return FlowPlan(tuple(flowing), tuple(kept), depth)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Unit:
    def __init__(self, spec: UnitSpec, params: list[torch.Tensor]):
        self.spec = spec
        self.params = params
        self.nbytes = [p.untyped_storage().nbytes() for p in params]  # each parameter's storage
        self.resident = True  # (released at install)
        self.fetched = None  # the event of its last fetch
        self.awaiting: set[int] = set()  # ids of its parameters whose gradient has not left yet

    def __repr__(self) -> str:
        return f"<unit {self.spec.name}>"


class WeightFlow:
    """The run-time part: gets the plan, the parameters, the buckets (for the host sources and
    their fetch events), the runtime, the transfer (whose `omitted` the mutation tests set), the
    waiter (the buckets' host jobs; set once the engine has built it), counters and timeline."""

    def __init__(self, plan: FlowPlan, params: list[torch.Tensor], buckets, runtime, transfer, waiter=None,
                 counters=None, timeline=None, gather=None):
        self.plan, self.buckets, self.runtime, self.waiter = plan, buckets, runtime, waiter
        # Data parallel (engine/dp.py `gather_for_flow`; set once it is built): a bucket's rank
        # shards all-gathered into its whole weights, on the current stream: a collective.
        self.gather = gather
        self.all_ranks_true: Optional[Callable[[bool], bool]] = None  # data parallel: one decision for all
        self.counters = counters  # OffloadCounters: fetched bytes count in bytes_h2d
        self.timeline = timeline  # perf/timeline.py: each fetch on the h2d track (host issue time)
        self.transfer = transfer  # its `omitted` (the mutation tests) also names flow's syncs
        self.stream = runtime.new_stream()
        self.units = [_Unit(spec, [params[i] for i in spec.params]) for spec in plan.units]
        self.param_ids = {id(p) for u in self.units for p in u.params}
        self.order: list[_Unit] = []  # forward order, learned by the first forward
        self.last_release = None  # event on compute after the last released weights' readers
        self.fetches = 0
        self.bytes_fetched = 0

    def flows(self, p: torch.Tensor) -> bool:
        return id(p) in self.param_ids

    def _keeps(self, sync: str) -> bool:
        return sync not in self.transfer.omitted

    # ---- install -----------------------------------------------------------------------------

    def release_all(self) -> None:
        """At construction, before the device counts them: the host holds every unit's values."""
        for unit in self.units:
            for p in unit.params:
                self.runtime.resize_storage(p, 0)
            unit.resident = False

    def register(self, roots: dict[str, list[torch.nn.Module]], handles: list) -> None:
        """Hooks on each unit's root modules and parameters, holding the flow weakly."""
        ref = weakref.ref(self)
        for unit in self.units:
            for module in roots[unit.spec.name]:
                handles.append(module.register_forward_pre_hook(_call(ref, "before_forward", unit)))
                handles.append(module.register_forward_hook(_call(ref, "after_forward", unit)))
                # model.state_dict() / save_pretrained / load_state_dict(): the unit on the device
                # (it stays there until its next forward releases it)
                handles.append(module.register_state_dict_pre_hook(_call(ref, "before_state_dict", unit)))
                handles.append(module.register_load_state_dict_pre_hook(_call(ref, "before_state_dict", unit)))
            for p in unit.params:
                handles.append(p.register_post_accumulate_grad_hook(_call(ref, "gradient_left", unit)))

    def before_state_dict(self, unit: _Unit, *args) -> None:
        self.ensure(unit)

    # ---- the hooks ---------------------------------------------------------------------------

    def before_forward(self, unit: _Unit, module, args) -> None:
        backward = in_backward()  # a recomputation under gradient checkpointing
        if not backward and unit not in self.order:
            self.order.append(unit)
        self.ensure(unit)
        self.prefetch(unit, -1 if backward else 1)

    def after_forward(self, unit: _Unit, module, args, output) -> None:
        if in_backward():  # recomputed for this backward: released once its gradients have left
            if not unit.awaiting and torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(output)):
                # reentrant checkpointing: the forward ran under no_grad (nothing awaited), and this
                # recomputation's own backward computes the gradients, one parameter at a time
                unit.awaiting = {id(p) for p in unit.params}
            return
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            unit.awaiting = {id(p) for p in unit.params}
            weak = weakref.ref(self)
            torch.autograd.graph.register_multi_grad_hook(
                outputs, lambda grads, unit=unit: weak() and weak().before_backward(unit), mode="any")
        self.release(unit)

    def before_backward(self, unit: _Unit) -> None:
        self.ensure(unit)
        self.prefetch(unit, -1)

    def gradient_left(self, unit: _Unit, p: torch.Tensor) -> None:
        """After the engine's own post-accumulate hook took the gradient (registered after it)."""
        unit.awaiting.discard(id(p))
        if not unit.awaiting and unit.resident and in_backward():
            self.release(unit)

    # ---- fetch and release -------------------------------------------------------------------

    def ensure(self, unit: _Unit) -> None:
        if not unit.resident:
            self.fetch(unit)
        if unit.fetched is not None and self._keeps("device_waits_fetch"):  # it reads what the fetch writes
            self.runtime.current_stream().wait_event(unit.fetched)

    def prefetch(self, unit: _Unit, direction: int) -> None:
        if unit not in self.order:
            return
        at = self.order.index(unit)
        for k in range(1, self.plan.depth + 1):
            j = at + direction * k
            if 0 <= j < len(self.order) and not self.order[j].resident:
                self.fetch(self.order[j])

    def fetch(self, unit: _Unit) -> None:
        """Issue the host->device copies of a unit on the flow stream (not waited for here).
        Data parallel: each of its buckets all-gathered from the ranks' shards (a collective:
        every rank fetches the same units in the same order, see engine/dp.py)."""
        rt = self.runtime
        # The buckets' host jobs have finished writing these weights (a speculatively stepped
        # bucket is rolled back first: a forward before step() reads the weights of before it).
        self.waiter.wait_for_params(unit.params)
        if self.gather is not None:
            self._refuse_speculated(unit)
        start = time.perf_counter()
        with torch.no_grad(), rt.on_stream(self.stream):
            if self.last_release is not None and self._keeps("fetch_waits_release"):
                # the memory the allocator hands out may be a released unit's: its readers first
                self.stream.wait_event(self.last_release)
            if self.gather is None:
                for p, nbytes in zip(unit.params, unit.nbytes):
                    rt.resize_storage(p, nbytes)  # allocated on the flow stream
                    rt.copy_(p.data, self.source(p))  # (p.data: a version counter of its own)
                    rt.record_stream(p.data, self.stream)
            else:
                self._gather_unit(unit)
            done = rt.new_event()
            done.record(self.stream)
        unit.fetched, unit.resident = done, True
        for p in unit.params:  # the worker waits for it before writing these host buffers
            self.buckets.runtime_of[p].fetch_event = done
        self.fetches += 1
        moved = sum(p.numel() * p.element_size() for p in unit.params)
        self.bytes_fetched += moved
        if self.counters is not None:
            self.counters.bytes_h2d += moved
            self.counters.weight_fetches += 1
            self.counters.bytes_fetched += moved
        if self.timeline is not None:
            from superoffload_hf.perf.timeline import H2D

            self.timeline.span(H2D, f"fetch {unit.spec.name}", start, time.perf_counter(), bytes=moved,
                               clock="host (issue)")

    def _buckets_of(self, unit: _Unit) -> list:
        """The bucket runtimes holding the unit's parameters, in bucket order (the same on every rank)."""
        rts = {id(self.buckets.runtime_of[p]): self.buckets.runtime_of[p] for p in unit.params}
        return sorted(rts.values(), key=lambda r: r.bucket.index)

    def _gather_unit(self, unit: _Unit) -> None:
        """On the flow stream: each of the unit's buckets gathered whole (a bucket shared with the
        next unit is gathered for each), the unit's parameters copied out of it."""
        rt = self.runtime
        nbytes_of = {id(p): nbytes for p, nbytes in zip(unit.params, unit.nbytes)}  # (by id: never compare tensors)
        for bucket_rt in self._buckets_of(unit):
            flat = self.gather(bucket_rt)  # every rank's shard; a collective
            for p, slot in zip(bucket_rt.params, bucket_rt.bucket.slots):
                if id(p) not in nbytes_of:
                    continue
                rt.resize_storage(p, nbytes_of[id(p)])  # allocated on the flow stream
                rt.copy_(p.data, flat[slot.offset:slot.offset + slot.numel].view(p.shape))
                rt.record_stream(p.data, self.stream)

    def _refuse_speculated(self, unit: _Unit) -> None:
        """Data parallel: a speculatively stepped shard cannot be re-opened (its gradient has left
        the rank), and a forward between backward and step() must read the weights of before it."""
        for bucket_rt in self._buckets_of(unit):
            if bucket_rt.launched:
                self.waiter.wait_idle(bucket_rt)
                if bucket_rt.spec is not None:
                    raise RuntimeError(
                        f"A forward between backward and step() fetched unit {unit.spec.name}, whose bucket "
                        f"{bucket_rt.bucket.index} this rank has already stepped speculatively: under data "
                        "parallelism with `weights: flow` its weights before the step are no longer on the host. "
                        "Run the forward after step() (or before backward), set `speculation: off`, or use "
                        "`weights: stationary`.")

    def source(self, p: torch.Tensor) -> torch.Tensor:
        from superoffload_hf.engine.buffers import BucketBuffers

        rt, slot = self.buckets.slot_of(self.buckets.index_of[p])
        return BucketBuffers.view(rt.bufs.copy_back_source, slot).view(p.shape)

    def release(self, unit: _Unit) -> None:
        rt = self.runtime
        done = rt.new_event()
        done.record(rt.current_stream())  # after every kernel queued so far that reads the unit
        self.last_release = done
        for p in unit.params:
            rt.resize_storage(p, 0)
        unit.resident = False

    def release_resident(self) -> None:
        """Training thread, before the host writes the weights (step(), a load): a unit still on
        the device (a state_dict or an evaluation forward fetched it since its last release)
        would keep the old values; its next use fetches the new ones."""
        for unit in self.units:
            if unit.resident:
                self.release(unit)

    def restore(self) -> str:
        """close(): the host copies are about to go, so every unit's weights go back into its
        parameters: on the device when they fit in its free memory (on every rank, data
        parallel: one decision, as each rank's restore gathers), else (a model that never fit)
        as host tensors, which the caller should say. Returns "device" or "host"."""
        away = [u for u in self.units if not u.resident]
        fits = sum(sum(u.nbytes) for u in away) <= self.runtime.memory_info()[0]
        if self.all_ranks_true is not None:
            fits = self.all_ranks_true(fits)
        if fits:
            for unit in away:
                self.ensure(unit)
            return "device"
        with torch.no_grad():
            for unit in away:
                if self.gather is None:
                    self._restore_to_host(unit)
                else:  # only a gather has the whole weights: a unit at a time through the device
                    self._restore_to_host_through_the_device(unit)
        return "host"

    def restore_after_failure(self) -> bool:
        """close() after the host worker failed (stopped now): the units away from the device get
        the host copies as they are, as host tensors, so the model keeps weights (no device work,
        which may be what failed). Data parallel: nothing (the whole weights need a gather, a
        collective the other ranks may never join). Whether any unit was restored."""
        away = [u for u in self.units if not u.resident]
        if self.gather is not None or not away:
            return False
        with torch.no_grad():
            for unit in away:
                self._restore_to_host(unit)
        return True

    def _restore_to_host(self, unit: _Unit) -> None:
        for p in unit.params:
            p.data = self.source(p).clone()  # (the host copy is freed with the buckets)
        self.runtime.disown(unit.params)
        unit.resident = True

    def _restore_to_host_through_the_device(self, unit: _Unit) -> None:
        rt = self.runtime
        self.ensure(unit)  # gathered on the flow stream, which the current stream now waits for
        hosts = []
        for p in unit.params:
            host = rt.host_empty(p.numel(), p.dtype)
            rt.copy_(host, p.data.reshape(-1))
            hosts.append(host.view(p.shape))
        done = rt.new_event()
        done.record(rt.current_stream())
        done.synchronize()  # the host tensors are read as soon as this returns
        self.release(unit)
        for p, host in zip(unit.params, hosts):
            p.data = host
        rt.disown(unit.params)
        unit.resident = True

    def fetch_all(self) -> None:
        """Every unit on the device and waited for (a state_dict of the model, a load)."""
        for unit in self.units:
            self.ensure(unit)

    def note(self) -> str:
        return self.plan.describe()


def _call(ref, method: str, unit: _Unit):
    def hook(*args):
        flow = ref()
        if flow is not None:
            getattr(flow, method)(unit, *args)
        return None
    return hook


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if hasattr(value, "to_tuple"):  # transformers' ModelOutput
        return _tensors(value.to_tuple())
    return []
