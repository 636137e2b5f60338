"""`superoffload train` and its output directory: another run's checkpoints are never touched
unless asked, and a directory that cannot be written is refused before anything loads."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from superoffload_hf import cli
from superoffload_hf.cli import main
from superoffload_hf.train.recipe import read_recipe_yaml

REPO = Path(__file__).resolve().parents[1]
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
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [shlex.split(line)[2:] for line in lines if line.startswith("superoffload train recipes/")]


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
