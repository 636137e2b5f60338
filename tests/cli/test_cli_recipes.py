"""Recipes ship with the package: `superoffload train tiny_llama_cpu` by name from any directory,
`superoffload recipes` lists them, and an installed package finds its own copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from superoffload_hf.cli import main
from superoffload_hf.train import catalog

REPO = Path(__file__).resolve().parents[2]


def test_train_takes_a_shipped_recipe_by_name_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name in ("tiny_llama_cpu", "tiny_llama_cpu.yaml", "recipes/tiny_llama_cpu.yaml"):
        assert main(["train", name, "--dry-run", "--training.max_steps", "3"]) == 0, capsys.readouterr().err
        printed = yaml.safe_load(capsys.readouterr().out.split("\nmemory:")[0])
        assert printed["model"]["config"]["hidden_size"] == 128 and printed["training"]["max_steps"] == 3


def test_a_derived_shipped_recipe_finds_its_base_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny_llama_cpu_stock", "--dry-run"]) == 0, capsys.readouterr().err
    assert yaml.safe_load(capsys.readouterr().out.split("\nmemory:")[0])["superoffload"] is False


def test_a_user_recipe_derives_from_a_shipped_recipe_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("base: tiny_llama_cpu\ntraining:\n  max_steps: 7\n")
    assert main(["train", "mine.yaml", "--dry-run"]) == 0, capsys.readouterr().err
    printed = yaml.safe_load(capsys.readouterr().out.split("\nmemory:")[0])
    assert printed["model"]["config"]["hidden_size"] == 128 and printed["training"]["max_steps"] == 7


def test_recipes_lists_every_shipped_recipe_with_what_it_trains(capsys):
    assert main(["recipes"]) == 0
    printed = capsys.readouterr().out
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        assert f"  {path.stem} " in printed, printed
    assert "tiny_llama_cpu        A tiny Llama that trains on a 2-core CPU in about a minute" in printed, printed


def test_recipes_describes_each_recipe_in_a_whole_sentence(capsys):
    assert main(["recipes"]) == 0
    printed = capsys.readouterr().out
    for line in ("  llama-13b             A 13B Llama-style model (Llama-2-13B) on one GPU with SuperOffload.\n",
                 "  llama3.1-8b           Llama-3.1-8B, continued pretraining on one GPU with SuperOffload.\n",
                 "  tiny_llama_cpu        A tiny Llama that trains on a 2-core CPU in about a minute, with no network.\n",
                 "  tiny_llama_cpu_stock  The tiny recipe with the stock optimizer (torch AdamW, clip_grad_norm_ on "
                 "the model): the baseline to compare loss curves and speed with.\n"):
        assert line in printed, printed


def test_an_unknown_recipe_name_points_to_the_list(capsys):
    assert main(["train", "tiny_llama_gpu", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "'tiny_llama_gpu' does not exist" in err and "`superoffload recipes` lists them" in err


def test_an_installed_package_reads_the_recipes_copied_into_it(tmp_path, monkeypatch):
    package = tmp_path / "site" / "superoffload_hf"
    shutil.copytree(REPO / "recipes", package / "_recipes")  # what setup.py's build_py copies into a wheel
    monkeypatch.setattr(catalog, "PACKAGE_DIR", package)
    monkeypatch.chdir(tmp_path)
    assert catalog.resolve_recipe("tiny_llama_cpu") == package / "_recipes" / "tiny_llama_cpu.yaml"
    assert catalog.shipped_recipes().keys() == {p.stem for p in (REPO / "recipes").glob("*.yaml")}


def test_setup_copies_the_recipes_into_the_package():
    setup = (REPO / "setup.py").read_text()
    assert '"_recipes"' in setup and 'SHIPPED_RECIPES = ("*.yaml", "accelerate/*.yaml", "models/*/config.json")' in setup
    assert "recursive-include recipes *.yaml config.json" in (REPO / "MANIFEST.in").read_text()
    assert sorted(p.parent.name for p in (REPO / "recipes" / "models").glob("*/config.json")) == [
        "llama-2-13b", "llama-3.1-8b"]  # the dry run's architectures (catalog.shipped_model_dir)
