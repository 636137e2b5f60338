"""The suite does not depend on the checkout's state: the main job's `out/tiny_llama_cpu`, left in
the checkout by `superoffload train recipes/tiny_llama_cpu.yaml`, changes no result."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_each_test_starts_in_an_empty_directory_outside_the_checkout():
    cwd = Path.cwd()
    assert REPO != cwd and REPO not in cwd.parents, cwd
    assert not any(cwd.iterdir()), sorted(cwd.iterdir())

