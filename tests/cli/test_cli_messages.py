"""Small things a newcomer trips over in the CLI's messages (issue 18, item 10)."""

from __future__ import annotations

from pathlib import Path

import pytest

from superoffload_hf.cli import main
from superoffload_hf.config import ConfigError, SuperOffloadConfig

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_llama_cpu.yaml")


@pytest.mark.parametrize("override, key", [
    (["--training.learning_rat", "1e-3"], "training.learning_rat"),
    (["--superoffload.host_thread", "2"], "superoffload.host_thread"),
])
def test_a_key_typo_on_the_command_line_is_blamed_on_the_command_line(override, key, capsys):
    assert main(["train", TINY, *override, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("superoffload train: error: on the command line") and key in err, err
    assert TINY not in err


def test_a_key_typo_in_the_file_is_still_blamed_on_the_file(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {TINY}\ntraining:\n  learning_rat: 0.001\n")
    assert main(["train", str(recipe), "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(f"superoffload train: error: {recipe}: Unknown key `training.learning_rat`")


def test_a_superoffload_key_typo_gets_a_did_you_mean(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"Did you mean `host_threads` for `host_thread`\?"):
        SuperOffloadConfig.from_dict({"host_thread": 2})
    # the same from each place a `superoffload:` block is written: the command line, a recipe file
    assert main(["train", TINY, "--superoffload.host_thread", "2", "--dry-run"]) == 2
    assert "Did you mean `host_threads` for `host_thread`?" in capsys.readouterr().err
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {TINY}\nsuperoffload:\n  speculaton: on\n")
    assert main(["train", str(recipe), "--dry-run"]) == 2
    assert "Did you mean `speculation` for `speculaton`?" in capsys.readouterr().err


def test_export_optimizer_help_prints_its_usage_and_succeeds(capsys):
    assert main(["export-optimizer", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: superoffload export-optimizer CHECKPOINT_DIR OUT.pt")
    assert main(["export-optimizer"]) == 2


STOCK = str(REPO / "recipes" / "tiny_llama_cpu_stock.yaml")


@pytest.mark.parametrize("key, value, choice", [
    ("training.optim", "maybe", "'adamw_torch'"),  # was one 861-character line, after loading
    ("training.optim", "adamw_trch", "'adamw_torch'"),
    ("training.lr_scheduler_type", "cosine_with_restart", "'cosine_with_restarts'"),
    ("training.save_strategy", "maybe", "'no', 'steps', 'epoch', 'best'"),
    ("training.eval_strategy", "sometimes", "'no', 'steps', 'epoch'"),
])
def test_a_bad_choice_is_refused_before_loading_in_one_short_line(key, value, choice, capsys, monkeypatch):
    from superoffload_hf import cli

    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
    for argv in (["--dry-run"], []):
        assert main(["train", STOCK, f"--{key}", value, *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and len(err) <= 200, (len(err), err)
        assert f"`{key}` is {value!r}; expected one of " in err and choice in err, err


def test_an_unknown_training_key_is_one_short_line(capsys):
    assert main(["train", TINY, "--training.mixed_precison", "bf16", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) <= 210, (len(err), err)
    assert "Unknown key `training.mixed_precison`" in err and "superoffload train --help" in err, err


@pytest.mark.parametrize("where", ["command line", "recipe file"])
def test_a_bad_recipe_key_is_reported_before_torch_and_transformers_load(where, tmp_path):
    # A fresh interpreter: this one has torch loaded already. Before, the report came after the
    # ~3-10 s import of transformers (the training keys were read from TrainingArguments).
    import subprocess
    import sys

    recipe, extra = TINY, ["--training.bogus_key", "1"]
    if where == "recipe file":
        recipe, extra = str(tmp_path / "r.yaml"), []
        Path(recipe).write_text(f"base: {TINY}\ntraining:\n  bogus_key: 1\n")
    code = ("import sys; from superoffload_hf.cli import main; "
            f"rc = main(['train', {recipe!r}, *{extra!r}]); "
            "print(rc, sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.stdout.strip() == "2 []", (done.stdout, done.stderr)
    blamed = "on the command line" if where == "command line" else recipe
    assert done.stderr.startswith(f"superoffload train: error: {blamed}: Unknown key `training.bogus_key`"), done.stderr


def test_the_training_keys_read_without_transformers_are_the_training_arguments_fields():
    import dataclasses

    from superoffload_hf.integrations.trainer import TrainingArguments
    from superoffload_hf.train.schema import training_argument_names

    assert training_argument_names() == frozenset(f.name for f in dataclasses.fields(TrainingArguments) if f.init)
