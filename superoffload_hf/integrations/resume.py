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

A run that starts at step 0 (a weights-only resume, or no resume) never writes into an output_dir
that holds checkpoint-N directories: its own checkpoint-N would replace them one by one and
`save_total_limit` would rotate the rest away (by modification time: the old run's first). Such a
run is refused with the choices (`check_new_run_output`); the weights-only fix our messages name
writes into a new directory. Only a resume that continues the checkpoints' step count writes
among them, and rotates them as the Trainer does.
"""

from __future__ import annotations

import json
import re
import shlex
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from superoffload_hf.integrations import launch_env

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


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
    # Where none is found, the message starts with the Trainer's own words (users and tests match them).
    if resume is True:
        checkpoint, skipped = last_complete_checkpoint(output_dir)
        if checkpoint is None:
            detail = "; ".join(f"{p.name}: {why}" for p, why in skipped) or "no checkpoint-N directory at all"
            raise ResumeError(f"No valid checkpoint found in output directory ({output_dir}): `resume_from_checkpoint` "
                              f"is true but it holds no complete checkpoint ({detail}). Run without resuming, or give "
                              "a checkpoint directory.")
    else:
        checkpoint, skipped = Path(resume).expanduser(), []
        inside = checkpoints_newest_first(checkpoint)
        if inside and incomplete_reason(checkpoint) is not None:
            newest, _ = last_complete_checkpoint(checkpoint)
            example = f"e.g. {newest}, " if newest is not None else ""
            raise ResumeError(f"Can't find a valid checkpoint at {resume}: it is an output directory (it holds "
                              f"{', '.join(p.name for p in inside[:3])}), not a checkpoint. Give one of its "
                              f"checkpoints ({example}a checkpoint-N directory){_or_true(' in output_dir')}.")
        why = incomplete_reason(checkpoint)
        if why is not None:
            raise ResumeError(f"Can't find a valid checkpoint at {resume}: {why}. Resume from an earlier checkpoint"
                              f"{_earlier_hint(checkpoint)}{_or_true('')}.")
    if weights_only:
        check_new_run_output(output_dir, weights_only_from=checkpoint)
    else:
        check_training_state(checkpoint, output_dir)
    return ResumePlan(checkpoint, weights_only, skipped)


def check_new_run_output(output_dir: Union[str, Path], weights_only_from: Optional[Path] = None) -> None:
    """Refuse a run that starts at step 0 (a weights-only resume of `weights_only_from`, or no
    resume) into an `output_dir` that holds checkpoint-N directories, which its saves would
    overwrite and rotate away."""
    found = checkpoints_newest_first(output_dir)
    if not found:
        return
    names = ", ".join(p.name for p in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    harm = (f"its checkpoint-N saves would overwrite, and `save_total_limit` would rotate away, the checkpoints "
            f"already in output_dir {str(output_dir)!r} ({names})")
    if weights_only_from is not None:
        raise ResumeError(f"A weights-only resume starts again at step 0: {harm}. Write it into a new output "
                          f"directory: {weights_only_fix(weights_only_from, output_dir)}.")
    raise ResumeError(
        f"This run starts at step 0: {harm}. Resume that run (`resume_from_checkpoint`: its newest complete "
        f"checkpoint, or true), write into a new output_dir (e.g. {free_sibling(output_dir)}), or move its "
        "checkpoints away first.")


def weights_only_fix(checkpoint: Path, output_dir: Union[str, Path]) -> str:
    """How to resume the weights of `checkpoint` at step 0 into an output directory without
    checkpoints (`output_dir`, or a new one beside it), spelled for the route that runs this
    process: `superoffload launch` (a stock script's own arguments and the accelerate config's
    block), else `superoffload train` and TrainingArguments."""
    target = free_sibling(output_dir) if checkpoints_newest_first(output_dir) else Path(output_dir)
    new_dir, source = shlex.quote(str(target)), shlex.quote(str(checkpoint))
    if launch_env.launch_command() is not None:
        return (f"set `resume_weights_only: true` in the `superoffload:` block of the accelerate config and give "
                f"the script `--resume_from_checkpoint {source} --output_dir {new_dir}`")
    return (f"`--training.resume_from_checkpoint {source} --training.resume_weights_only true --training.output_dir "
            f"{new_dir}` (superoffload train), or `TrainingArguments(output_dir={str(target)!r}, "
            f"resume_weights_only=True)` and `resume_from_checkpoint={str(checkpoint)!r}`")


def free_sibling(output_dir: Union[str, Path]) -> Path:
    """`output_dir` with the first free suffix _2, _3, ...: a new directory beside it."""
    output_dir = Path(output_dir)
    for n in range(2, 1000):
        candidate = output_dir.with_name(f"{output_dir.name}_{n}")
        if not candidate.exists():
            return candidate
    return output_dir.with_name(f"{output_dir.name}_new")


def check_training_state(checkpoint: Path, output_dir: Union[str, Path, None] = None) -> None:
    """optimizer.pt and scheduler.pt present and structurally whole (a torch.save zip archive whose
    directory at the end is intact: an empty or truncated file fails here, not in a bare EOFError).
    The tensors' own checksums are verified when the optimizer loads them."""
    output_dir = checkpoint.parent if output_dir is None else output_dir
    for name, what in ((OPTIMIZER_FILE, "the optimizer state (fp32 master weights, Adam moments)"),
                       (SCHEDULER_FILE, "the LR scheduler state")):
        path = checkpoint / name
        if not path.is_file():
            raise ResumeError(
                f"Cannot resume from {str(checkpoint)!r}: it has no {name}, {what}. The Trainer would "
                "silently start a fresh optimizer and LR schedule at the checkpoint's step. Resume from a "
                f"checkpoint that has it{_earlier_hint(checkpoint)}, or deliberately {_weights_only(checkpoint, output_dir)}.")
        problem = _zip_problem(path)
        if problem is not None:
            raise ResumeError(
                f"Cannot resume from {str(checkpoint)!r}: {path} is corrupt ({problem}). Resume from the "
                f"previous checkpoint{_earlier_hint(checkpoint)}, or deliberately {_weights_only(checkpoint, output_dir)}.")


def _weights_only(checkpoint: Path, output_dir: Union[str, Path]) -> str:
    return ("resume the model weights only, with a fresh optimizer and LR schedule from step 0, into an "
            f"output directory without checkpoints: {weights_only_fix(checkpoint, output_dir)}")


def _or_true(where: str) -> str:
    """The `true` choice, except under `superoffload launch`: a stock script passes
    `--resume_from_checkpoint true` on as the path "true"."""
    if launch_env.launch_command() is not None:
        return ""
    return f", or `resume_from_checkpoint: true` for the newest complete one{where}"


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
