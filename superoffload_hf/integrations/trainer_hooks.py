"""The Trainer methods superoffload replaces (optimizer creation, clipping, grad-norm reporting,
the optimizer's checkpoint, resume, the model save's weight fetch), for one Trainer, plus its
callback. Our `Trainer` calls them; the launcher's
autopatch binds them onto a stock `transformers.Trainer`. Neither of those is imported here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from typing import Any, Optional

import torch
import transformers
from transformers import DefaultFlowCallback
from transformers import Trainer as HFTrainer
from transformers import TrainingArguments as HFTrainingArguments

from superoffload_hf.integrations.accelerate import (
    SuperOffloadAcceleratedOptimizer,
    SuperOffloadPlugin,
    check_accelerator_supported,
    check_superoffload_optimizer,
    decay_param_groups,
    wrap_optimizer,
)
from superoffload_hf.integrations.callback import SuperOffloadCallback, shorten_printed_logs, unwrap_optimizer
from superoffload_hf.engine.dp.checkpoint import shard_files
from superoffload_hf.integrations import launch_env
from superoffload_hf.integrations.trainer_sequence_parallel import TrainerSequenceParallel
from superoffload_hf.integrations.resume import (
    check_new_run_output,
    interrupted_report,
    load_weights_only,
    resolve_resume,
)
from superoffload_hf.optimizer import SuperOffloadAdamW
from superoffload_hf.device import make_runtime
from superoffload_hf.parallel.tiling import prepare_tiling
from superoffload_hf.plan.activations import dataset_seq_len, with_trainer_activations

logger = logging.getLogger("superoffload_hf.integrations.trainer")

OPTIM_SYNONYM = "superoffload_adamw"
_HF_DEFAULT_OPTIM = {f.name: f for f in dataclasses.fields(HFTrainingArguments)}["optim"].default
# `optim` values that superoffload=True replaces silently (they name AdamW); others conflict.
_REPLACEABLE_OPTIMS = {_HF_DEFAULT_OPTIM, "adamw_torch", "adamw_torch_fused", OPTIM_SYNONYM}
# The Trainer methods superoffload replaces; a transformers without them is not supported.
HOOKED_TRAINER_METHODS = ("create_optimizer", "_clip_grad_norm", "_get_grad_norm", "save_model",
                          "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")
SCHEDULER_FILE = "scheduler.pt"



def _optim_name(optim: Any) -> str:
    return str(getattr(optim, "value", optim))


def _saves_checkpoints(args: HFTrainingArguments) -> bool:
    return str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"


class SuperOffloadHooks:
    """The Trainer methods superoffload changes, for one Trainer, plus its callback."""

    def __init__(self, trainer: HFTrainer, plugin: SuperOffloadPlugin):
        check_hook_points(type(trainer))
        check_trainer_supported(trainer)
        # weakly: the Trainer holds the hooks (a cycle would keep a dropped Trainer's optimizer alive)
        self._trainer = weakref.ref(trainer)
        self.plugin = plugin
        self.callback = SuperOffloadCallback()
        self.activation_offload = None  # config `activation_offload`: its hooks, once the optimizer is built
        insert_after_flow_callback(trainer.callback_handler.callbacks, self.callback)
        shorten_printed_logs(trainer.callback_handler.callbacks)  # the superoffload/* keys stay in the records
        size = plugin.sequence_parallel_size
        self.sequence_parallel = TrainerSequenceParallel(trainer, size) if size not in (None, 1) else None

    @property
    def trainer(self) -> HFTrainer:
        return self._trainer()

    def bind_to_trainer(self) -> None:
        """Bind the hooks onto a stock Trainer instance (what the launcher's autopatch does).
        The bound replacements reach the Trainer's own methods through the class and the hooks'
        weak reference: a bound method of the Trainer stored on it would be a reference cycle."""
        trainer, cls = self.trainer, type(self.trainer)
        trainer.superoffload = self
        trainer.create_optimizer = self.create_optimizer
        trainer._clip_grad_norm = self.clip_grad_norm
        trainer._get_grad_norm = self.get_grad_norm
        trainer.save_model = lambda output_dir=None, _internal_call=False: self.save_model(
            cls.save_model.__get__(self.trainer), output_dir, _internal_call)
        trainer._save_optimizer_and_scheduler = lambda output_dir: self.save_optimizer_and_scheduler(
            cls._save_optimizer_and_scheduler.__get__(self.trainer), output_dir)
        trainer._load_optimizer_and_scheduler = lambda checkpoint: self.load_optimizer_and_scheduler(
            cls._load_optimizer_and_scheduler.__get__(self.trainer), checkpoint)
        trainer.train = lambda resume_from_checkpoint=None, *args, **kwargs: self.train(
            cls.train.__get__(self.trainer), resume_from_checkpoint, *args, **kwargs)

    def train(self, original_train, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, resuming only from a complete checkpoint with its optimizer state (or,
        when `resume_weights_only` is set, from its weights only, at step 0); see resume.py."""
        try:
            return self._train(original_train, resume_from_checkpoint, *args, **kwargs)
        except KeyboardInterrupt:
            command = launch_env.launch_command()
            if command is not None:  # in-process callers (`superoffload train`) report it themselves
                logger.warning("superoffload: %s", interrupted_report(
                    self.trainer.state.global_step, self.trainer.args.output_dir, command))
            raise

    def _train(self, original_train, resume_from_checkpoint=None, *args, **kwargs):
        trainer = self.trainer
        plan = resolve_resume(resume_from_checkpoint, trainer.args.output_dir, weights_only=self.resume_weights_only())
        for path, why in plan.skipped:
            logger.warning("superoffload: skipped incomplete checkpoint %s: %s", path, why)
        if plan.checkpoint is None:
            if _saves_checkpoints(trainer.args):
                check_new_run_output(trainer.args.output_dir)
            return original_train(None, *args, **kwargs)
        logger.info("superoffload: %s", plan.describe()[-1])  # news, not a warning (`superoffload train` prints it)
        if plan.weights_only:
            load_weights_only(trainer, plan.checkpoint)
            return original_train(None, *args, **kwargs)
        return original_train(str(plan.checkpoint), *args, **kwargs)

    def resume_weights_only(self) -> bool:
        """`resume_weights_only` of the arguments (ours) or of the superoffload block (a stock
        script under `superoffload launch`, whose argument parser knows no such flag)."""
        return bool(getattr(self.trainer.args, "resume_weights_only", False) or self.plugin.resume_weights_only)

    def create_optimizer(self, model=None):
        trainer = self.trainer
        if trainer.optimizer is None:
            trainer.optimizer = self._build_optimizer(trainer.model if model is None else model)
        elif not isinstance(trainer.optimizer, SuperOffloadAcceleratedOptimizer):
            check_superoffload_optimizer(trainer.optimizer)  # optimizers=(SuperOffloadAdamW(...), ...)
            trainer.optimizer.max_grad_norm = max_grad_norm(trainer.args)
            trainer.optimizer = wrap_optimizer(trainer.accelerator, trainer.optimizer)
        if self.sequence_parallel is not None:
            self.sequence_parallel.set_optimizer(unwrap_optimizer(trainer.optimizer))
        return trainer.optimizer

    def _build_optimizer(self, model) -> SuperOffloadAcceleratedOptimizer:
        trainer, args = self.trainer, self.trainer.args
        if trainer.optimizer_cls_and_kwargs is not None:
            raise ValueError(
                "superoffload builds its own optimizer, but the Trainer got `optimizer_cls_and_kwargs`. "
                "Drop it, or turn superoffload off."
            )
        decay_names = set(trainer.get_decay_parameter_names(model))
        groups = decay_param_groups(model, lambda name: name not in decay_names, args.weight_decay)
        config = self.plugin.to_config(trainer.accelerator.mixed_precision)
        checkpointing = getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing  # (5.24's name)
        config, line = with_trainer_activations(
            config, self.plugin.explicit_fields(), model, args.per_device_train_batch_size, bool(checkpointing),
            trainer.train_dataset, lambda: make_runtime(next(model.parameters()).device).memory_info()[0])
        if line is not None:
            logger.info("superoffload: %s", line)
        _warn_if_optim_replaced(args)
        optimizer = SuperOffloadAdamW(
            groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
            weight_decay=args.weight_decay, max_grad_norm=max_grad_norm(args), config=config,
            model=model,  # weight-flow hooks its blocks (config `weights`)
        )
        weak = weakref.ref(optimizer)  # the model must not keep a dropped Trainer's optimizer alive
        prepare_tiling(model, config, optimizer.host_is_device, lambda: weak().device_memory_info()[0])
        logger.info("%s replaces the Trainer's optimizer: param groups (weight_decay, tensors) %s, "
                    "max_grad_norm %s, device dtype %s", type(optimizer).__name__,
                    [(g["weight_decay"], len(g["params"])) for g in groups], max_grad_norm(args),
                    config.device_dtype)
        self.apply_activation_offload(model, config.activation_offload, bool(checkpointing),
                                      block_input_bytes(model, args.per_device_train_batch_size, trainer.train_dataset),
                                      host_budget=config.host_memory_budget)
        return wrap_optimizer(trainer.accelerator, optimizer, config.device_dtype)

    def apply_activation_offload(self, model, choice: str, gradient_checkpointing: bool,
                                 input_bytes: Optional[int] = None, host_budget: Optional[int] = None) -> None:
        """Config `activation_offload`: hooks on the model the optimizer trains (parallel/activation_offload.py),
        replacing those of an earlier optimizer; their pinned pool sized for block inputs of
        `input_bytes` before training (None: unknown, sized by the first forward), against `host_budget`
        (config `host_memory_budget`) when set."""
        from superoffload_hf.parallel.activation_offload import offload_for_config

        if self.activation_offload is not None:
            self.activation_offload.remove()
        self.activation_offload, line = offload_for_config(model, choice, gradient_checkpointing,
                                                           block_input_bytes=input_bytes, host_budget=host_budget)
        logger.info("superoffload: %s", line)

    def save_model(self, original, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Weight-flow: `fetch_weights` first. The Trainer runs `save_model` on every rank
        (`_save_checkpoint` calls it; the user's script calls it everywhere) but reads the weights
        in `_save` on the main process only: under data parallelism the flowing weights are
        gathered (an all-gather every rank joins) here, on every rank, onto rank 0's host, or rank
        0's `state_dict()` would wait for the others forever."""
        optimizer = unwrap_optimizer(self.trainer.optimizer)
        if optimizer is not None:  # None: save_model before train() built it (nothing flows yet)
            optimizer.fetch_weights()
        return original(output_dir, _internal_call=_internal_call)

    def save_optimizer_and_scheduler(self, original, output_dir: str) -> None:
        """Data parallel: every rank writes its shard of the optimizer state (the stock Trainer
        saves the optimizer on the main process only), rank 0 the index and the scheduler."""
        trainer = self.trainer
        optimizer = unwrap_optimizer(trainer.optimizer)
        if optimizer is None or not optimizer.is_sharded:
            return original(output_dir)
        optimizer.save_sharded(output_dir)
        if trainer.args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def load_optimizer_and_scheduler(self, original, checkpoint) -> None:
        """Resume from a checkpoint saved by any number of ranks: each rank reads its own ranges
        of the shard files (or of a single-process optimizer.pt)."""
        trainer = self.trainer
        optimizer = unwrap_optimizer(trainer.optimizer)
        if checkpoint is None or optimizer is None or not (optimizer.is_sharded or shard_files(checkpoint)):
            return original(checkpoint)
        optimizer.load_state_dict(optimizer.read_state(checkpoint))
        trainer.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))

    def clip_grad_norm(self, model):
        """Hand max_grad_norm to the optimizer (it clips in step()); never touch the gradients."""
        return self.get_grad_norm(model)

    def get_grad_norm(self, model, grad_norm=None):
        if grad_norm is not None:
            return grad_norm
        unwrap_optimizer(self.trainer.optimizer).max_grad_norm = max_grad_norm(self.trainer.args)
        return self.callback.grad_norm_placeholder()


def insert_after_flow_callback(callbacks: list, callback: SuperOffloadCallback) -> None:
    """After DefaultFlowCallback (it sets `control.should_save`, which the callback reads) and
    before the reporters and printers (they read the counters the callback adds to the logs)."""
    flow = [i for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)]
    callbacks.insert(flow[0] + 1 if flow else 0, callback)


def max_grad_norm(args: HFTrainingArguments) -> Optional[float]:
    """The Trainer's clipping threshold as the optimizer takes it (None: no clipping)."""
    value = args.max_grad_norm
    return float(value) if value is not None and value > 0 else None


def check_hook_points(trainer_cls: type) -> None:
    missing = [name for name in HOOKED_TRAINER_METHODS if not callable(getattr(trainer_cls, name, None))]
    if missing:
        raise RuntimeError(
            f"transformers {transformers.__version__}: Trainer has no {missing}, the methods superoffload "
            "replaces (optimizer creation, clipping, grad-norm reporting). Use transformers 5.17 to 5.24."
        )


def check_trainer_supported(trainer: HFTrainer) -> None:
    for flag, name in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        if getattr(trainer, flag, False):
            raise ValueError(
                f"superoffload cannot be combined with {name} (enabled by the TrainingArguments or the "
                f"accelerate config): both own the optimizer state. Turn one of them off."
            )
    check_accelerator_supported(trainer.accelerator)


def _warn_if_optim_replaced(args: HFTrainingArguments) -> None:
    optim = _optim_name(args.optim)
    if optim not in _REPLACEABLE_OPTIMS:
        logger.warning("superoffload: `optim` %r is replaced by SuperOffloadAdamW.", optim)


def block_input_bytes(model, micro_batch: int, dataset) -> Optional[int]:
    """One decoder block's input (micro-batch x the train dataset's longest sequence among its
    first samples x hidden, in the model's dtype): what activation offload's pinned pool is sized
    for before training. None: unknown (an iterable dataset, a config without hidden_size)."""
    seq = dataset_seq_len(dataset)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if seq is None or not hidden:
        return None
    return int(micro_batch) * int(seq) * int(hidden) * next(model.parameters()).element_size()
