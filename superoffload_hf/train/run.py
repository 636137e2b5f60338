"""The training run of `superoffload train` (superoffload_hf/cli.py parses the command and calls
`train`): build the tokenizer, the model, the data and the Trainer from a recipe, train, and
summarize. `build_tokenizer`, `build_model` and `build_training_arguments` are the pieces
benchmarks build a recipe's run from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from superoffload_hf.config import ConfigError
from superoffload_hf.integrations.ctrl_c import CtrlC
from superoffload_hf.train.recipe import Recipe, RecipeError


class TrainingInterrupted(Exception):
    """Ctrl-C during `trainer.train()`, after `step` optimizer steps."""

    def __init__(self, step: int):
        super().__init__(f"interrupted at step {step}")
        self.step = step


# ---- building the pieces ----------------------------------------------------------------------


def build_tokenizer(recipe: Recipe) -> Any:
    from superoffload_hf.train.tokenizer import pretrained_tokenizer, shipped_tokenizer

    if recipe.tokenizer.shipped:
        return shipped_tokenizer(recipe.tokenizer.vocab_size)
    return pretrained_tokenizer(recipe.tokenizer_name_or_path)


def build_model(recipe: Recipe, tokenizer: Any) -> Any:
    """A causal LM: random init from `model.config` (vocab and special ids taken from the
    tokenizer unless set), or `from_pretrained(model.name_or_path)`; in recipe.model_dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, recipe.model_dtype)
    extra = {"attn_implementation": recipe.model.attn_implementation} if recipe.model.attn_implementation else {}
    if recipe.model.config is not None:
        model = AutoModelForCausalLM.from_config(_model_config(recipe, tokenizer), dtype=dtype, **extra)
    else:
        model = AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path, dtype=dtype, **extra)
    _check_vocab(model.config.vocab_size, len(tokenizer), "the model's vocab_size")
    model.config.use_cache = False  # training: the KV cache only costs memory
    return model


def _model_config(recipe: Recipe, tokenizer: Any) -> Any:
    from transformers import AutoConfig

    values = dict(recipe.model.config)
    model_type = values.pop("model_type", "llama")
    values.setdefault("vocab_size", len(tokenizer))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        values.setdefault(name, getattr(tokenizer, name))
    _check_vocab(values["vocab_size"], len(tokenizer), "`model.config.vocab_size`")
    return AutoConfig.for_model(model_type, **values)


def _check_vocab(vocab_size: int, tokenizer_size: int, what: str) -> None:
    if vocab_size < tokenizer_size:
        raise RecipeError(
            f"{what} is {vocab_size} but the tokenizer has {tokenizer_size} tokens; raise it to at "
            f"least {tokenizer_size} (or drop it from model.config to take the tokenizer's size)."
        )


def build_training_arguments(recipe: Recipe) -> Any:
    from superoffload_hf.integrations.trainer import TrainingArguments

    values = {k: v for k, v in recipe.training.items() if k != "resume_from_checkpoint"}
    try:
        return TrainingArguments(
            **values, superoffload=recipe.superoffload is not None, superoffload_config=recipe.superoffload
        )
    except ConfigError:
        raise
    except ValueError as exc:
        raise RecipeError(f"{recipe.source}: `training` was rejected by TrainingArguments: {exc}") from exc


# ---- running ----------------------------------------------------------------------------------


def train(recipe: Recipe) -> "TrainSummary":
    """Build tokenizer, model, data and Trainer from `recipe`, train, and summarize."""
    from transformers import default_data_collator, set_seed

    from superoffload_hf.integrations.trainer import Trainer
    from superoffload_hf.integrations.resume import load_weights_only
    from superoffload_hf.train.data import build_dataset

    from superoffload_hf.train.footprint import recipe_with_activation_bytes

    recipe, counted = recipe_with_activation_bytes(recipe)  # what weights auto/flow counts on the device
    if counted is not None:
        print(f"superoffload train: {counted}", flush=True)
    args = build_training_arguments(recipe)
    resume = recipe.resume_plan()  # checked again: the recipe was validated before anything loaded
    for line in resume.describe():
        print(f"superoffload train: {line}", flush=True)
    set_seed(args.seed)  # before the model is built: a random init is reproducible
    tokenizer = build_tokenizer(recipe)
    model = build_model(recipe, tokenizer)
    dataset = build_dataset(recipe.data, tokenizer)
    _print_plan(recipe, model, tokenizer, dataset)
    ctrl_c = CtrlC()
    recorder = _RunRecorder(ctrl_c)
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
        processing_class=tokenizer, callbacks=[recorder.callback()],
    )
    if resume.weights_only:
        load_weights_only(trainer, resume.checkpoint)
    full_resume = None if resume.checkpoint is None or resume.weights_only else str(resume.checkpoint)
    try:
        with ctrl_c.installed():
            output = trainer.train(resume_from_checkpoint=full_resume)
    except KeyboardInterrupt:
        raise TrainingInterrupted(trainer.state.global_step) from None
    checkpoint = _final_checkpoint(trainer, args)
    return _summarize(recipe, args, trainer, output, recorder, checkpoint)


def _final_checkpoint(trainer: Any, args: Any) -> str:
    """The last checkpoint-N in output_dir; without step checkpoints, save the model there."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
    if last is not None and last.endswith(f"checkpoint-{trainer.state.global_step}"):
        return last
    trainer.save_model(args.output_dir)
    return str(args.output_dir)


def _print_plan(recipe: Recipe, model: Any, tokenizer: Any, dataset: Any) -> None:
    params = sum(p.numel() for p in model.parameters())
    source = recipe.model.name_or_path or "random init from model.config"
    print(f"superoffload train: {recipe.source}")
    print(f"  model      {model.config.model_type}, {params / 1e6:.2f}M parameters, {recipe.model_dtype}, {source}")
    print(f"  tokenizer  {type(tokenizer).__name__}, {len(tokenizer)} tokens "
          f"({'shipped byte-level BPE' if recipe.tokenizer.shipped else recipe.tokenizer_name_or_path})")
    print(f"  data       {dataset.num_tokens:,} tokens in {len(dataset)} blocks of {recipe.data.seq_len}")
    optimizer = f"SuperOffloadAdamW {recipe.superoffload}" if recipe.superoffload is not None else "stock (superoffload: false)"
    print(f"  optimizer  {optimizer}")
    print(f"  output     {recipe.training['output_dir']}", flush=True)


class _RunRecorder:
    """Remembers the step a run started at (after a resume) and the losses it logged; raises a
    Ctrl-C that arrived where it could not (integrations/ctrl_c.py) at the end of the step."""

    def __init__(self, ctrl_c: "CtrlC") -> None:
        self.start_step = 0
        self.losses: list[tuple[int, float]] = []
        self.ctrl_c = ctrl_c

    def callback(self) -> Any:
        from transformers import TrainerCallback

        recorder = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
                recorder.start_step = state.global_step  # already the checkpoint's step on resume
                describe = getattr(optimizer, "describe", None)  # ours, through Accelerate's wrapper
                if describe is not None:
                    print(f"  engine     {describe()}", flush=True)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    recorder.losses.append((state.global_step, float(logs["loss"])))

            def on_substep_end(self, args, state, control, **kwargs):
                recorder.ctrl_c.raise_if_pending()

            def on_step_end(self, args, state, control, **kwargs):
                recorder.ctrl_c.raise_if_pending()

        return _Callback()


# ---- the summary ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSummary:
    steps: int
    """Optimizer steps taken by this run (after a resume: since the checkpoint)."""
    global_step: int
    tokens: int
    seconds: float
    first_loss: Optional[tuple[int, float]]
    final_loss: Optional[tuple[int, float]]
    rollbacks: Optional[int]
    skipped_steps: Optional[int]
    checkpoint: str
    resumed_from_step: Optional[int]
    host_state: Optional[str] = None
    """The optimizer's host state precision and bytes per parameter (None: the stock optimizer)."""
    timeline: Optional[str] = None
    """Where the step timeline was written (None: no `--timeline`)."""
    device_peak: Optional[int] = None
    """Peak device bytes allocated (None: the CPU as the device, or the stock optimizer)."""
    weight_fetches: Optional[tuple[int, int]] = None
    """Weight-flow's fetches and their bytes (None: stationary weights, or the stock optimizer)."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def format(self) -> str:
        lines = ["", "superoffload train: done"]
        if self.resumed_from_step is not None:
            lines.append(f"  resumed from   step {self.resumed_from_step}")
        lines += [
            f"  steps          {self.steps} (global step {self.global_step}), {self.tokens:,} tokens in {self.seconds:.1f} s",
            f"  tokens/s       {self.tokens_per_second:,.0f}",
            f"  final loss     {_format_loss(self.final_loss)} (first logged {_format_loss(self.first_loss)})",
            f"  rollbacks      {_or_na(self.rollbacks)}",
            f"  skipped steps  {_or_na(self.skipped_steps)}",
            *([f"  host state     {self.host_state}"] if self.host_state is not None else []),
            *([f"  device peak    {self.device_peak / 1e9:.3f} GB"] if self.device_peak is not None else []),
            *([f"  weight fetches {self.weight_fetches[0]:,} ({self.weight_fetches[1] / 1e9:.3f} GB host to device)"]
              if self.weight_fetches is not None else []),
            f"  checkpoint     {self.checkpoint}",
            *([f"  timeline       {self.timeline}"] if self.timeline is not None else []),
        ]
        return "\n".join(lines)


def _format_loss(entry: Optional[tuple[int, float]]) -> str:
    return "n/a" if entry is None else f"{entry[1]:.4f} at step {entry[0]}"


def _or_na(value: Optional[int]) -> str:
    return "n/a (stock optimizer)" if value is None else str(value)


def _summarize(recipe: Recipe, args: Any, trainer: Any, output: Any, recorder: _RunRecorder, checkpoint: str) -> TrainSummary:
    steps = trainer.state.global_step - recorder.start_step
    sp = int((recipe.superoffload or {}).get("sequence_parallel_size", 1))  # an SP group shares its batch
    sequences_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size // sp
    counters = optimizer_counters(trainer)
    return TrainSummary(
        steps=steps,
        global_step=trainer.state.global_step,
        tokens=steps * sequences_per_step * recipe.data.seq_len,
        seconds=float(output.metrics.get("train_runtime", 0.0)),
        first_loss=recorder.losses[0] if recorder.losses else None,
        final_loss=recorder.losses[-1] if recorder.losses else None,
        rollbacks=None if counters is None else counters.rollbacks,
        skipped_steps=None if counters is None else counters.skips,
        checkpoint=checkpoint,
        resumed_from_step=recorder.start_step if recorder.start_step else None,
        host_state=_host_state(trainer),
        timeline=_timeline(trainer),
        device_peak=_device_peak(trainer),
        weight_fetches=(counters.weight_fetches, counters.bytes_fetched)
        if getattr(counters, "weight_fetches", 0) else None,
    )


def _device_peak(trainer: Any) -> Optional[int]:
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return optimizer.device_memory_peak() if hasattr(optimizer, "device_memory_peak") else None


def _timeline(trainer: Any) -> Optional[str]:
    from superoffload_hf.integrations.callback import describe_timeline

    hooks = getattr(trainer, "superoffload", None)
    written = getattr(getattr(hooks, "callback", None), "timeline_written", None)
    return describe_timeline(written) if written else None


def _host_state(trainer: Any) -> Optional[str]:
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return optimizer.host_state() if hasattr(optimizer, "host_state") else None


def optimizer_counters(trainer: Any) -> Any:
    """The SuperOffload optimizer's OffloadCounters, or None for a stock optimizer.
    Accelerate wraps the optimizer in an AcceleratedOptimizer that keeps it as `.optimizer`."""
    optimizer = trainer.optimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return getattr(optimizer, "counters", None)
