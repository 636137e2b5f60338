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

Between uses a flowing parameter is *released*: its storage has 0 bytes behind a full-size tensor,
which no kernel may read (a segmentation fault on the CPU, freed memory on CUDA). So a released
parameter's class is switched to a subclass of its own (`_released_class`) whose
`__torch_function__` lets metadata through (shape, dtype, device, grad, hooks, ...), lands
`copy_` in the host copy (`write`: what `load_state_dict` and `with torch.no_grad(): p.copy_(x)`
do), hands out `detach()` / `.data` as released views (their `copy_` lands too) and refuses every
other op with an error naming `model.state_dict()`; a fetch switches the class back, so a resident
parameter costs nothing. The model's state dict (a post-hook on every module owning a flowing
parameter) holds host copies of those weights, gathered unit by unit from the host copy that
flows (data parallel: all-gathered, a collective), never fetched onto the device.

`FlowPlan` (plan/flow.py) is pure data (which units flow, their bytes, the prefetch depth),
printed by the summary and the dry run. Units whose parameters are not all given to the optimizer (frozen or
foreign ones) stay on the device.
"""

from __future__ import annotations

import time
import weakref
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_leaves

from superoffload_hf.plan.flow import FlowPlan, UnitSpec

def flowing(plan: Optional[FlowPlan], params: list[torch.Tensor]) -> Callable[[torch.Tensor], bool]:
    """Whether a parameter flows under `plan` (None: none does); for the parts built before the
    flow (the host jobs and the gather skip its copy-backs)."""
    ids = frozenset() if plan is None else frozenset(id(params[i]) for spec in plan.units for i in spec.params)
    return lambda p: id(p) in ids


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
        # model.state_dict(): its host copies for the destination being filled (weakly: the
        # destination holds them; a tied parameter saved under two names is one tensor)
        self.saved_for = None
        self.saved: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self.holding: Optional[dict] = None  # strongly, until the unit's root has added its entries

    def __repr__(self) -> str:
        return f"<unit {self.spec.name}>"


class WeightFlow:
    """The run-time part: gets the plan, the parameters, the buckets (for the host sources and
    their fetch events), the runtime, the transfer (whose `omitted` the mutation tests set), the
    waiter (the buckets' host jobs), counters and timeline. One process: the host copy that
    flows is the bucket's own; under data parallelism it is the ranks' shards, gathered
    (engine/dp/flow.py ShardedWeightFlow, which build picks)."""

    read_hint = ""  # how model.state_dict() reads flowing weights, in messages (sharded: a collective)

    def __init__(self, plan: FlowPlan, params: list[torch.Tensor], buckets, runtime, transfer, waiter,
                 counters=None, timeline=None):
        self.plan, self.buckets, self.runtime, self.waiter = plan, buckets, runtime, waiter
        self.counters = counters  # OffloadCounters: fetched bytes count in bytes_h2d
        self.timeline = timeline  # perf/timeline.py: each fetch on the h2d track (host issue time)
        self.transfer = transfer  # its `omitted` (the mutation tests) also names flow's syncs
        self.stream = runtime.new_stream()
        self.units = [_Unit(spec, [params[i] for i in spec.params]) for spec in plan.units]
        self.param_ids = {id(p) for u in self.units for p in u.params}
        self.order: list[_Unit] = []  # forward order, learned by the first forward
        self.last_release = None  # event on compute after the last released weights' readers
        self.names: dict[int, str] = {}  # id(param) -> its name in the model (for messages)
        self.fetches = 0
        self.bytes_fetched = 0

    def flows(self, p: torch.Tensor) -> bool:
        return id(p) in self.param_ids

    def use_plan(self, plan: FlowPlan) -> None:
        """A re-planned prefetch depth (engine/core.py): read from the next prefetch on."""
        if plan.units != self.plan.units:
            raise ValueError("a weight-flow re-plan may change the prefetch depth only, not the flowing units")
        self.plan = plan

    def _keeps(self, sync: str) -> bool:
        return sync not in self.transfer.omitted

    # ---- install -----------------------------------------------------------------------------

    def release_all(self) -> None:
        """At construction, before the device counts them: the host holds every unit's values."""
        for unit in self.units:
            for p in unit.params:
                self.runtime.resize_storage(p, 0)
            unit.resident = False
            _mark_released(self, unit)

    def register(self, roots: dict[str, list[torch.nn.Module]], handles: list, model: torch.nn.Module) -> None:
        """Hooks on each unit's root modules, on every module owning one of its parameters (the
        model's state dict) and on its parameters, holding the flow weakly."""
        ref = weakref.ref(self)
        self.names = {id(p): name for name, p in model.named_parameters()}
        for unit in self.units:
            ids = {id(p) for p in unit.params}
            for module in roots[unit.spec.name]:
                handles.append(module.register_forward_pre_hook(_call(ref, "before_forward", unit)))
                handles.append(module.register_forward_hook(_call(ref, "after_forward", unit)))
                # load_state_dict(): a unit on the device goes first, so every copy_ lands in the host copy
                handles.append(module.register_load_state_dict_pre_hook(_call(ref, "before_load", unit)))
                for owner in module.modules():
                    own = [(name, p) for name, p in owner._parameters.items() if p is not None and id(p) in ids]
                    if own:  # model.state_dict() / save_pretrained: host copies in place of the released views
                        handles.append(owner.register_state_dict_post_hook(
                            _call(ref, "after_state_dict", unit, tuple(name for name, _ in own),
                                  tuple(p for _, p in own))))
                # (after the owners' hooks: the unit's entries are all in, its copies held by them)
                handles.append(module.register_state_dict_post_hook(_call(ref, "unit_saved", unit)))
            for p in unit.params:
                handles.append(p.register_post_accumulate_grad_hook(_call(ref, "gradient_left", unit)))

    # ---- the model's state dict, loads and writes ---------------------------------------------

    def after_state_dict(self, unit: _Unit, names: tuple, params: tuple, module, destination, prefix: str,
                         local_metadata) -> None:
        """A module owning flowing parameters added its entries (released views): each becomes
        a host copy of the weights training uses, the unit's gathered once per destination."""
        keys = [prefix + name for name in names]
        if not any(key in destination for key in keys):
            return
        values = self.host_copies(unit, destination)
        for key, p in zip(keys, params):
            if key in destination:
                destination[key] = values[id(p)]

    def host_copies(self, unit: _Unit, destination=None) -> dict[int, torch.Tensor]:
        """id(param) -> a host tensor holding the unit's weights as training uses them: the host
        copy that flows (the buckets' host jobs waited for; a bucket stepped speculatively before
        step() is rolled back first, as a fetch does), or under data parallelism its gather."""
        if destination is not None and unit.saved_for is not None and unit.saved_for() is destination:
            if unit.holding is not None:
                return unit.holding
            if all(id(p) in unit.saved for p in unit.params):
                return {id(p): unit.saved[id(p)] for p in unit.params}
        values = self._state_values(unit)
        if destination is not None:
            unit.saved_for = weakref.ref(destination)
            unit.saved = weakref.WeakValueDictionary(values)
            unit.holding = values
        return values

    def unit_saved(self, unit: _Unit, *args) -> None:
        unit.holding = None

    def _state_values(self, unit: _Unit) -> dict[int, torch.Tensor]:
        return self._host_copies_of_source(unit)

    def _host_copies_of_source(self, unit: _Unit) -> dict[int, torch.Tensor]:
        self.waiter.wait_for_params(unit.params)
        for bucket_rt in self._buckets_of(unit):
            self.waiter.wait_idle(bucket_rt)  # (its host jobs write the source)
        values = {}
        with torch.no_grad():
            for p in unit.params:
                host = torch.empty(p.shape, dtype=p.dtype)
                host.copy_(self.source(p).view(p.shape))
                values[id(p)] = host
        return values

    def prepare_state_dict(self) -> None:
        """optimizer.fetch_weights(), on every rank together. Data parallel: every unit gathered
        now (the collectives), rank 0 keeping the host copies, so that rank 0's
        `model.state_dict()` needs no other rank (the Trainer's save: `save_model` on every rank,
        the writing on rank 0); kept until the next forward, step(), load or write. One process:
        nothing to do (the state dict reads the host copies)."""
        self.forget_gathered()

    def forget_gathered(self) -> None:
        for unit in self.units:
            unit.holding = None

    def _new_forward(self) -> None:
        """A forward (not a recomputation) begins: nothing here (sharded: fetch_weights()'s copies go)."""

    def before_load(self, unit: _Unit, *args) -> None:
        if unit.resident and not in_backward():
            self.release(unit)

    def write(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """`p.copy_(value)` on a released parameter (load_state_dict does it): into the host copy
        that flows and the master behind it, where that is another buffer (the bf16 copy's
        master, compact state's error bits) only at the elements whose value changes, so writing
        the weights a step already holds changes nothing. Data parallel: this rank's pieces
        (every rank writes the same value, as load_state_dict on every rank does)."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"copy_ into a parameter under weight-flow takes a tensor, got {type(value).__name__}.")
        self.forget_gathered()
        index = self.buckets.index_of[p]
        self.waiter.wait_for_params([p])
        bucket_rt = self.buckets.runtime_of[p]
        self.waiter.wait_idle(bucket_rt)
        with torch.no_grad():
            flat = value.detach().to("cpu", p.dtype).expand(p.shape).reshape(-1)
            for offset, start, numel in self._pieces(index, bucket_rt):
                _write_weights(bucket_rt.bufs, offset, flat[start:start + numel])
        torch.autograd.graph.increment_version(p)  # (as an in-place write does: autograd refuses stale saves)

    # ---- the hooks ---------------------------------------------------------------------------

    def _pieces(self, index: int, bucket_rt) -> list[tuple[int, int, int]]:
        """(offset in the bucket's host copy, start in the parameter, elements) of parameter `index`."""
        _, slot = self.buckets.slot_of(index)
        return [(slot.offset, 0, slot.numel)]

    def before_forward(self, unit: _Unit, module, args) -> None:
        if _under_torch_compile():
            raise RuntimeError(
                f"torch.compile traced the forward of unit {unit.spec.name} under `weights: flow`: weight-flow "
                "frees each unit's weights between its uses and fetches them in forward hooks, which a compiled "
                "graph does not run as such (it would read released storages). Call the uncompiled model, or set "
                "`weights: stationary` (or `auto` where the weights fit on the device) to use torch.compile.")
        backward = in_backward()  # a recomputation under gradient checkpointing
        if not backward:
            self._new_forward()
            if unit not in self.order:
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
        every rank fetches the same units in the same order, see engine/dp/route.py)."""
        rt = self.runtime
        # The buckets' host jobs have finished writing these weights (a speculatively stepped
        # bucket is rolled back first: a forward before step() reads the weights of before it).
        self.waiter.wait_for_params(unit.params)
        self._before_fetch(unit)
        start = time.perf_counter()
        _mark_resident(unit)
        with torch.no_grad(), rt.on_stream(self.stream):
            if self.last_release is not None and self._keeps("fetch_waits_release"):
                # the memory the allocator hands out may be a released unit's: its readers first
                self.stream.wait_event(self.last_release)
            self._fetch_unit(unit)
            done = rt.new_event()
            done.record(self.stream)
        unit.fetched, unit.resident = done, True
        for p in unit.params:  # the worker waits for it before writing these host buffers
            self.buckets.runtime_of[p].fetch_event = done
        self.fetches += 1
        moved = sum(p.numel() * p.element_size() for p in unit.params)
        self.bytes_fetched += moved
        if self.counters is not None:
            self.counters.add("bytes_h2d", moved)
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

    def _before_fetch(self, unit: _Unit) -> None:
        """Nothing: a speculated bucket was re-opened (rolled back) by the waiter."""

    def _fetch_unit(self, unit: _Unit) -> None:
        """On the flow stream: the unit's weights from their host copies."""
        rt = self.runtime
        for p, nbytes in zip(unit.params, unit.nbytes):
            rt.resize_storage(p, nbytes)  # allocated on the flow stream
            rt.copy_(p.data, self.source(p))  # (p.data: a version counter of its own)
            rt.record_stream(p.data, self.stream)

    def source(self, p: torch.Tensor) -> torch.Tensor:
        from superoffload_hf.engine.state.buffers import BucketBuffers

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
        _mark_released(self, unit)

    def release_resident(self) -> None:
        """Training thread, before the host writes the weights (step(), a load): a unit still on
        the device (a state_dict or an evaluation forward fetched it since its last release)
        would keep the old values; its next use fetches the new ones."""
        self.forget_gathered()
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
        if self._all_agree(fits):
            compute = self.runtime.current_stream()
            for unit in away:
                self.ensure(unit)
                for p in unit.params:
                    # allocated on the flow stream, the model's from now on: once no release's
                    # event orders a later fetch after its readers, only this keeps the caching
                    # allocator from handing the memory out while compute kernels still read it
                    self.runtime.record_stream(p.data, compute)
            return "device"
        with torch.no_grad():
            for unit in away:
                self._restore_away_to_host(unit)
        return "host"

    def _all_agree(self, fits: bool) -> bool:
        return fits

    def _restore_away_to_host(self, unit: _Unit) -> None:
        self._restore_to_host(unit)

    def restore_after_failure(self) -> bool:
        """close() after the host worker failed (stopped now): the units away from the device get
        the host copies as they are, as host tensors, so the model keeps weights (no device work,
        which may be what failed). Data parallel: nothing (the whole weights need a gather, a
        collective the other ranks may never join). Whether any unit was restored."""
        away = [u for u in self.units if not u.resident]
        if not away:
            return False
        with torch.no_grad():
            for unit in away:
                self._restore_to_host(unit)
        return True

    def _restore_to_host(self, unit: _Unit) -> None:
        _mark_resident(unit)
        for p in unit.params:
            p.data = self.source(p).clone()  # (the host copy is freed with the buckets)
        self.runtime.disown(unit.params)
        unit.resident = True

    def note(self) -> str:
        return self.plan.describe()


def _under_torch_compile() -> bool:
    """Whether torch.compile (Dynamo) is tracing or running this call. Hazard: a `raise` Dynamo
    traces makes it run the frame eagerly instead, where `is_compiling()` is False; the
    frame-evaluation callback, read there, stays set while a compiled module's call runs."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False)


def _call(ref, method: str, unit: _Unit, *bound):
    def hook(*args):
        flow = ref()
        if flow is not None:
            getattr(flow, method)(unit, *bound, *args)
        return None
    return hook


def _write_weights(bufs, offset: int, value: torch.Tensor) -> None:
    """`value` (the parameter's dtype) into a bucket's flowing host copy at `offset` (see write)."""
    source = bufs.copy_back_source[offset:offset + value.numel()]
    if bufs.compact:  # master = the bf16 part + error bits: a changed element's error goes
        bufs.master_err[offset:offset + value.numel()].masked_fill_(source != value, 0)
    elif bufs.lowp is not None:  # the fp32 master behind the low-precision copy
        master = bufs.master[offset:offset + value.numel()]
        master.copy_(torch.where(source != value, value.to(master.dtype), master))
    source.copy_(value)


# ---- released parameters --------------------------------------------------------------------------
#
# A released parameter's class is a subclass of its own class (`_released_class`), and the views
# handed out of it (`detach()`, `.data`) are `ReleasedTensor`s; `tensor._superoffload_released`
# holds (the flow, weakly; the unit; the parameter). See the module docstring.

_INFO = "_superoffload_released"
_CLASSES: dict[type, type] = {}


def _mark_released(flow: WeightFlow, unit: _Unit) -> None:
    ref = weakref.ref(flow)
    for p in unit.params:
        setattr(p, _INFO, (ref, unit, p))
        p.__class__ = _released_class(type(p))


def _mark_resident(unit: _Unit) -> None:
    for p in unit.params:
        original = type(p).__dict__.get("_superoffload_original")
        if original is not None:
            p.__class__ = original
        p.__dict__.pop(_INFO, None)


def _released_class(cls: type) -> type:
    if "_superoffload_original" in cls.__dict__:
        return cls
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = type(f"Released{cls.__name__}", (cls,), {
            "__torch_function__": classmethod(_released_torch_function), "_superoffload_original": cls,
            "__module__": __name__})
    return made


def _metadata_functions() -> frozenset:
    """What reads no element: passed through on a released tensor."""
    T = torch.Tensor
    getters = ("shape", "dtype", "device", "requires_grad", "grad", "_grad", "is_leaf", "grad_fn", "_grad_fn",
               "layout", "ndim", "names", "_version", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_sparse_csr",
               "is_quantized", "is_mkldnn", "is_nested", "is_mps", "is_xpu", "is_xla", "is_ipu", "is_mtia",
               "is_vulkan", "is_maia", "itemsize", "nbytes", "output_nr", "_base", "_cdata", "retains_grad",
               "_backward_hooks", "_post_accumulate_grad_hooks", "is_inference")
    setters = ("grad", "_grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks")
    methods = ("size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
               "is_floating_point", "is_complex", "is_signed", "is_inference", "requires_grad_", "retain_grad",
               "register_hook", "register_post_accumulate_grad_hook", "get_device", "untyped_storage",
               "_typed_storage", "is_pinned", "is_shared", "_is_view", "__len__", "__hash__", "_is_zerotensor",
               "_has_symbolic_sizes_strides", "dim_order")
    found = set()
    for name in getters:
        attr = getattr(T, name, None)
        if attr is not None and hasattr(attr, "__get__"):
            found.add(attr.__get__)
    for name in setters:
        attr = getattr(T, name, None)
        if attr is not None and hasattr(attr, "__set__"):
            found.add(attr.__set__)
    found.update(getattr(T, name) for name in methods if hasattr(T, name))
    found.update(getattr(T, name) for name in ("new_empty", "new_zeros", "new_ones", "new_full") if hasattr(T, name))
    found.update((torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like,
                  torch.randn_like, torch._has_compatible_shallow_copy_type))
    return frozenset(found)


_METADATA = _metadata_functions()


def _released_info(t) -> Optional[tuple]:
    """(flow, unit, parameter) of a tensor whose weights are released now; None for any other."""
    info = getattr(t, _INFO, None) if isinstance(t, torch.Tensor) else None
    if info is None or info[1].resident:  # (a view taken while released is valid again once fetched)
        return None
    return info


def _released_torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    # (every tensor of the call: `torch.stack([p])` and the `_foreach_` ops take lists)
    released = None if func in _METADATA else next(
        (info for info in map(_released_info, tree_leaves((args, kwargs))) if info is not None), None)
    if released is None:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    info = _released_info(args[0]) if args else None
    T = torch.Tensor
    if info is not None:
        flow_ref, unit, param = info
        if func in (T.detach, T.data.__get__):  # a view of the released storage, released too
            with torch._C.DisableTorchFunctionSubclass():
                view = func(*args, **kwargs)
            view.__class__ = _released_class(torch.Tensor)
            setattr(view, _INFO, info)
            return view
        if func is T.copy_ and _released_info(args[1]) is None:
            flow = flow_ref()
            if flow is not None:
                flow.write(param, args[1])
                return args[0]
        if func == T.data.__set__ and args[1] is args[0]:  # (Module._apply after a no-op `to`)
            return None
        if func is T.to and _to_is_a_no_op(args[0], args[1:], kwargs):
            return args[0]
        if _returns_self(func, args, kwargs):  # (`model.float()` on an fp32 model, `p.contiguous()`)
            return args[0]
        if func in (T.__repr__, T.__format__, T.__str__):
            return f"<{_describe(param, unit)}, released by weight-flow: see model.state_dict()>"
    raise RuntimeError(_released_message(released, getattr(func, "__name__", str(func))))


_SAME_DTYPE = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
               torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.double: torch.float64}


def _returns_self(func, args, kwargs) -> bool:
    """A conversion torch answers with the tensor itself (no element read)."""
    if len(args) != 1 or kwargs:
        return False
    t = args[0]
    with torch._C.DisableTorchFunctionSubclass():
        if func in _SAME_DTYPE:
            return t.dtype == _SAME_DTYPE[func]
        if func is torch.Tensor.cpu:
            return t.device.type == "cpu"
        return func is torch.Tensor.contiguous and t.is_contiguous()


def _to_is_a_no_op(t: torch.Tensor, args, kwargs) -> bool:
    try:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    except (TypeError, RuntimeError):
        return False
    same_device = device is None or (torch.device(device).type == t.device.type
                                     and torch.device(device).index in (None, t.device.index))
    return same_device and dtype in (None, t.dtype) and memory_format is None and not kwargs.get("copy", False)


def _describe(param: torch.Tensor, unit: _Unit) -> str:
    with torch._C.DisableTorchFunctionSubclass():
        shape, dtype = tuple(param.shape), param.dtype
    return f"parameter of unit {unit.spec.name} (shape {shape}, {dtype})"


def _released_message(info: tuple, what: str) -> str:
    flow_ref, unit, param = info
    flow = flow_ref()
    name = flow.names.get(id(param), "") if flow is not None else ""
    return (
        f"`{what}` needs the elements of {name + ' ' if name else ''}({_describe(param, unit)}), which are not on the "
        "device now: under `weights: flow` a unit's weights are on the device only during its forward and "
        "backward and live on the host between them. Read them with `model.state_dict()` (host copies of the "
        "weights training uses" + (flow.read_hint if flow is not None else "")
        + "); write them with `model.load_state_dict(..., strict=False)` or `with torch.no_grad(): p.copy_(value)`, "
        "which land in the host copy; `weights: stationary` keeps every weight on the device.")


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
