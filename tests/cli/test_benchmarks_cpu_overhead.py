"""benchmarks/cpu_overhead.py runs both contenders, reports the ratio, and checks the same math."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_cpu_overhead_reports_the_ratio_of_ours_to_torch_adamw(tmp_path):
    out = tmp_path / "cpu.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_overhead.py"), "--models", "tiny-recipe",
                           "--steps", "3", "--warmup", "1", "--no-check", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["model"] == "tiny-recipe" and 1.2e6 < result["params"] < 1.5e6
    assert result["ours_ms"] > 0 and result["torch_ms"] > 0
    assert result["ratio_of_medians"] == pytest.approx(result["ours_ms"] / result["torch_ms"])
    assert len(result["step_ms"]) == 3  # the ratio is the median of the steps' paired ratios
    assert result["ratio"] == pytest.approx(sorted(o / t for o, t in result["step_ms"])[1])
    assert result["loss_rel_diff"] < 1e-3  # the same math on both sides
    assert "| tiny-recipe |" in proc.stdout and "ours / torch" in proc.stdout


def _cpu_overhead():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cpu_overhead
    finally:
        sys.path.pop(0)
    return cpu_overhead


def _spinners() -> int:
    """Children of this process running the benchmark's spin loop now (other sessions' spin
    loops on the same machine are not counted)."""
    cpu_overhead = _cpu_overhead()
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        count += cpu_overhead.SPIN_LOOP.encode() in cmdline and parent == os.getpid()
    return count


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="counts processes through /proc")
def test_recipe_mode_alternates_ours_and_stock_idle_then_beside_its_own_busy_processes(capsys):
    cpu_overhead = _cpu_overhead()
    args = cpu_overhead.parse_args(["--recipe", "--load", "2", "--rounds", "3", "--recipe-steps", "7"])
    calls = []
    tokens = {("idle", True): [950, 1000, 900], ("idle", False): [1000, 1000, 1000],
              ("loaded", True): [400, 880, 900], ("loaded", False): [1000, 1000, 1000]}

    def fake_run(ours, steps, out_dir):
        phase = "loaded" if "loaded" in os.path.basename(out_dir) else "idle"
        calls.append((phase, ours, steps, _spinners()))
        return tokens[(phase, ours)][sum(c[:2] == (phase, ours) for c in calls) - 1]

    assert cpu_overhead.recipe_main(args, run=fake_run) == 2  # loaded: median 0.88 < 0.9
    assert calls == [("idle", True, 7, 0), ("idle", False, 7, 0), ("idle", False, 7, 0), ("idle", True, 7, 0),
                     ("idle", True, 7, 0), ("idle", False, 7, 0),
                     ("loaded", True, 7, 2), ("loaded", False, 7, 2), ("loaded", False, 7, 2), ("loaded", True, 7, 2),
                     ("loaded", True, 7, 2), ("loaded", False, 7, 2)]
    assert _spinners() == 0  # the load ends with its phase
    out, err = capsys.readouterr()
    assert "| idle | 0.950x | MISSED (>= 0.952x) |" in out  # 0.95 < 1 / 1.05
    assert "| loaded | 0.880x | MISSED (>= 0.900x) |" in out
    assert "TARGET MISSED: loaded" in err and "TARGET MISSED: idle" in err
    args.no_check = True
    calls.clear()
    assert cpu_overhead.recipe_main(args, run=fake_run) == 0


def test_recipe_mode_passes_when_both_targets_are_met():
    cpu_overhead = _cpu_overhead()
    args = cpu_overhead.parse_args(["--recipe", "--load", "1", "--rounds", "1"])
    assert cpu_overhead.recipe_main(args, run=lambda ours, steps, out: 960 if ours else 1000) == 0


def test_recipe_tokens_per_second_reads_the_train_summary():
    cpu_overhead = _cpu_overhead()
    summary = "superoffload train: done\n  steps          40 (global step 40), 40,960 tokens in 33.4 s\n  tokens/s       1,225\n"
    assert cpu_overhead.recipe_tokens_per_second(summary) == 1225.0
    with pytest.raises(RuntimeError, match="no `tokens/s` line"):
        cpu_overhead.recipe_tokens_per_second("Traceback ...")
