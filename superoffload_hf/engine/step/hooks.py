"""Where the engine hooks into autograd and into module forwards: one small, named place.

* Per parameter, a post-accumulate-grad hook hands the final gradient of this backward to the
  engine, which keeps it or moves it into its own fp32 buffers and replaces `p.grad` by a
  `HeldGrad` placeholder. The next forward clears the placeholders (`release_held`); a backward
  that reaches a held parameter with no forward in between (retain_graph, several graphs kept)
  finds autograd adding into the placeholder, which then restarts `p.grad` from the new gradient
  alone (HeldGrad.__torch_dispatch__). No hook runs before accumulation: a Python hook per
  parameter inside backward costs several microseconds each.
* One global module forward pre-hook lets the next forward wait for exactly the buckets that
  the module about to run reads (its own parameters and those reads.py assigns it; the optimizer
  is given parameters, not the model, so it cannot register per-module hooks itself). It costs
  a compiling test, a set lookup and two attribute tests per module call while nothing is in
  flight; while dynamo traces it, it returns at once. On a module's first eager forward it also
  registers state-dict and load-state-dict pre-hooks on every module under it owning
  parameters, so `model.state_dict()` / `save_pretrained` / `load_state_dict()` between step()
  and the next forward read updated weights and write after the copy-backs. Reading or writing
  `p` directly (an EMA in a custom loop) needs `optimizer.synchronize()` first, and a write goes
  `with torch.no_grad(): p.copy_(...)` (a write through `p.data` escapes the race check).

The forward hook holds a small `ForwardGate` (the observer, the collector's placeholders, the
waiter) through a weak reference, the gradient hooks the collector: never the engine, and never
keeping an optimizer alive.

Which engine's hooks a parameter carries (so that a newer one takes it over) is engine/build.py's
`claim` / `owners_of`.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence

import torch

from superoffload_hf.engine.reads import ModuleReads

HELD_GRAD_MESSAGE = (
    "This parameter's gradient is held by the SuperOffload optimizer (it was moved into the "
    "optimizer's fp32 buffers during backward), so `p.grad` cannot be read or modified. Do not "
    "call torch.nn.utils.clip_grad_norm_ (or accelerator.clip_grad_norm_): pass "
    "`max_grad_norm` to the optimizer instead (it clips with the same semantics), and read the "
    "norm from `optimizer.last_grad_norm`. Under torch.distributed the optimizer averages the "
    "gradients over the ranks itself: do not wrap the model in DistributedDataParallel."
)


class HeldGrad(torch.Tensor):
    """A storage-less stand-in for a gradient the optimizer holds: any use of it raises."""

    @staticmethod
    def __new__(cls, like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device,
                                                   requires_grad=False)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _ACCUMULATE and not kwargs and len(args) == 2:
            restarted = _restart_accumulation(func, args[0], args[1])
            if restarted is not None:
                return restarted
        raise RuntimeError(f"{HELD_GRAD_MESSAGE} (attempted: {func})")

    def __repr__(self) -> str:
        return f"HeldGrad(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


_ACCUMULATE = (torch.ops.aten.add_.Tensor, torch.ops.aten.add.Tensor)


def _restart_accumulation(func, held: HeldGrad, new_grad: torch.Tensor) -> Optional[torch.Tensor]:
    """Autograd's AccumulateGrad adding `new_grad` into this parameter's placeholder: the held
    gradient is the optimizer's already, so `p.grad` becomes the new gradient alone (a copy: the
    one autograd passes may be shared). Only for AccumulateGrad of the parameter `held` stands
    in for; any other use raises. AccumulateGrad adds in place (`p.grad += new`: the new tensor
    goes into the `.grad` slot it reads back) or, building a graph, out of place (returned)."""
    param = getattr(torch._C._current_autograd_node(), "variable", None)
    if param is None or param.grad is not held:
        return None
    fresh = new_grad.clone()
    if func is torch.ops.aten.add_.Tensor:
        param.grad = fresh
        return held  # (ignored: an in-place op returns its first argument)
    return fresh


def _deliver(collector_ref: "weakref.ref", index: int) -> Callable:
    def on_accumulated(p: torch.Tensor) -> None:
        c = collector_ref()
        if c is not None:
            c.on_grad(index, p)

    return on_accumulated


def register_param_hooks(params: Sequence[torch.Tensor], collector, index_of: dict, handles: list) -> list[torch.Tensor]:
    """Hook every parameter that requires grad; return those that could not be hooked. The
    post-accumulate hook of parameter i (`index_of[p]`) calls `collector.on_grad(i, p)`."""
    collector_ref = weakref.ref(collector)
    unhooked = []
    for p in params:
        if not p.requires_grad:
            unhooked.append(p)
            continue
        handles.append(p.register_post_accumulate_grad_hook(_deliver(collector_ref, index_of[p])))
    return unhooked


class ForwardGate:
    """What a module's forward (and a module's state-dict hooks) needs of the engine: open the
    step's observation, release the placeholders of the last backward, wait for the buckets
    it reads."""

    def __init__(self, observer, collector, waiter):
        self.observer, self.collector, self.waiter = observer, collector, waiter

    @property
    def inflight(self) -> set:
        return self.waiter.inflight

    def before_forward(self) -> None:
        if not self.observer.open:
            self.observer.open_step()
        if self.collector.held_out:
            self.collector.release_held()  # this forward's backward accumulates into fresh gradients


def register_forward_wait(gate: ForwardGate, reads: ModuleReads, handles: list) -> None:
    """Before a module's forward: wait for the buckets its forward reads (`reads`, which also
    learns here which modules run eagerly). Before `state_dict()` (model.state_dict(),
    save_pretrained, accelerate's get_state_dict) and `load_state_dict()` of a module owning
    parameters: wait for the buckets of its parameters. Those two hooks are registered, at the
    first eager forward of a module, on every module under it (the modules of a compiled region
    never run their forward hooks)."""
    gate_ref = weakref.ref(gate)
    is_compiling = torch.compiler.is_compiling
    hooked: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

    def wait_for_own(module: torch.nn.Module) -> None:
        g = gate_ref()
        if g is not None and g.inflight:
            g.waiter.wait_for_params(module._parameters.values())

    def before_state_dict(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        wait_for_own(module)

    def before_load_state_dict(module: torch.nn.Module, *args) -> None:
        wait_for_own(module)  # the load writes the parameters in stream order after the copy-back

    def hook_state_dicts(root: torch.nn.Module) -> None:
        for module in root.modules():
            if module not in hooked:
                hooked.add(module)
                if reads.own(module):
                    handles.append(module.register_state_dict_pre_hook(before_state_dict))
                    handles.append(module.register_load_state_dict_pre_hook(before_load_state_dict))

    def before_forward(module: torch.nn.Module, args) -> None:
        if is_compiling():  # dynamo traces this hook: a compiled graph has no waits (reads.py)
            return None
        g = gate_ref()
        if g is None:
            return None
        g.before_forward()
        if module not in reads.eager:
            reads.eager.add(module)
            hook_state_dicts(module)
        if g.inflight:
            g.waiter.wait_for_module(module)
        return None

    handles.append(torch.nn.modules.module.register_module_forward_pre_hook(before_forward))


def remove_handles(handles: list) -> None:
    while handles:
        handles.pop().remove()
