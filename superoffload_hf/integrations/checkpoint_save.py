"""A Trainer checkpoint save that fails cleanly: a half-written checkpoint never replaces a good one.

The Trainer writes `checkpoint-N` in place (model, optimizer, scheduler, RNG, `trainer_state.json`
last) and only then rotates older checkpoints away, so a save cut short (a full disk, Ctrl-C)
leaves the earlier checkpoints alone but a partial `checkpoint-N` behind, and a save of a step that
already has a checkpoint (a run resumed from an earlier one) overwrites a complete one file by file.
`save_checkpoint_keeping_previous` moves such an existing `checkpoint-N` aside first and puts it
back if the save fails, removes the partial directory, and turns an OSError into a
`CheckpointSaveError` that names the checkpoint, the free space and the checkpoint still intact.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from superoffload_hf.integrations.resume import last_complete_checkpoint


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions); the earlier checkpoints are intact."""


def save_checkpoint_keeping_previous(save: Callable[[], None], run_dir: Path, step: int,
                                     single_writer: bool = True) -> None:
    """Run `save` (the Trainer's save of `run_dir/checkpoint-{step}`). With `single_writer` (one
    process writes the directory), a failure leaves `run_dir` as it was before the save."""
    target = run_dir / f"checkpoint-{step}"
    aside = run_dir / f".checkpoint-{step}.replaced"  # hidden: the Trainer's rotation globs checkpoint-*
    moved_aside = single_writer and target.is_dir()
    if moved_aside:
        shutil.rmtree(aside, ignore_errors=True)
        target.rename(aside)
    try:
        save()
    except BaseException as error:
        if single_writer:
            shutil.rmtree(target, ignore_errors=True)
            if moved_aside:
                aside.rename(target)
        if isinstance(error, OSError):
            raise CheckpointSaveError(describe_failed_save(error, target, run_dir, single_writer)) from error
        raise
    if moved_aside:
        shutil.rmtree(aside, ignore_errors=True)


def describe_failed_save(error: OSError, target: Path, run_dir: Path, removed: bool = True) -> str:
    try:
        free = f"{shutil.disk_usage(run_dir).free / 1e9:.2f} GB free in {run_dir}"
    except OSError:
        free = f"free space in {run_dir} unknown"
    previous, _ = last_complete_checkpoint(run_dir)
    intact = (f"the previous checkpoint {previous} is intact (resume from it with "
              "`--training.resume_from_checkpoint true`)" if previous is not None else
              "no earlier checkpoint exists in it")
    partial = f"the partial {target.name} was removed and " if removed else ""
    return (f"saving checkpoint {target} failed: {error.strerror or error} ({free}); {partial}{intact}. "
            "Free some space or choose another `output_dir`, then resume.")
