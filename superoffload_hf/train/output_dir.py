"""Whether `superoffload train` may write into `training.output_dir`, checked before anything loads.

Two ways a run loses work there, both refused with one line that names the directory and the fix:

- the directory holds another run's checkpoints: a new run would mix with them (the Trainer's
  `save_total_limit` rotates the oldest away, whichever run wrote them; the summary and a later
  `resume_from_checkpoint: true` pick the newest, whichever run wrote it). Choices: resume that
  run, train into a new directory, or `--overwrite_output_dir` (its checkpoints are removed first);
- the directory cannot be written (read-only, or a path under a file): the first save would fail
  after all the training before it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from superoffload_hf.integrations.resume import WEIGHT_FILES, checkpoints_newest_first, free_sibling
from superoffload_hf.train.recipe import RecipeError

OVERWRITE_FLAG = "--overwrite_output_dir"


class OutputDirError(RecipeError):
    """`training.output_dir` holds another run's checkpoints, or cannot be written."""


def previous_run_outputs(output_dir: Path) -> list[Path]:
    """The checkpoint-N directories (newest first) and the saved model files a run left in `output_dir`."""
    saved = [output_dir / name for name in WEIGHT_FILES + ("trainer_state.json",) if (output_dir / name).is_file()]
    return checkpoints_newest_first(output_dir) + saved


def check_no_previous_run(output_dir: Path, resuming: bool, overwrite: bool) -> None:
    """Refuse a new run (not a resume) into a directory that holds another run's checkpoints."""
    found = previous_run_outputs(output_dir)
    if resuming or overwrite or not found:
        return
    names = ", ".join(p.name for p in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    raise OutputDirError(
        f"`training.output_dir` {str(output_dir)!r} holds another run's checkpoints ({names}), which a new run "
        f"would rotate away or mix with. Resume that run with `--training.resume_from_checkpoint true`, train "
        f"into a new directory with `--training.output_dir {free_sibling(output_dir)}`, or replace them with "
        f"`{OVERWRITE_FLAG}`.")


def remove_previous_run(output_dir: Path) -> list[Path]:
    """`--overwrite_output_dir`: delete what a previous run saved in `output_dir`; the paths removed."""
    found = previous_run_outputs(output_dir)
    for path in found:  # every rank of a torchrun start may get here: a path already gone is fine
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return found


def check_writable(output_dir: Path) -> None:
    """`output_dir` exists as a writable directory, or can be created: probed by creating (and
    removing) a file in it or in its nearest existing parent, which a dry run leaves as it was."""
    existing = output_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputDirError(
            f"`training.output_dir` {str(output_dir)!r} cannot be created: {str(existing)!r} is a file, not a "
            "directory. Choose another `--training.output_dir`, or move that file away.")
    problem = _write_problem(existing)
    if problem is not None:
        where = "" if existing == output_dir else f" (its nearest existing parent {str(existing)!r})"
        raise OutputDirError(
            f"`training.output_dir` {str(output_dir)!r} cannot be written{where}: {problem}. Choose a writable "
            "`--training.output_dir`, or fix the permissions (`chmod u+w`) or the mount.")


def _write_problem(directory: Path) -> Optional[str]:
    if not os.access(directory, os.W_OK | os.X_OK):
        return "permission denied (read-only for this user)"
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:  # a read-only file system, a full disk, a quota
        return error.strerror or str(error)
    return None

