"""SuperOffloadAdamW / SuperOffloadAdam: the torch.optim.Optimizer facade over the engine.

    opt = SuperOffloadAdamW(model.parameters(), lr=1e-4, max_grad_norm=1.0,
                            config={"device_dtype": "bf16"})
    for batch in data:
        loss = model(**batch).loss
        loss.backward()        # gradients leave for the host as each bucket completes
        opt.step()             # validate (global norm), commit / clip / skip
        opt.zero_grad()

Clipping is the optimizer's job: pass `max_grad_norm` (settable at any time) and do not call
`torch.nn.utils.clip_grad_norm_`; after backward the gradients live in the optimizer and
touching `p.grad` raises a RuntimeError saying so. Read the norm from `last_grad_norm` and
whether the step was skipped (non-finite gradients) from `last_step_skipped`.

After step() the parameters hold the new weights (on the CPU device at once; on CUDA in stream
order: the next forward waits for exactly the buckets it reads, and `synchronize()` or any
state-exposing method waits for all). `zero_grad(set_to_none=False)` behaves like
`set_to_none=True` for managed parameters: their gradients are held by the optimizer, so there
is no gradient tensor to fill with zeros.

The rest of torch.optim's contract holds as docs/trainer.md "The torch.optim contract" states:
`optimizer.state[p]` is read-only fp32 copies of the step and moments (a rank's shard under data
parallelism), state-dict hooks run, `copy.deepcopy` works. A new optimizer built on parameters
another open one manages takes them over: it closes the older one, with a warning.
"""

from __future__ import annotations

import copy
import math
import weakref
from typing import Any, Callable, Mapping, Optional, Union

import torch

from superoffload_hf.config import SuperOffloadConfig
from superoffload_hf.engine.build import build_engine
from superoffload_hf.engine.core import Engine
from superoffload_hf.metrics import OffloadCounters
from superoffload_hf.plan.buckets import BucketPlan

ConfigLike = Union[SuperOffloadConfig, Mapping[str, Any], str, None]


class _SuperOffloadOptimizer(torch.optim.Optimizer):
    _adamw: bool = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, max_grad_norm: Optional[float] = None,
                 config: ConfigLike = None, process_group=None, model: Optional[torch.nn.Module] = None,
                 *, amsgrad: bool = False, maximize: bool = False):
        _check_hyper(lr, betas, eps, weight_decay)
        _check_unsupported({"amsgrad": amsgrad, "maximize": maximize}, "")
        self._constructing = True
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._constructing = False
        for index, group in enumerate(self.param_groups):
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            _check_unsupported(group, f" (param group {index})")
            group["betas"] = tuple(group["betas"])
        self.config = SuperOffloadConfig.coerce(config)
        self.max_grad_norm = max_grad_norm
        self.counters = OffloadCounters()
        self.last_grad_norm: Optional[float] = None
        self.last_step_skipped = False
        # `model`: what weight-flow hooks (config `weights`: its units are the model's blocks)
        self._engine = build_engine(self.param_groups, self._adamw, self.config, self.counters, process_group, model=model)
        self._engine.max_grad_norm = self._max_grad_norm
        self._finalizer = weakref.finalize(self, self._engine.close)
        self.state = self._engine.state_view()  # (torch.optim's dict: read-only copies here)

    # ---- torch.optim.Optimizer ------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_constructing", False):
            raise NotImplementedError(
                "SuperOffload optimizers plan their buffers at construction; add_param_group() after "
                "that is not supported. Pass every param group to the constructor."
            )
        super().add_param_group(param_group)  # warns (as torch does) on a parameter repeated in the group
        group = self.param_groups[-1]
        firsts = {id(p): i for i, p in reversed(list(enumerate(group["params"])))}
        if len(firsts) != len(group["params"]):  # managed once, at its first place
            keep = sorted(firsts.values())
            group["params"] = [group["params"][i] for i in keep]
            if "param_names" in group:
                group["param_names"] = [group["param_names"][i] for i in keep]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        decision = self._open_engine().step(self.max_grad_norm)
        self.last_grad_norm = decision.grad_norm
        self.last_step_skipped = decision.kind == "skip"
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Release the gradients (see the module docstring for set_to_none=False). Called
        between backward and step(), it discards the accumulated gradients, as in torch."""
        self._check_not_superseded()  # the parameters' gradients are the newer optimizer's
        self._engine.discard_gradients()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self) -> dict:
        """torch.optim's layout (see superoffload_hf.engine.checkpoint). As in torch.optim, the
        state tensors reference the live state (views of the host buffers, no copy): they change
        as training goes on, and writing into them changes the optimizer. `copy.deepcopy` it to
        keep a snapshot in memory; `torch.save` it to keep one on disk. The hooks registered with
        `register_state_dict_pre_hook` / `_post_hook` run as in torch.optim."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._open_engine().state_dict(self.param_groups)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            replaced = post_hook(self, state_dict)
            if replaced is not None:
                state_dict = replaced
        return state_dict

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Any saved layout: a single-process state dict, or every rank's shard state dicts (a
        list, e.g. `superoffload_hf.engine.dp.checkpoint.read_shards(dir)`) saved by any number
        of ranks; under data parallelism each rank reads only its own ranges. The hooks registered
        with `register_load_state_dict_pre_hook` / `_post_hook` run as in torch.optim (the pre-hooks
        get a shallow copy of `state_dict`)."""
        engine = self._open_engine()
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            replaced = pre_hook(self, state_dict)
            if replaced is not None:
                state_dict = replaced
        engine.load_state_dict(self.param_groups, state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # ---- data parallelism -----------------------------------------------------------------

    @property
    def is_sharded(self) -> bool:
        """Whether this optimizer shards its state over ranks (torch.distributed, world > 1):
        `state_dict()` is then this rank's shard (engine/dp/checkpoint.py)."""
        return not self._engine.route.alone

    def before_collective(self) -> None:
        """Call before a collective of your own on another process group after step(), ahead of
        the next backward (sequence parallelism's all-to-alls in the forward: SequenceParallel
        does): returns once the host worker has issued every weight all-gather step() queued, so
        that every rank issues the two threads' collectives in one order (NCCL requires it
        across communicators; engine/dp/route.py). step() now returns only after that (the Trainer's
        own collectives after it need nothing), so after step() this returns at once; kept for
        callers that call it before their collectives on another group (SequenceParallel does).
        Nothing to do in one process."""
        self._engine.route.wait_for_queued_gathers()

    def save_sharded(self, directory: str) -> list[str]:
        """Every rank writes its shard to `directory` (optimizer.shard-RRRRR-of-NNNNN.pt; no rank
        gathers the state); after all have, rank 0 writes `optimizer.pt`, a small index, so its
        presence means the set is complete. Call on every rank. One process: optimizer.pt is the
        whole state dict. Returns the files written here."""
        return self._engine.route.save(directory, self.state_dict)

    @staticmethod
    def read_state(directory: str) -> Any:
        """What `save_sharded` (or a single-process save) left in `directory`, for
        `load_state_dict` on any number of ranks (memory-mapped: each rank reads its ranges)."""
        from superoffload_hf.engine.dp.checkpoint import read_saved

        return read_saved(directory)

    # ---- SuperOffload ---------------------------------------------------------------------

    @property
    def max_grad_norm(self) -> Optional[float]:
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Optional[float]) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0 or math.isnan(value)):
            raise ValueError(f"`max_grad_norm` is {value!r}; expected None (no clipping) or a number > 0.")
        self._max_grad_norm = None if value is None else float(value)
        if hasattr(self, "_engine"):
            self._engine.max_grad_norm = self._max_grad_norm  # read during backward

    @property
    def plan(self) -> BucketPlan:
        return self._engine.plan

    @property
    def ledger(self):
        """The buffers this optimizer holds now, per kind and place (`ledger.bytes(place, kind)`);
        0 once it is closed or dropped (keep the ledger to check that, e.g. between runs)."""
        return self._engine.buckets.ledger

    @property
    def host_adam(self):
        """The host Adam back end in use: `.name` ("cpp" or "reference"), `.isa`, `.threads`."""
        return self._engine.adam

    @property
    def host_is_device(self) -> bool:
        """True when the CPU is the device: host jobs run inline, between backward's kernels, so
        no host step overlaps the device's work (the `superoffload/overlap` log is left out)."""
        return self._engine.runtime.host_is_device

    def host_state(self) -> str:
        """The host buckets' state precision and the bytes per parameter the Ledger holds for it,
        e.g. "compact 5.184 B/param" (config `state_precision`)."""
        return self._engine.state_note()

    def device_memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory now (the runtime's `memory_info()`)."""
        return self._engine.runtime.memory_info()

    def device_memory_peak(self) -> Optional[int]:
        """Peak device bytes allocated (the runtime's `max_memory_allocated()`: torch's on an
        accelerator, the simulated device's budget accounting on it), None on the CPU device."""
        return self._engine.runtime.max_memory_allocated()

    def describe(self) -> str:
        """One line: buckets, device dtype, cast, speculation, rollback, host Adam back end/ISA/threads."""
        return self._engine.summary()

    @property
    def loss_scale(self) -> float:
        return float(self._engine.loss_scale.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """fp16: the loss times the dynamic loss scale (call backward on this); else the loss."""
        scale = self._engine.loss_scale.scale
        return loss if scale == 1.0 else loss * scale

    def set_gradient_sync_source(self, fn: Optional[Callable[[], bool]]) -> None:
        """fn() is True while the backward of the last micro-batch of a step runs (Accelerate's
        `sync_gradients`); None: count `gradient_accumulation_steps` micro-batches."""
        if fn is not None and not callable(fn):
            raise TypeError(f"`fn` must be callable or None, got {type(fn).__name__}.")
        self._engine.sync_source = fn

    def summary(self) -> str:
        """One line: buckets, device buckets, cast, speculation, host back end/ISA/threads."""
        return self._engine.summary()

    def synchronize(self) -> None:
        """Wait until every host update has reached the device parameters."""
        self._engine.synchronize()

    def fetch_weights(self) -> None:
        """Weight-flow (config `weights`), before saving from rank 0 alone: under data
        parallelism every rank calls this together; the flowing weights are gathered (unit by
        unit, onto rank 0's host), so that rank 0's `model.state_dict()` then needs no other
        rank (the other ranks' state_dict() refuses until the next forward or step). In one
        process, or with stationary weights, nothing to do: the state dict reads the host copies."""
        if self._engine.flow is not None and not self._engine.closed:  # (closed: the weights are back)
            self._engine.flow.prepare_state_dict()

    def write_timeline(self) -> dict:
        """Write the step timeline now, if the config asks for one (`timeline_dir`): trace.json
        and timeline.png there. Also done by close() and, under the Trainer, at the end of
        training. Returns the paths written ({} when no timeline is recorded)."""
        return self._engine.write_timeline()

    def close(self) -> None:
        """Stop the host worker, remove the hooks and free the optimizer's buffers (also done
        when the optimizer is dropped). Take `state_dict()` before closing to keep the state."""
        self._finalizer()

    def _open_engine(self) -> Engine:
        self._check_not_superseded()
        if self._engine.closed:
            raise RuntimeError("This SuperOffload optimizer was closed (close(), or the `with` block ended): its "
                               "state is freed. Build a new optimizer (load a state_dict taken before close()).")
        return self._engine

    def _check_not_superseded(self) -> None:
        if self._engine.superseded:
            raise RuntimeError("This SuperOffload optimizer's parameters were taken over by a newer SuperOffload "
                               "optimizer built on them, which closed this one (hooks removed, state freed). "
                               "Step the newer optimizer; to keep training with this one's state, load a "
                               "state_dict taken before the newer one was built into it.")

    def __deepcopy__(self, memo: dict) -> "_SuperOffloadOptimizer":
        """An independent optimizer over deep copies of the parameters (shared with a model
        copied in the same `deepcopy` call, through `memo`), with this one's state, settings,
        counters and torch.optim hooks."""
        engine = self._open_engine()
        if not engine.route.alone or engine.flow is not None:
            raise RuntimeError(
                "copy.deepcopy of a SuperOffload optimizer is not supported under "
                + ("data parallelism (building the copy is a collective)" if not engine.route.alone else
                   "weight-flow (the flowing parameters hold no weights on the device)")
                + ": build a new optimizer on the copied model and load this one's state_dict() into it.")
        if engine.has_pending_gradients():
            raise RuntimeError("copy.deepcopy of a SuperOffload optimizer between backward and step(): its gradients "
                               "are held in its buffers and would not be copied. Copy it after step() or zero_grad().")
        engine.collector.release_held()  # (placeholders of gradients already stepped: a plain tensor copies .grad)
        state = self.state_dict()
        groups = copy.deepcopy(self.param_groups, memo)
        defaults = {k: v for k, v in self.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")}
        twin = type(self)(groups, **defaults, max_grad_norm=self.max_grad_norm, config=copy.deepcopy(self.config, memo))
        memo[id(self)] = twin
        twin.load_state_dict(state)  # (copies: the twin's buffers are its own)
        twin.counters.load_dict(self.counters.as_dict())
        twin.last_grad_norm, twin.last_step_skipped = self.last_grad_norm, self.last_step_skipped
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(twin, name, copy.copy(getattr(self, name)))
        return twin

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SuperOffloadAdamW(_SuperOffloadOptimizer):
    """AdamW (decoupled weight decay, torch.optim.AdamW's math) with offloaded state."""

    _adamw = True


class SuperOffloadAdam(_SuperOffloadOptimizer):
    """Adam with L2 weight decay (torch.optim.Adam's math) with offloaded state."""

    _adamw = False

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: Optional[float] = None,
                 config: ConfigLike = None, process_group=None, model: Optional[torch.nn.Module] = None,
                 *, amsgrad: bool = False, maximize: bool = False):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         max_grad_norm=max_grad_norm, config=config, process_group=process_group, model=model,
                         amsgrad=amsgrad, maximize=maximize)


def _check_unsupported(options: Mapping[str, Any], where: str) -> None:
    """torch.optim.Adam(W) options this optimizer does not implement: refused when asked for."""
    for name, instead in (("amsgrad", "use torch.optim.AdamW(amsgrad=True) for AMSGrad"),
                          ("maximize", "minimize the negated objective instead")):
        if options.get(name, False):
            raise ValueError(f"`{name}` is {options[name]!r}{where}; SuperOffload optimizers support only "
                             f"{name}=False: {instead}.")


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"`lr` is a tensor of {lr.numel()} elements; a Tensor lr must be 1-element.")
    if len(tuple(betas)) == 2 and sum(isinstance(b, torch.Tensor) for b in betas) == 1:
        raise ValueError(f"`betas` is {betas!r}; betas must be either both floats or both Tensors (as in torch.optim).")
    if not float(lr) >= 0.0:
        raise ValueError(f"`lr` is {lr!r}; expected a number >= 0.")
    if len(tuple(betas)) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"`betas` is {betas!r}; expected two numbers in [0, 1).")
    if not float(eps) >= 0.0:
        raise ValueError(f"`eps` is {eps!r}; expected a number >= 0.")
    if not float(weight_decay) >= 0.0:
        raise ValueError(f"`weight_decay` is {weight_decay!r}; expected a number >= 0.")
