"""SuperOffload in Accelerate: the plugin, the optimizer wrapper, and `prepare` for custom loops.

Accelerate wraps every optimizer in an `AcceleratedOptimizer`. Three of its defaults are wrong
for an optimizer whose state lives on the host, and this module is the one place that changes
them:

- device placement: the stock wrapper round-trips the optimizer state through the device
  (`state_dict()` -> `.to(device)` -> `load_state_dict`), a full copy of the fp32 host state
  into device memory. `SuperOffloadAcceleratedOptimizer` never places the state.
- skipped steps: the stock wrapper reports a skipped step only when a GradScaler skipped it.
  Ours reports `optimizer.last_step_skipped`, so schedulers do not advance after a step the
  optimizer skipped (non-finite gradients).
- fp16: Accelerate's GradScaler would unscale `p.grad` and step the optimizer itself. The
  optimizer owns fp16 loss scaling, so `SuperOffloadLossScaler` replaces `accelerator.scaler`:
  `accelerator.backward` then scales the loss with `optimizer.scale_loss` and nothing else.

Custom Accelerate loop::

    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4)
    plugin = SuperOffloadPlugin(speculation="auto")
    model.to(accelerator.device)
    optimizer = plugin.create_optimizer(accelerator, model, lr=3e-4, weight_decay=0.1,
                                        max_grad_norm=1.0)   # decay / no-decay groups by name
    scheduler = get_cosine_schedule_with_warmup(optimizer, 100, 10_000)
    model, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()         # clipping happens inside; do not call clip_grad_norm_
            scheduler.step()         # skipped steps do not advance it (AcceleratedScheduler)
            optimizer.zero_grad()
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.optimizer import SuperOffloadAdamW

# Accelerate's `mixed_precision` -> the device dtype that matches it when the config is silent.
# "no" means the user asked for full precision, so the device computes in fp32.
DEVICE_DTYPE_FOR_MIXED_PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}

REFUSED_DISTRIBUTED_TYPES = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
    DistributedType.MEGATRON_LM: "Megatron-LM",
    DistributedType.XLA: "XLA",
}


# ---- precision ---------------------------------------------------------------------------------


def resolve_device_dtype(requested: Optional[str], mixed_precision: Optional[str]) -> str:
    """The device dtype for a run: the config's, or the one matching Accelerate's mixed precision."""
    mixed_precision = str(mixed_precision or "no")
    if mixed_precision not in DEVICE_DTYPE_FOR_MIXED_PRECISION:
        raise ConfigError(
            f"Accelerate mixed_precision is {mixed_precision!r}; superoffload supports "
            f"{sorted(DEVICE_DTYPE_FOR_MIXED_PRECISION)}. Use bf16 instead."
        )
    matching = DEVICE_DTYPE_FOR_MIXED_PRECISION[mixed_precision]
    if requested is None:
        return matching
    if mixed_precision != "no" and requested != "fp32" and requested != matching:
        raise ConfigError(
            f"superoffload `device_dtype` is {requested!r} but mixed precision is {mixed_precision!r}: "
            f"autocast to {mixed_precision} over {requested} weights is not supported. Set "
            f"`device_dtype: {matching}` or drop it from the superoffload config."
        )
    return requested


# ---- the plugin --------------------------------------------------------------------------------


class _PluginMethods:
    """Methods of SuperOffloadPlugin (its fields are generated from SuperOffloadConfig)."""

    def __post_init__(self) -> None:
        SuperOffloadConfig.from_dict(self.explicit_fields())  # validate now, with the config's errors

    @classmethod
    def from_dict(cls, values: Optional[Mapping[str, Any]]) -> "SuperOffloadPlugin":
        SuperOffloadConfig.from_dict(values)  # unknown keys fail here, naming the valid ones
        return cls(**dict(values or {}))

    @classmethod
    def from_value(cls, value: Any) -> "SuperOffloadPlugin":
        """A plugin from None, a plugin, a SuperOffloadConfig, a dict of fields or a YAML/JSON path."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, SuperOffloadConfig):
            return cls(**value.to_dict())
        if isinstance(value, (str, Path)):
            return cls.from_dict(_read_mapping(value))
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ConfigError(
            f"Cannot make a superoffload config from {type(value).__name__}; pass a dict of "
            "SuperOffloadConfig fields, a path to a YAML/JSON file, or a SuperOffloadConfig."
        )

    def explicit_fields(self) -> dict[str, Any]:
        """The fields the user set (None means: the SuperOffloadConfig default)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to_config(self, mixed_precision: Optional[str] = None) -> SuperOffloadConfig:
        """The SuperOffloadConfig for a run whose Accelerate mixed precision is `mixed_precision`."""
        values = self.explicit_fields()
        values["device_dtype"] = resolve_device_dtype(values.get("device_dtype"), mixed_precision)
        return SuperOffloadConfig.from_dict(values)

    def create_optimizer(self, accelerator: Accelerator, model: torch.nn.Module, *,
                         no_decay: Iterable[str] = ("bias", "norm"), **optimizer_kwargs: Any):
        """A SuperOffloadAdamW over `model` (already on `accelerator.device`), with the device
        dtype following `accelerator.mixed_precision`. Parameters whose name contains one of
        `no_decay` get weight_decay 0; `optimizer_kwargs` (lr, betas, eps, weight_decay,
        max_grad_norm) go to SuperOffloadAdamW."""
        check_accelerator_supported(accelerator)
        check_model_on_device(model, accelerator.device)
        no_decay = tuple(no_decay)
        groups = decay_param_groups(model, lambda name: any(part in name for part in no_decay))
        config = self.to_config(accelerator.mixed_precision)
        return SuperOffloadAdamW(groups, config=config, model=model, **optimizer_kwargs)


def _plugin_fields() -> list[tuple[str, Any, Any]]:
    return [(f.name, Optional[Any], dataclasses.field(default=None)) for f in fields(SuperOffloadConfig)]


SuperOffloadPlugin = dataclasses.make_dataclass(
    "SuperOffloadPlugin", _plugin_fields(), bases=(_PluginMethods,), namespace={"__module__": __name__}
)
SuperOffloadPlugin.__doc__ = """SuperOffload settings for an Accelerate run (a dataclass).

One field per `SuperOffloadConfig` field, same name, documented there (the one home of defaults).
A field left at None takes the config's default, except `device_dtype`, which then follows the
Accelerator's mixed precision: "bf16" -> bf16, "fp16" -> fp16, "no" -> fp32.

    plugin = SuperOffloadPlugin(speculation="off", host_threads=16)
    plugin = SuperOffloadPlugin.from_value("superoffload.yaml")
"""


def _read_mapping(path: Union[str, Path]) -> dict[str, Any]:
    """The raw mapping in a superoffload YAML/JSON file (validated by SuperOffloadConfig first)."""
    from superoffload_hf.yaml12 import load_yaml  # YAML 1.2: `speculation: off` is a string

    SuperOffloadConfig.from_file(path)  # file, suffix and key errors, with the config's messages
    text = Path(path).read_text()
    return (json.loads(text) if Path(path).suffix == ".json" else load_yaml(text)) or {}


# ---- checks ------------------------------------------------------------------------------------


def check_accelerator_supported(accelerator: Accelerator) -> None:
    resolve_device_dtype(None, accelerator.mixed_precision)  # fp8 and unknown modes fail here
    refused = REFUSED_DISTRIBUTED_TYPES.get(accelerator.distributed_type)
    if refused is not None:
        raise ValueError(
            f"superoffload cannot be combined with {refused} (Accelerate distributed_type "
            f"{accelerator.distributed_type}): both own the optimizer state. Use one of them: drop "
            f"the {refused} settings, or turn superoffload off."
        )


def keep_model_unwrapped(accelerator: Accelerator) -> None:
    """With several processes (MULTI_GPU, MULTI_CPU) `accelerator.prepare` wraps the model in
    DistributedDataParallel; the SuperOffload optimizer averages the gradients over the ranks
    itself, and DDP would all-reduce gradients it has already taken. So this accelerator prepares
    models as Accelerate prepares them for evaluation (device placement, mixed precision,
    torch.compile; no DDP wrap), and does not place a model already on `accelerator.device`. The
    one place this integration changes Accelerate's behaviour for the model."""
    if getattr(accelerator, "_superoffload_keeps_model_unwrapped", False):
        return
    prepare_model = vars(accelerator).get("prepare_model")  # already replaced on the instance: wrap that
    if prepare_model is None:
        # the class's method through a weak reference: the accelerator's own bound method stored
        # on it would be a reference cycle, keeping a dropped accelerator's optimizer alive until gc
        unbound, accelerator_ref = type(accelerator).prepare_model, weakref.ref(accelerator)

        def prepare_model(*args, **kwargs):
            return unbound(accelerator_ref(), *args, **kwargs)

    device = accelerator.device  # (fixed for the accelerator's life)

    def prepare_model_without_ddp(model, device_placement=None, evaluation_mode=False):
        if all(on_device(p, device) for p in model.parameters()):
            # Accelerate's `model.to(device)` copies every parameter on the CPU when the device is
            # "cpu:0" (several processes, gloo): a copy of a weight-flow parameter whose storage
            # is released (resized to 0) reads no memory and crashes the process
            device_placement = False
        return prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    accelerator.prepare_model = prepare_model_without_ddp
    accelerator._superoffload_keeps_model_unwrapped = True


def on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """`tensor` is on `device` ("cpu" and "cpu:0" are the same place)."""
    device = torch.device(device)
    same_index = device.index is None or tensor.device.index in (None, device.index)
    return tensor.device.type == device.type and same_index


def check_model_on_device(model: torch.nn.Module, device: torch.device) -> None:
    for name, param in model.named_parameters():
        if not on_device(param, device):
            raise ValueError(
                f"Parameter `{name}` is on {param.device}, expected {device}: move the model to "
                "`accelerator.device` before creating the SuperOffload optimizer."
            )


def check_superoffload_optimizer(optimizer: Any) -> None:
    if not hasattr(optimizer, "set_gradient_sync_source") or not hasattr(optimizer, "last_step_skipped"):
        raise TypeError(
            f"Expected a SuperOffloadAdamW / SuperOffloadAdam, got {type(optimizer).__name__}. Build it "
            "with `SuperOffloadPlugin.create_optimizer` or `superoffload_hf.SuperOffloadAdamW`."
        )


def decay_param_groups(model: torch.nn.Module, is_no_decay: Callable[[str], bool],
                       weight_decay: Optional[float] = None) -> list[dict[str, Any]]:
    """Trainable parameters in a decay group (`weight_decay`, or the optimizer's when None) and a
    no-decay group (weight_decay 0); empty groups are dropped."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = {"params": [p for n, p in trainable if not is_no_decay(n)]}
    if weight_decay is not None:
        decay["weight_decay"] = weight_decay
    no_decay = {"params": [p for n, p in trainable if is_no_decay(n)], "weight_decay": 0.0}
    return [group for group in (decay, no_decay) if group["params"]]


# ---- the Accelerate-facing pieces -----------------------------------------------------------------


class SuperOffloadAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, minus device placement, plus the optimizer's skipped steps.

    `step()` still forwards only when `gradient_state.sync_gradients` is true, so the
    SuperOffload optimizer steps exactly once per accumulation step.
    """

    # Accelerate's "already prepared" marker: `Accelerator.prepare` registers this wrapper as is
    # instead of wrapping it again in a stock AcceleratedOptimizer (which would place the state).
    _is_accelerate_prepared = True

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer, device_placement=False, scaler=None)

    @property
    def step_was_skipped(self) -> bool:
        return bool(self.optimizer.last_step_skipped)

    # What users hold is this wrapper (`trainer.optimizer`, `prepare`'s result): the SuperOffload
    # read-outs answer here too, from the optimizer inside.
    @property
    def plan(self):
        return self.optimizer.plan

    @property
    def counters(self):
        return self.optimizer.counters

    @property
    def host_adam(self):
        return self.optimizer.host_adam

    @property
    def last_step_skipped(self) -> bool:
        return self.optimizer.last_step_skipped

    @property
    def last_grad_norm(self) -> Optional[float]:
        return self.optimizer.last_grad_norm

    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scale

    def describe(self) -> str:
        return self.optimizer.describe()

    def summary(self) -> str:
        return self.optimizer.summary()

    def synchronize(self) -> None:
        self.optimizer.synchronize()


class SuperOffloadLossScaler:
    """Takes the place of `accelerator.scaler` when the device computes in fp16.

    `Accelerator.backward` calls `scale(loss)`; the optimizer multiplies the loss by its dynamic
    loss scale, and unscales, checks and skips inside `step()`. The loss scale is part of the
    optimizer's state_dict, so this object's own state is empty.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """No-op: the optimizer unscales the gradients it has staged."""

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        """No-op: the optimizer updates its loss scale in `step()`."""

    def get_scale(self) -> float:
        return float(self.optimizer.loss_scale)

    def is_enabled(self) -> bool:
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """No-op: the loss scale is restored with the optimizer's state_dict."""


def wrap_optimizer(accelerator: Accelerator, optimizer: torch.optim.Optimizer,
                   device_dtype: Optional[str] = None) -> SuperOffloadAcceleratedOptimizer:
    """Connect a SuperOffload optimizer to `accelerator`: accumulation boundaries, fp16 loss
    scaling, no device placement. Returns the wrapper to hand to `accelerator.prepare`.

    `device_dtype`: the optimizer's device dtype; None reads it from `optimizer.config`."""
    check_superoffload_optimizer(optimizer)
    keep_model_unwrapped(accelerator)
    # The optimizer reads the accumulation boundary while backward runs: Accelerate (or the
    # Trainer, which sets it per micro-batch) has set sync_gradients before the backward starts.
    # (the accelerator's gradient state, not the accelerator: that holds the optimizer, a cycle)
    gradient_state = accelerator.gradient_state
    optimizer.set_gradient_sync_source(lambda: gradient_state.sync_gradients)
    if (device_dtype or optimizer_device_dtype(optimizer)) == "fp16":
        accelerator.scaler = SuperOffloadLossScaler(optimizer)
    return SuperOffloadAcceleratedOptimizer(optimizer)


def optimizer_device_dtype(optimizer: torch.optim.Optimizer) -> str:
    config = getattr(optimizer, "config", None)
    if not isinstance(config, SuperOffloadConfig):
        raise TypeError(
            f"{type(optimizer).__name__} has no `config` (a SuperOffloadConfig); pass `device_dtype` "
            "to wrap_optimizer explicitly."
        )
    return config.device_dtype


def prepare(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *others: Any):
    """`accelerator.prepare(model, optimizer, *others)` for a SuperOffload optimizer.

    Returns the prepared objects in the order given. The optimizer state stays on the host; the
    optimizer learns the accumulation boundary from `accelerator.sync_gradients`; with fp16 the
    optimizer's loss scaling replaces Accelerate's GradScaler.
    """
    check_accelerator_supported(accelerator)
    wrapper = wrap_optimizer(accelerator, optimizer)
    prepared = accelerator.prepare(model, wrapper, *others)
    if prepared[1] is not wrapper:
        raise RuntimeError(
            "accelerate wrapped the SuperOffload optimizer again instead of keeping its wrapper "
            f"(accelerate {_accelerate_version()}): the `_is_accelerate_prepared` marker this "
            "integration relies on has changed. Please report this with your accelerate version."
        )
    return prepared


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__
