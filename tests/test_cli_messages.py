"""Small things a newcomer trips over in the CLI's messages (issue 18, item 10)."""

from __future__ import annotations

from pathlib import Path

import pytest

from superoffload_hf.cli import main
from superoffload_hf.config import ConfigError, SuperOffloadConfig

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "recipes" / "tiny_llama_cpu.yaml")


@pytest.mark.parametrize("override, key", [
    (["--training.learning_rat", "1e-3"], "training.learning_rat"),
    (["--superoffload.host_thread", "2"], "superoffload.host_thread"),
])
def test_a_key_typo_on_the_command_line_is_blamed_on_the_command_line(override, key, capsys):
    assert main(["train", TINY, *override, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"superoffload train: error: on the command line, `--{key}`: "), err
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
