"""benchmarks/gpu_check.sh --rehearse: the GPU check's stages with the CPU as the device and the
simulated device, so the script cannot rot. One run, with one stage made to fail
(GPU_CHECK_FAIL_STAGE): the script must exit non-zero, say which stage failed, and still run and
report the stages after it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["env", "gpu_tests", "gpu_tests_sanitizer", "train_llama", "host_adam", "link"]
# (script, its budget variable, its stages in order): both prepared runs plan their 9 minutes
SCRIPTS = [("gpu_check.sh", "GPU_CHECK_BUDGET_S", STAGES), ("gpu_peers.sh", "GPU_PEERS_BUDGET_S", ["install", "peers", "e2e"])]


def _plan(budget=None, tmp_path=None, script="gpu_check.sh", var="GPU_CHECK_BUDGET_S"):
    env = {k: v for k, v in os.environ.items() if k != var}
    if budget is not None:
        env[var] = str(budget)
    if tmp_path is not None:
        env["OUT"] = str(tmp_path / "out")
    return subprocess.run(["bash", str(ROOT / "benchmarks" / script), "--plan"], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script, var, stages", SCRIPTS, ids=[s for s, _, _ in SCRIPTS])
def test_the_gpu_plan_gives_every_stage_its_cap_within_nine_minutes_in_order_of_value(script, var, stages):
    proc = _plan(script=script, var=var)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = re.fullmatch(r"plan: (.*) s, \+ (\d+) s kill grace per stage \+ (\d+) s reserve = (\d+) s of a (\d+) s "
                        r"budget", proc.stdout.strip())
    assert plan, proc.stdout
    caps = [(name, int(cap)) for name, cap in (part.split() for part in plan[1].split(" + "))]
    grace, reserve, total, budget = (int(plan[i]) for i in range(2, 6))
    assert [name for name, _ in caps] == stages and budget == 540  # the order of value; 9 minutes
    assert total == sum(cap + grace for _, cap in caps) + reserve <= budget
    assert all(cap >= 20 for _, cap in caps)


@pytest.mark.parametrize("script, var, stages", SCRIPTS, ids=[s for s, _, _ in SCRIPTS])
def test_a_plan_over_its_budget_is_refused_before_any_stage_runs(tmp_path, script, var, stages):
    proc = _plan(budget=300, tmp_path=tmp_path, script=script, var=var)
    assert proc.returncode == 2
    assert re.search(r"plan does not fit: \d+ s > 300 s", proc.stderr), proc.stderr
    assert var in proc.stderr and script in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_rehearsal_runs_every_stage_writes_every_result_and_fails_on_a_failed_stage(tmp_path):
    out = tmp_path / "out"
    # python3 must be this interpreter (the script calls python3, as the GPU machine has no `python`)
    env = dict(os.environ, OUT=str(out), GPU_CHECK_FAIL_STAGE="host_adam", GPU_CHECK_BUDGET_S="400",
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--rehearse"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=410)
    assert proc.returncode != 0, proc.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "rehearse" and summary["passed"] is False
    assert [s["stage"] for s in summary["stages"]] == STAGES
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    assert status == {**{s: "ok" for s in STAGES}, "host_adam": "failed"}, (status, proc.stdout[-3000:])
    for stage in STAGES:
        assert (out / f"{stage}.log").is_file()
        assert f"- {stage}: {status[stage]}" in (out / "summary.md").read_text()
    results = json.loads((out / "train_llama" / "results.json").read_text())["results"]
    assert {(r["speculation"], r["max_grad_norm"]) for r in results} == {(m, t) for m in ("on", "off")
                                                                          for t in (1.0, 1e3)}
    assert all(r["tokens_per_second"] > 0 and "predicted_host_gib" in r and "mfu" in r for r in results)
    assert (out / "train_llama" / "timeline" / "trace.json").is_file()
    assert "passed" in (out / "gpu_tests.log").read_text()
    assert (out / "gpu_tests.xml").is_file()
    link = json.loads((out / "link.json").read_text())
    assert link
    assert "gpu_check (rehearse): FAILED" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_peers_rehearsal_runs_e2e_with_whichever_peers_import(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out),
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_peers.sh"), "--rehearse"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["peers", "e2e"] and summary["passed"] is True
    rows = json.loads((out / "e2e.json").read_text())["rows"]
    assert any(r["contender"].startswith("superoffload") and r["status"] == "ok" for r in rows)
    assert "| contender |" in (out / "summary.md").read_text()
