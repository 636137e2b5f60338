"""`superoffload train` with hub names and no network: one line naming what is missing and the
fix, before anything loads; a local directory with only config.json is enough for `--dry-run`.
Nothing here touches the network (HF_HUB_OFFLINE=1, or the network probe is replaced)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from superoffload_hf import cli
from superoffload_hf.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_llama_cpu.yaml")
HUB_NAME = "superoffload-tests/not-a-model"
FROM_HUB = ["--model.config", "null", "--model.name_or_path", HUB_NAME]


def test_an_uncached_hub_name_offline_fails_in_one_line_naming_hf_download(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "empty_hf_home"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-m", "superoffload_hf.cli", "train", TINY, *FROM_HUB,
                           "--training.output_dir", str(tmp_path / "out")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"superoffload train: error: `model.name_or_path` is '{HUB_NAME}', which "
                                  f"is not in the local hub cache ({tmp_path / 'empty_hf_home' / 'hub'}) and "
                                  "HF_HUB_OFFLINE is set."), proc.stderr
    assert f"`hf download {HUB_NAME}`" in proc.stderr and "a local directory" in proc.stderr


def test_an_uncached_hub_name_without_network_fails_in_one_line_before_loading(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    def no_network(address, timeout=None, *args, **kwargs):
        assert timeout is not None and timeout <= 5  # a probe, not a download with retries
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(cli, "train", lambda recipe: pytest.fail("train() ran"))
    assert main(["train", TINY, *FROM_HUB, "--training.output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "the hub (https://huggingface.co) cannot be reached: Network is unreachable." in err
    assert f"`hf download {HUB_NAME}`" in err


def test_a_cached_hub_name_needs_no_network(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "cache" / "models--superoffload-tests--not-a-model" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    ran = []
    monkeypatch.setattr(cli, "train", lambda recipe: ran.append(recipe) or pytest.skip("reached train()"))
    with pytest.raises(pytest.skip.Exception):
        main(["train", TINY, *FROM_HUB, "--training.output_dir", str(tmp_path / "out")])
    assert len(ran) == 1


def test_dry_run_of_a_directory_holding_only_config_json_prints_the_memory(tmp_path, capsys):
    from transformers import LlamaConfig

    model_dir = tmp_path / "model"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=1000).save_pretrained(model_dir)
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]
    assert main(["train", TINY, "--model.config", "null", "--model.name_or_path", str(model_dir),
                 "--tokenizer", "null", "--dry-run", "--training.output_dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "\nmemory: " in printed and "not estimated" not in printed, printed


def test_dry_run_of_an_uncached_hub_name_says_to_use_hf_download(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["train", TINY, *FROM_HUB, "--dry-run", "--training.output_dir", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert f"`hf download {HUB_NAME} config.json`" in printed and "huggingface-cli" not in printed
