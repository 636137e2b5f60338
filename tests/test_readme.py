"""The README tells a new user what they need, once, and agrees with the recipes."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}")
    return README[start:README.index("\n## ", start + 1)]


def test_install_says_to_clone_cd_and_use_a_virtual_environment_and_which_torch_build():
    install = section("Install")
    assert re.search(r"git clone .*&& cd superoffload_hf", install)
    assert "python3 -m venv .venv && . .venv/bin/activate" in install
    assert "--index-url https://download.pytorch.org/whl/cpu" in install
    assert "CUDA build" in install and "whl/cu" in install
    assert "pip install ." in install or "`pip install .`" in install


def test_the_first_run_build_time_is_next_to_about_a_minute():
    assert "about a minute (plus ~40 s the very first time, to build the\nhost Adam kernel)" in README


def test_readme_and_tiny_recipe_quote_the_same_measurements():
    header = (REPO / "recipes" / "tiny_llama_cpu.yaml").read_text().split("\nmodel:")[0]
    figures = re.findall(r"(\d+) s wall in all, (\d+) s of it training \(~?([\d,]+) tokens/s", header)
    assert figures, header
    for wall, training, rate in figures:
        assert f"({wall} s wall, {training} s of" in README and f"tokens/s       {rate}" in README


def test_no_stale_advice_to_quote_on_and_off():
    assert "unquoted, YAML reads them as booleans" not in README


def test_what_resuming_a_finished_cosine_schedule_with_more_steps_does_is_stated():
    assert "--training.max_steps 400 --training.resume_from_checkpoint true` after the 300-step" in README
    assert "jumps from 0 back to 4.7e-4" in README
