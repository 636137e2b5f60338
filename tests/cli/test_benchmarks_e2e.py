"""benchmarks/e2e.py --smoke: a table with a row for every contender, clipped and not, our rows
measured, every missing row saying why; in well under a minute on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTENDERS = ("superoffload (speculation auto)", "superoffload (speculation off)", "torch AdamW (all on device)",
              "torchao CPUOffloadOptimizer", "DeepSpeed ZeRO-2 offload", "DeepSpeed ZeRO-3 offload",
              "DeepSpeed SuperOffload")


@pytest.mark.timeout(120)
def test_e2e_smoke_table_has_every_contender_and_a_reason_for_each_missing_one(tmp_path):
    out = tmp_path / "e2e.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--smoke", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < 60
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * len(CONTENDERS)
    assert {(r["contender"], r["clip"]) for r in rows} == {(c, clip) for c in CONTENDERS for clip in (1.0, None)}
    for r in rows:
        assert r["contender"] in proc.stdout
        if r["status"] == "ok":
            assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["peak_host_gib"] > 0
            assert r["final_loss"] == pytest.approx(r["final_loss"])  # finite, not NaN
        else:
            assert r["status"] == "missing" and r["reason"], r
            assert r["reason"] in proc.stdout
    ours = [r for r in rows if r["contender"].startswith("superoffload")]
    assert all(r["status"] == "ok" and 0.0 <= r["device_idle"] <= 1.0 for r in ours)
    assert next(r for r in rows if r["contender"] == "torch AdamW (all on device)")["status"] == "ok"
    targets = json.loads(out.read_text())["targets"]
    assert any("ZeRO-Offload" in t["target"] for t in targets)


def test_e2e_rejects_an_unknown_contender():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--smoke", "--contenders", "ours,x"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "ours-auto" in proc.stderr
