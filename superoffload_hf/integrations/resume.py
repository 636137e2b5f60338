"""Resuming from a Trainer checkpoint without losing state silently.

The Trainer writes a checkpoint directory in this order: the model (and tokenizer), then
`optimizer.pt`, `scheduler.pt`, the RNG state, and `trainer_state.json` last. So a directory whose
`trainer_state.json` is missing or does not parse was cut short by a crash (for a large model the
optimizer save takes minutes), and nothing in it can be trusted. Left alone, the Trainer would
pick such a directory for `resume_from_checkpoint=True` and fail with a traceback, and, given a
checkpoint without `optimizer.pt` or `scheduler.pt`, would start a fresh optimizer and LR schedule
while reporting that it resumed (and re-make the fp32 master weights from low-precision ones).

`resolve_resume` turns what the user asked for into what to load:

- `True`: the newest *complete* `checkpoint-N` in output_dir; the incomplete ones skipped are
  reported;
- a directory: it must be complete, else an error names what is missing;
- either way, `optimizer.pt` and `scheduler.pt` must be there and readable, unless the user asked
  for the weights only (`resume_weights_only`): then the model weights are loaded and training
  starts afresh at step 0 with a new optimizer and schedule.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
WEIGHTS_ONLY_HINT = ("resume the model weights only, with a fresh optimizer and LR schedule from step 0: "
                     "`--training.resume_weights_only true` (superoffload train) or "
                     "`TrainingArguments(resume_weights_only=True)` / `--resume_weights_only`")


class ResumeError(ValueError):
    """The checkpoint to resume from is incomplete, missing state, or corrupt."""


@dataclass
class ResumePlan:
    checkpoint: Optional[Path]
    """The checkpoint to load (None: nothing to resume)."""
    weights_only: bool = False
    """Load only the model weights from `checkpoint` and start at step 0."""
    skipped: list = field(default_factory=list)
    """(directory, why) for each newer checkpoint passed over because it is incomplete."""

    def describe(self) -> list[str]:
        lines = [f"skipped incomplete checkpoint {path}: {why}" for path, why in self.skipped]
        if self.checkpoint is not None:
            what = "the model weights only (fresh optimizer and schedule, step 0)" if self.weights_only else "everything"
            lines.append(f"resuming from {self.checkpoint}: {what}")
        return lines


def incomplete_reason(checkpoint: Union[str, Path]) -> Optional[str]:
    """Why `checkpoint` is not a complete Trainer checkpoint, or None when it is."""
    path = Path(checkpoint)
    if not path.is_dir():
        return "it is not a directory"
    state = path / TRAINER_STATE
    if not state.is_file():
        return (f"it has no {TRAINER_STATE}, which the Trainer writes last: the save was interrupted "
                f"(present: {sorted(p.name for p in path.iterdir()) or 'nothing'})")
    try:
        json.loads(state.read_text())
    except (ValueError, UnicodeDecodeError):
        return f"its {TRAINER_STATE} is truncated or not JSON: the save was interrupted"
    if not any((path / name).is_file() and (path / name).stat().st_size > 0 for name in WEIGHT_FILES):
        return f"it holds no model weights (none of {list(WEIGHT_FILES[:3])})"
    return None


def checkpoints_newest_first(output_dir: Union[str, Path]) -> list[Path]:
    root = Path(output_dir).expanduser()
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT_NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def last_complete_checkpoint(output_dir: Union[str, Path]) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """The newest complete checkpoint-N in `output_dir` and the newer incomplete ones skipped."""
    skipped = []
    for path in checkpoints_newest_first(output_dir):
        why = incomplete_reason(path)
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def resolve_resume(resume: Union[bool, str, Path, None], output_dir: Union[str, Path],
                   weights_only: bool = False) -> ResumePlan:
    """What to load for `resume_from_checkpoint=resume`; raises ResumeError instead of losing state."""
    if resume is None or resume is False:
        return ResumePlan(None)
    if resume is True:
        checkpoint, skipped = last_complete_checkpoint(output_dir)
        if checkpoint is None:
            detail = "; ".join(f"{p.name}: {why}" for p, why in skipped) or "no checkpoint-N directory at all"
            raise ResumeError(f"`resume_from_checkpoint` is true but output_dir {str(output_dir)!r} holds no complete "
                              f"checkpoint ({detail}). Run without resuming, or give a checkpoint directory.")
    else:
        checkpoint, skipped = Path(resume).expanduser(), []
        inside = checkpoints_newest_first(checkpoint)
        if inside and incomplete_reason(checkpoint) is not None:
            newest, _ = last_complete_checkpoint(checkpoint)
            example = f"e.g. {newest}, " if newest is not None else ""
            raise ResumeError(f"Cannot resume from {str(resume)!r}: it is an output directory (it holds "
                              f"{', '.join(p.name for p in inside[:3])}), not a checkpoint. Give one of its "
                              f"checkpoints ({example}a checkpoint-N directory), or `resume_from_checkpoint: true` "
                              "for the newest complete one in output_dir.")
        why = incomplete_reason(checkpoint)
        if why is not None:
            raise ResumeError(f"Cannot resume from {str(resume)!r}: {why}. Resume from an earlier checkpoint"
                              f"{_earlier_hint(checkpoint)}, or `resume_from_checkpoint: true` for the newest complete one.")
    if not weights_only:
        check_training_state(checkpoint)
    return ResumePlan(checkpoint, weights_only, skipped)


def check_training_state(checkpoint: Path) -> None:
    """optimizer.pt and scheduler.pt present and structurally whole (a torch.save zip archive whose
    directory at the end is intact: an empty or truncated file fails here, not in a bare EOFError).
    The tensors' own checksums are verified when the optimizer loads them."""
    for name, what in ((OPTIMIZER_FILE, "the optimizer state (fp32 master weights, Adam moments)"),
                       (SCHEDULER_FILE, "the LR scheduler state")):
        path = checkpoint / name
        if not path.is_file():
            raise ResumeError(
                f"Cannot resume from {str(checkpoint)!r}: it has no {name}, {what}. The Trainer would "
                "silently start a fresh optimizer and LR schedule at the checkpoint's step. Resume from a "
                f"checkpoint that has it{_earlier_hint(checkpoint)}, or deliberately {WEIGHTS_ONLY_HINT}.")
        problem = _zip_problem(path)
        if problem is not None:
            raise ResumeError(
                f"Cannot resume from {str(checkpoint)!r}: {path} is corrupt ({problem}). Resume from the "
                f"previous checkpoint{_earlier_hint(checkpoint)}, or deliberately {WEIGHTS_ONLY_HINT}.")


def _zip_problem(path: Path) -> Optional[str]:
    size = path.stat().st_size
    if size == 0:
        return "the file is empty"
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        return f"{size:,} bytes, not a complete torch.save archive: {error}; the file was cut short"
    return None


def _earlier_hint(checkpoint: Path) -> str:
    match = _CHECKPOINT_NAME.match(checkpoint.name)
    if match is None:
        return ""
    step = int(match.group(1))
    for path in checkpoints_newest_first(checkpoint.parent):
        if int(path.name.split("-")[1]) < step and incomplete_reason(path) is None:
            return f" (e.g. {path})"
    return ""


def load_weights_only(trainer, checkpoint: Path) -> None:
    """Load the model weights of `checkpoint` into `trainer.model`, through the Trainer's own
    loader (every weight format it writes: safetensors, sharded, adapters)."""
    trainer._load_from_checkpoint(str(checkpoint))


def interrupted_report(step: int, output_dir: Union[str, Path], resume_command_prefix: str) -> str:
    """After Ctrl-C: the step reached, the newest complete checkpoint in `output_dir`, and the command
    that resumes from it (`resume_command_prefix` followed by `--resume_from_checkpoint DIR`)."""
    import shlex

    checkpoint, _ = last_complete_checkpoint(output_dir)
    if checkpoint is None:
        return (f"interrupted at step {step}; no complete checkpoint in {output_dir} yet; "
                f"start again with: {resume_command_prefix}")
    return (f"interrupted at step {step}; last complete checkpoint {checkpoint}; resume with: "
            f"{resume_command_prefix} --resume_from_checkpoint {shlex.quote(str(checkpoint))}")
