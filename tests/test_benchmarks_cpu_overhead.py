"""benchmarks/cpu_overhead.py runs both contenders, reports the ratio, and checks the same math."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
