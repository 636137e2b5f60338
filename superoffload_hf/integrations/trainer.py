"""`TrainingArguments` and `Trainer` with superoffload, and the hooks they share with the launcher.

With `superoffload=True` these Trainer methods change, and nothing else:

- `create_optimizer`: builds `SuperOffloadAdamW` from the usual decay / no-decay groups, lr,
  betas, eps and weight decay, hands it `max_grad_norm`, and wraps it for Accelerate (no state
  placement on the device, skipped steps reported, fp16 loss scaling by the optimizer).
- `_clip_grad_norm`: does not touch the gradients (the optimizer clips inside `step()`).
- `_get_grad_norm`: returns a placeholder that `SuperOffloadCallback` fills with the
  optimizer's `last_grad_norm` right after the step, before the Trainer logs it.
- `save_model` (on every rank): under weight-flow the weights are fetched first (under data
  parallelism an all-gather every rank joins), then the main process writes them.
- `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler`: each rank its shard.

With `sequence_parallel_size` N > 1 (the argument or the config's key) the train dataloader
and `compute_loss` change too: each SP group of N ranks shares a batch and each rank computes
the loss on its part of every sequence (`trainer_sequence_parallel.py`).

With superoffload on or off, a checkpoint save that fails (a full disk, Ctrl-C) leaves the
previous checkpoints as they were and says so (`checkpoint_save.py`).

`SuperOffloadHooks` implements them; the `Trainer` subclass here calls them, and the
launcher's autopatch (`autopatch.py`) binds them onto a stock `transformers.Trainer`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from transformers import Trainer as HFTrainer
from transformers import TrainingArguments as HFTrainingArguments

from superoffload_hf.integrations.accelerate import SuperOffloadPlugin
from superoffload_hf.integrations.checkpoint_save import save_checkpoint_keeping_previous
from superoffload_hf.integrations.launch_env import launch_plugin
from superoffload_hf.integrations.trainer_hooks import (
    _HF_DEFAULT_OPTIM,
    _REPLACEABLE_OPTIMS,
    OPTIM_SYNONYM,
    SuperOffloadHooks,
    _optim_name,
)

logger = logging.getLogger(__name__)

@dataclass
class TrainingArguments(HFTrainingArguments):
    """transformers.TrainingArguments plus `superoffload`, `superoffload_config` and `sequence_parallel_size`.

    Device dtype: the config's `device_dtype` when it sets one; otherwise bf16=True -> "bf16",
    fp16=True -> "fp16", neither -> "fp32" (full precision, as asked).
    """

    # Redeclared as a plain string so that HfArgumentParser accepts `--optim superoffload_adamw`
    # (the parent's enum type would restrict the choices); validated in __post_init__.
    optim: str = field(
        default=_HF_DEFAULT_OPTIM,
        metadata={"help": "The optimizer to use (see `OptimizerNames`), or `superoffload_adamw`, "
                          "a synonym for `--superoffload`."},
    )
    superoffload: bool = field(
        default=False,
        metadata={"help": "Train with SuperOffloadAdamW: fp32 master weights and Adam state on the "
                          "host, host Adam steps overlapped with backward."},
    )
    superoffload_config: Optional[Union[dict, str]] = field(
        default=None,
        metadata={"help": "SuperOffloadConfig fields: a path to a YAML/JSON file, a JSON string, or "
                          "a dict. Setting it turns `superoffload` on."},
    )
    sequence_parallel_size: Optional[int] = field(
        default=None,
        metadata={"help": "Ranks that split each sequence (Ulysses, docs/sequence-parallel.md): the superoffload "
                          "config's `sequence_parallel_size` (None: the config's). Turns `superoffload` on."},
    )
    resume_weights_only: bool = field(
        default=False,
        metadata={"help": "With `resume_from_checkpoint`: load only the model weights of the checkpoint and "
                          "train from step 0 with a fresh optimizer and LR schedule. Without it, resuming "
                          "from a checkpoint that lacks optimizer.pt or scheduler.pt is an error."},
    )

    def __post_init__(self):
        if _optim_name(self.optim) == OPTIM_SYNONYM:
            self.superoffload, self.optim = True, "adamw_torch"
        if isinstance(self.superoffload_config, str) and self.superoffload_config.lstrip().startswith("{"):
            try:
                self.superoffload_config = json.loads(self.superoffload_config)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"`superoffload_config` is {self.superoffload_config!r}, which starts like JSON but is not "
                    f"valid JSON ({error}). Give a JSON object such as '{{\"speculation\": \"off\"}}' "
                    "(quote it for the shell) or the path of a YAML/JSON file."
                ) from None
        if self.superoffload_config is not None or self.sequence_parallel_size is not None:
            self.superoffload = True
        if self.superoffload:
            self._check_superoffload_combination()
            plugin = self.superoffload_plugin()  # unknown keys and bad values fail here
            plugin.to_config("fp16" if self.fp16 else "bf16" if self.bf16 else "no")
        super().__post_init__()

    def superoffload_plugin(self) -> Optional[SuperOffloadPlugin]:
        """The superoffload settings (None when superoffload is off)."""
        if not self.superoffload:
            return None
        plugin = SuperOffloadPlugin.from_value(self.superoffload_config)
        if self.sequence_parallel_size is None:
            return plugin
        return SuperOffloadPlugin.from_dict({**plugin.explicit_fields(), "sequence_parallel_size": self.sequence_parallel_size})

    def _check_superoffload_combination(self) -> None:
        optim = _optim_name(self.optim)
        if optim not in _REPLACEABLE_OPTIMS:
            raise ValueError(
                f"`optim` is {optim!r} but superoffload=True trains with SuperOffloadAdamW. Drop "
                f"`--optim`, or use `--optim {OPTIM_SYNONYM}`."
            )
        for name, value in (("deepspeed", self.deepspeed), ("fsdp", self.fsdp)):
            if value not in (None, "", [], False):
                raise ValueError(
                    f"superoffload cannot be combined with `{name}` (got {value!r}): both own the "
                    f"optimizer state. Remove `--{name}` or turn superoffload off."
                )


class Trainer(HFTrainer):
    """transformers.Trainer that trains with SuperOffloadAdamW when `args.superoffload` is set
    (or when started by `superoffload launch`). Otherwise it is the stock Trainer."""

    _superoffload_attaches_itself = True  # the launcher's autopatch leaves it alone

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        ours = getattr(self.args, "superoffload", False)
        plugin = self.args.superoffload_plugin() if ours else launch_plugin()
        self.superoffload = SuperOffloadHooks(self, plugin) if plugin is not None else None

    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        if self.superoffload is None:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        return self.superoffload.train(super().train, resume_from_checkpoint, *args, **kwargs)

    def create_optimizer(self, model=None):
        if self.superoffload is None:
            return super().create_optimizer(model)
        return self.superoffload.create_optimizer(model)

    def _clip_grad_norm(self, model):
        if self.superoffload is None:
            return super()._clip_grad_norm(model)
        return self.superoffload.clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.superoffload is None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return self.superoffload.get_grad_norm(model, grad_norm=grad_norm)

    def _save_checkpoint(self, model, trial) -> None:
        if trial is not None:  # a hyperparameter search writes into per-trial run directories
            return super()._save_checkpoint(model, trial)
        return save_checkpoint_keeping_previous(lambda: super(Trainer, self)._save_checkpoint(model, trial),
                                                Path(self.args.output_dir), self.state.global_step,
                                                single_writer=self.args.world_size == 1)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        if self.superoffload is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        return self.superoffload.save_model(super().save_model, output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.superoffload is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        return self.superoffload.save_optimizer_and_scheduler(super()._save_optimizer_and_scheduler, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if self.superoffload is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        return self.superoffload.load_optimizer_and_scheduler(super()._load_optimizer_and_scheduler, checkpoint)
