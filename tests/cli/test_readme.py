"""The README tells a new user what they need, once, and agrees with the recipes."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


def test_the_first_kernel_build_time_is_stated_for_a_quiet_and_a_busy_machine():
    assert "about a minute (plus the kernel's first build, 40-90 s: see\n\"Install\")" in README
    assert "~40 s on 2 quiet cores, 84-107 s on 2 busy ones" in " ".join(section("Install").split())


def test_two_commands_from_a_fresh_clone_and_ci_runs_the_readmes_test_command():
    """`./dev train` sets up and runs the main job, `./dev test` sets up and runs the tests; .ci/run
    runs exactly the Tests section's command."""
    quick = blocks("bash")[0].splitlines()
    assert quick[1:] == ["./dev train     # first use sets up .venv (torch + this package), then runs the main job below",
                         "./dev test      # the same set-up, then the tests (what .ci/run runs)"], quick
    test_command = shlex.split(section("Tests").split("```bash\n")[1].split("```")[0], comments=True)
    assert test_command == ["./dev", "test"]
    ci = [shlex.split(line, comments=True) for line in (REPO / ".ci" / "run").read_text().replace("\\\n", " ").splitlines()]
    assert test_command in ci, ci
    dev = (REPO / "dev").read_text()
    assert os.access(REPO / "dev", os.X_OK) and dev.startswith("#!/bin/sh\n")
    assert "set -- recipes/tiny_llama_cpu.yaml" in dev  # the main job, as "The main job" shows it
    assert shown_commands("superoffload")[0] == ["train", "recipes/tiny_llama_cpu.yaml"]


def test_the_oldest_ci_pass_pins_the_lower_bounds_of_pyproject():
    import tomllib

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    lower = {d.split(">=")[0]: d.split(">=")[1].split(",")[0] for d in dependencies if d.startswith(("transformers", "accelerate"))}
    pins = re.search(r'DEV_PINS="([^"]+)"', (REPO / ".ci" / "run").read_text()).group(1).split()
    assert sorted(pins) == sorted(f"{name}=={version}.0" for name, version in lower.items()), (pins, lower)


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


# ---- the README runs as written ------------------------------------------------------------------

import os
import subprocess
import sys

from _readme import blocks, from_anywhere, shown_commands

# (the `superoffload launch` example runs in tests/integrations/test_launcher.py, with what it must show)


def test_the_readme_fits_on_a_screen_and_its_links_exist():
    assert len(README.splitlines()) <= 250, "README.md grew past ~250 lines: move detail into docs/"
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links
    for link in links:
        assert link.startswith("http") or (REPO / link).exists(), link


def test_the_train_commands_of_the_readme_run_in_order_and_lose_no_checkpoint(tmp_path, monkeypatch, capsys):
    """In a scratch directory, in the README's order: the main job for real (2 steps, so it is
    quick), every other `superoffload train` command validated as it would run (`--dry-run`:
    recipe, overrides, output directory, the checkpoint a resume needs, memory); the main job's
    checkpoint must survive them all."""
    from superoffload_hf import cli

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the real recipes name hub models: never the network here
    monkeypatch.chdir(tmp_path)
    trains = [c for c in shown_commands("superoffload") if c[:1] == ["train"]]
    assert trains[0] == ["train", "recipes/tiny_llama_cpu.yaml"] and len(trains) >= 5, trains
    for k, argv in enumerate(trains):
        argv = from_anywhere(argv)
        if k == 0:
            argv = argv + ["--training.max_steps", "2", "--training.save_steps", "2"]
        elif "--dry-run" not in argv:
            argv = argv + ["--dry-run"]
        assert cli.main(argv) == 0, (argv, capsys.readouterr())
    assert (tmp_path / "out" / "tiny_llama_cpu" / "checkpoint-2" / "trainer_state.json").is_file()


def test_every_python_example_of_the_readme_runs_on_the_cpu(tmp_path):
    examples = blocks("python")
    assert len(examples) == 2  # the Trainer and the plain loop
    # one child for both (one import of torch and transformers); each example in its own namespace
    script = "\n".join(f"exec(compile({code!r}, 'README example {k}', 'exec'), {{}})\nprint('example {k} ok')"
                       for k, code in enumerate(examples))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "example 0 ok" in run.stdout and "example 1 ok" in run.stdout, run.stdout[-2000:]
