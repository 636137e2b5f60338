"""`superoffload train` and its output directory: another run's checkpoints are never touched
unless asked, and a directory that cannot be written is refused before anything loads."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from superoffload_hf import cli
from superoffload_hf.cli import main
from superoffload_hf.train.recipe import read_recipe_yaml

from _readme import shown_commands

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_llama_cpu.yaml")


class _Summary:
    def format(self) -> str:
        return "fake summary"


def previous_run(out: Path) -> dict[Path, bytes]:
    """Two checkpoints of an earlier run in `out`: their files and contents."""
    files = {}
    for step in (200, 300):
        checkpoint = out / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        for name, data in (("model.safetensors", b"w" * step), ("trainer_state.json", b"{}")):
            (checkpoint / name).write_bytes(data)
            files[checkpoint / name] = data
    return files


def unchanged(files: dict[Path, bytes]) -> bool:
    return all(path.is_file() and path.read_bytes() == data for path, data in files.items())


def test_a_new_run_into_another_runs_checkpoints_is_refused_naming_the_directory_and_the_choices(
        tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    files = previous_run(out)
    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
    assert main(["train", TINY, "--training.output_dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("superoffload train: error:"), err
    assert f"`training.output_dir` '{out}' holds another run's checkpoints (checkpoint-300, checkpoint-200)" in err
    for choice in ("`--training.resume_from_checkpoint true`", f"`--training.output_dir {out}_2`",
                   "`--overwrite_output_dir`"):
        assert choice in err, err
    assert unchanged(files)


def test_resuming_into_the_directory_is_allowed(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    files = previous_run(out)
    seen = []
    monkeypatch.setattr(cli, "train", lambda recipe: seen.append(recipe) or _Summary())
    monkeypatch.setattr(cli.Recipe, "resume_plan", lambda self: None)  # the fake checkpoints are not loadable
    assert main(["train", TINY, "--training.output_dir", str(out), "--training.resume_from_checkpoint", "true"]) == 0
    assert len(seen) == 1 and unchanged(files)


def test_overwrite_output_dir_removes_the_previous_runs_checkpoints_before_training(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    previous_run(out)
    (out / "notes.txt").write_text("mine")
    at_train = []
    monkeypatch.setattr(cli, "train", lambda recipe: at_train.append(sorted(p.name for p in out.iterdir())) or _Summary())
    assert main(["train", TINY, "--training.output_dir", str(out), "--overwrite_output_dir"]) == 0
    assert at_train == [["notes.txt"]]
    printed = capsys.readouterr().out
    assert f"--overwrite_output_dir: removed {out / 'checkpoint-300'}" in printed


def test_overwrite_and_resume_together_are_refused(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    files = previous_run(out)
    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
    monkeypatch.setattr(cli.Recipe, "resume_plan", lambda self: None)
    assert main(["train", TINY, "--training.output_dir", str(out), "--overwrite_output_dir",
                 "--training.resume_from_checkpoint", "true"]) == 2
    assert "`--overwrite_output_dir` would remove the checkpoints" in capsys.readouterr().err
    assert unchanged(files)


def test_dry_run_warns_about_another_runs_checkpoints_and_touches_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    files = previous_run(out)
    assert main(["train", TINY, "--training.output_dir", str(out), "--dry-run", "--overwrite_output_dir"]) == 0
    assert main(["train", TINY, "--training.output_dir", str(out), "--dry-run"]) == 0
    assert "warning: `training.output_dir`" in capsys.readouterr().err
    assert unchanged(files)


def readme_train_commands() -> list[list[str]]:
    return [c[1:] for c in shown_commands("superoffload") if c[:1] == ["train"] and c[1].startswith("recipes/")]


def output_dir_of(args: list[str]) -> str:
    for i, token in enumerate(args):
        if token == "--training.output_dir":
            return args[i + 1]
        if token.startswith("--training.output_dir="):
            return token.split("=", 1)[1]
    return read_recipe_yaml(REPO / args[0])["training"]["output_dir"]


def test_each_readme_example_that_starts_a_run_has_its_own_output_directory():
    new_runs = [args for args in readme_train_commands()
                if "--dry-run" not in args and not any(a.startswith("--training.resume_from_checkpoint") for a in args)]
    assert len(new_runs) >= 3, new_runs
    dirs = [os.path.normpath(output_dir_of(args)) for args in new_runs]
    assert len(set(dirs)) == len(dirs), list(zip(dirs, new_runs))


# ---- output directories that cannot be written ------------------------------------------------


def test_an_output_dir_under_a_file_is_refused_before_training_and_by_dry_run(tmp_path, capsys, monkeypatch):
    (tmp_path / "runs").write_text("a file, not a directory")
    out = tmp_path / "runs" / "tiny"
    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
    for extra in (["--dry-run"], []):
        assert main(["train", TINY, "--training.output_dir", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"`training.output_dir` '{out}' cannot be created: '{tmp_path / 'runs'}' is a file" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_dir_is_refused_before_training_and_by_dry_run(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
    try:
        for extra in (["--dry-run"], []):
            assert main(["train", TINY, "--training.output_dir", str(out / "tiny"), *extra]) == 2
            assert "cannot be written (its nearest existing parent" in capsys.readouterr().err
    finally:
        out.chmod(0o755)


def test_an_output_dir_on_a_read_only_file_system_is_refused_before_training_and_by_dry_run(tmp_path, capsys,
                                                                                         monkeypatch):
    import errno
    import tempfile

    def read_only_mount(*args, **kwargs):  # what even root gets on a read-only mount
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only_mount)
    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
    for extra in (["--dry-run"], []):
        assert main(["train", TINY, "--training.output_dir", str(tmp_path), *extra]) == 2
        err = capsys.readouterr().err
        assert f"`training.output_dir` '{tmp_path}' cannot be written: Read-only file system." in err, err


# ---- a save that fails -------------------------------------------------------------------------

# The tiny recipe, smaller still: a few seconds for a handful of steps.
SMALL = ["--model.config.num_hidden_layers", "1", "--data.seq_len", "32", "--training.per_device_train_batch_size", "2",
         "--training.logging_steps", "1", "--training.warmup_steps", "0", "--training.lr_scheduler_type", "constant"]


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def test_a_disk_full_during_a_save_names_the_checkpoint_the_free_space_and_the_intact_previous_one(
        tmp_path, capsys, monkeypatch):
    import errno

    import torch

    from superoffload_hf.integrations.resume import incomplete_reason

    out = tmp_path / "out"
    real_save, before = torch.save, {}

    def save_until_the_disk_fills(obj, f, *args, **kwargs):
        if "checkpoint-4" in str(f):
            before.update(files_of(out / "checkpoint-2"))
            Path(f).write_bytes(b"half an optimizer")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_the_disk_fills)
    code = main(["train", TINY, *SMALL, "--training.max_steps", "4", "--training.save_steps", "2",
                 "--training.output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("superoffload train: error:"))
    assert line.startswith(f"superoffload train: error: saving checkpoint {out / 'checkpoint-4'} failed: "
                           "No space left on device ("), line
    assert re.search(r"\([\d.]+ GB free in ", line), line
    assert f"the previous checkpoint {out / 'checkpoint-2'} is intact" in line
    assert not (out / "checkpoint-4").exists()
    assert incomplete_reason(out / "checkpoint-2") is None
    assert before and files_of(out / "checkpoint-2") == before


def test_a_failed_save_puts_back_the_complete_checkpoint_it_was_replacing(tmp_path):
    import errno

    from superoffload_hf.integrations.checkpoint_save import CheckpointSaveError, save_checkpoint_keeping_previous

    good = tmp_path / "checkpoint-4"
    good.mkdir()
    (good / "model.safetensors").write_bytes(b"good weights")
    (good / "trainer_state.json").write_text("{}")

    def partial_save():
        (tmp_path / "checkpoint-4").mkdir()
        (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointSaveError, match=r"the previous checkpoint .*checkpoint-4 is intact"):
        save_checkpoint_keeping_previous(partial_save, tmp_path, 4)
    assert files_of(good) == {"model.safetensors": b"good weights", "trainer_state.json": b"{}"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


def test_an_interrupted_save_removes_the_partial_checkpoint_and_lets_the_interrupt_through(tmp_path):
    from superoffload_hf.integrations.checkpoint_save import save_checkpoint_keeping_previous

    def interrupted_save():
        (tmp_path / "checkpoint-6").mkdir()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint_keeping_previous(interrupted_save, tmp_path, 6)
    assert list(tmp_path.iterdir()) == []


def test_a_successful_save_replaces_the_checkpoint_of_the_same_step(tmp_path):
    from superoffload_hf.integrations.checkpoint_save import save_checkpoint_keeping_previous

    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"old")

    def save():
        (tmp_path / "checkpoint-4").mkdir()
        (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"new")

    save_checkpoint_keeping_previous(save, tmp_path, 4)
    assert files_of(tmp_path / "checkpoint-4") == {"model.safetensors": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


# ---- a resume that does not continue the step count ---------------------------------------------


def files_under(directory: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def train_flags_of_the_weights_only_fix(message: str) -> list[str]:
    """The `--training.*` flags of the weights-only fix a message names for `superoffload train`."""
    (fix,) = [span for span in re.findall(r"`([^`]*)`", message) if "--training.resume_weights_only" in span]
    return fix.split()


def test_following_the_weights_only_fix_for_a_corrupt_optimizer_state_leaves_every_checkpoint_as_it_was(
        tmp_path, capsys):
    """The report: checkpoints 10/20/30/40 (save_total_limit 4), optimizer.pt of checkpoint-40 cut
    short; the error's weights-only fix, followed as written, restarted at step 0 into the same
    directory and overwrote checkpoint-10 and checkpoint-20 (the tiny recipe, smaller: SMALL)."""
    from superoffload_hf.integrations.resume import checkpoints_newest_first

    out = tmp_path / "out"
    run = ["train", TINY, *SMALL, "--training.max_steps", "40", "--training.save_steps", "10",
           "--training.save_total_limit", "4", "--training.output_dir", str(out)]
    assert main(run) == 0, capsys.readouterr().err[-3000:]
    assert [p.name for p in checkpoints_newest_first(out)] == [f"checkpoint-{n}" for n in (40, 30, 20, 10)]
    optimizer = out / "checkpoint-40" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:-40])
    before = files_under(out)
    capsys.readouterr()

    assert main([*run, "--training.resume_from_checkpoint", "true"]) == 2
    err = capsys.readouterr().err
    assert f"{optimizer} is corrupt" in err, err
    fix = train_flags_of_the_weights_only_fix(err)
    code = main([*run, "--training.resume_from_checkpoint", "true", *fix, "--training.max_steps", "10"])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    after = files_under(out)
    assert sorted(after) == sorted(before), sorted(set(after) ^ set(before))
    assert [p for p in before if after[p] != before[p]] == []
    assert f"resuming from {out / 'checkpoint-40'}: the model weights only" in printed.out
    new_dir = Path(fix[fix.index("--training.output_dir") + 1])
    assert new_dir != out and (new_dir / "checkpoint-10" / "trainer_state.json").is_file()

    # the same resume into the run's own directory is refused, before anything loads
    assert main([*run, "--training.resume_from_checkpoint", "true", "--training.resume_weights_only", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "starts again at step 0" in err, err
    assert f"--training.output_dir {new_dir}" not in err and f"--training.output_dir {out}_" in err
    assert files_under(out) == before
