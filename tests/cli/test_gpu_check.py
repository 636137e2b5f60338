"""benchmarks/gpu_check.sh --rehearse: the GPU check's stages with the CPU as the device and the
simulated device, so the script cannot rot. One run, with one stage made to miss its target
(GPU_CHECK_FAIL_STAGE): the script must exit non-zero, say which stage failed, and still run and
report the stages after it; it must leave at most 8 files (what comes back from the GPU machine),
the summary everything else is in, and print the summary last."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FEATURES = ["flow", "activation_offload", "tiling", "compact", "trainer"]  # benchmarks/gpu_features.py
STAGES = ["env", "gpu_tests", "train_llama", *FEATURES, "sanitizer", "host_adam", "link"]
# (script, its budget variable, its stages in order, its budget): the GPU check plans 8 minutes (a
# rerun of its failed stages must fit the 15 a machine is lent), the peers' run 9
SCRIPTS = [("gpu_check.sh", "GPU_CHECK_BUDGET_S", STAGES, 480),
           ("gpu_peers.sh", "GPU_PEERS_BUDGET_S", ["install", "peers", "e2e"], 540)]
FILES_BACK = 8  # at most this many files come back from the GPU machine, at most two folders down


def _plan(budget=None, tmp_path=None, script="gpu_check.sh", var="GPU_CHECK_BUDGET_S", stages=None):
    env = {k: v for k, v in os.environ.items() if k not in (var, "GPU_CHECK_STAGES")}
    if budget is not None:
        env[var] = str(budget)
    if stages is not None:
        env["GPU_CHECK_STAGES"] = stages
    if tmp_path is not None:
        env["OUT"] = str(tmp_path / "out")
    return subprocess.run(["bash", str(ROOT / "benchmarks" / script), "--plan"], env=env,
                          capture_output=True, text=True, timeout=60)


def _parse_plan(stdout):
    plan = re.fullmatch(r"plan: (.*) s, \+ (\d+) s kill grace per stage \+ (\d+) s reserve = (\d+) s of a (\d+) s "
                        r"budget", stdout.strip())
    assert plan, stdout
    return [(name, int(cap)) for name, cap in (part.split() for part in plan[1].split(" + "))], plan


@pytest.mark.parametrize("script, var, stages, minutes", SCRIPTS, ids=[s for s, _, _, _ in SCRIPTS])
def test_the_gpu_plan_gives_every_stage_its_cap_within_its_minutes_in_order_of_value(script, var, stages, minutes):
    proc = _plan(script=script, var=var)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    caps, plan = _parse_plan(proc.stdout)
    grace, reserve, total, budget = (int(plan[i]) for i in range(2, 6))
    assert [name for name, _ in caps] == stages and budget == minutes  # the order of value
    assert total == sum(cap + grace for _, cap in caps) + reserve <= budget
    assert all(cap >= 20 for _, cap in caps)


@pytest.mark.parametrize("script, var, stages, minutes", SCRIPTS, ids=[s for s, _, _, _ in SCRIPTS])
def test_a_plan_over_its_budget_is_refused_before_any_stage_runs(tmp_path, script, var, stages, minutes):
    proc = _plan(budget=300, tmp_path=tmp_path, script=script, var=var)
    assert proc.returncode == 2
    assert re.search(r"plan does not fit: \d+ s > 300 s", proc.stderr), proc.stderr
    assert var in proc.stderr and script in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_rerun_of_chosen_stages_plans_only_them_and_an_unknown_stage_is_refused(tmp_path):
    proc = _plan(stages="train_llama,env")
    assert proc.returncode == 0, proc.stderr
    assert [name for name, _ in _parse_plan(proc.stdout)[0]] == ["env", "train_llama"]
    proc = _plan(stages="env,trian_llama", tmp_path=tmp_path)
    assert proc.returncode == 2
    assert "unknown stage 'trian_llama' in GPU_CHECK_STAGES=env,trian_llama" in proc.stderr
    assert "train_llama" in proc.stderr.split("expected", 1)[1] and not (tmp_path / "out").exists()


def _rehearse(tmp_path, timeout, **env_vars):
    out = tmp_path / "out"
    # python3 must be this interpreter (the script calls python3, as the GPU machine has no `python`)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env.update(OUT=str(out), PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""), **env_vars)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--rehearse"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=timeout)
    return proc, out


def _files_back(out: Path) -> list[str]:
    """What the GPU machine would return: every file under out, checked against its limits."""
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert len(files) <= FILES_BACK and all(f.count("/") <= 2 for f in files), files
    return files


def _evidence(out: Path, tmp_path: Path) -> Path:
    unpacked = tmp_path / "evidence"
    with tarfile.open(out / "evidence.tar.gz") as archive:
        archive.extractall(unpacked, filter="data")
    return unpacked


def test_a_rerun_of_one_stage_runs_it_alone_and_reports_its_failure_last(tmp_path):
    proc, out = _rehearse(tmp_path, 60, GPU_CHECK_STAGES="link", GPU_CHECK_FAIL_STAGE="link")
    assert proc.returncode != 0
    assert _files_back(out) == ["evidence.tar.gz", "summary.json", "summary.md"]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["link"] and summary["selected"] == "link"
    assert summary["problems"] == ["link: failed (exit 1)"]
    assert (_evidence(out, tmp_path) / "link.log").is_file()
    summary_md = (out / "summary.md").read_text()
    assert proc.stdout.rstrip().endswith(summary_md.rstrip())  # the summary is the last lines of stdout
    assert "Failed stages and missed targets:\n- link: failed (exit 1)" in summary_md


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_rehearsal_runs_every_stage_brings_back_every_result_and_fails_on_a_missed_target(tmp_path):
    proc, out = _rehearse(tmp_path, 410, GPU_CHECK_FAIL_STAGE="host_adam:2", GPU_CHECK_BUDGET_S="400")
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert _files_back(out) == ["evidence.tar.gz", "summary.json", "summary.md"]
    evidence = _evidence(out, tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "rehearse" and summary["passed"] is False
    assert [s["stage"] for s in summary["stages"]] == STAGES
    status = {s["stage"]: s["status"] for s in summary["stages"]}
    assert status == {**{s: "ok" for s in STAGES}, "host_adam": "missed target"}, (status, proc.stdout[-3000:])
    assert summary["problems"] == ["host_adam: missed target: FAIL: forced by GPU_CHECK_FAIL_STAGE=host_adam:2"]
    summary_md = (out / "summary.md").read_text()
    for stage in STAGES:
        assert (evidence / f"{stage}.log").is_file()
        assert f"- {stage}: {status[stage]}" in summary_md
    assert proc.stdout.rstrip().endswith(summary_md.rstrip())
    assert "Failed stages and missed targets:\n- host_adam: missed target" in summary_md
    results = json.loads((evidence / "train_llama" / "results.json").read_text())["results"]
    assert {(r["speculation"], r["max_grad_norm"]) for r in results} == {(m, t) for m in ("on", "off")
                                                                          for t in (1.0, 1e3)}
    assert all(r["tokens_per_second"] > 0 and "predicted_host_gib" in r and "mfu" in r for r in results)
    # the kernel that ran is GraceAdam (host_kernel: cpp), named in the summary
    assert all(r["host_adam"].startswith("host Adam: cpp") for r in results), results[0]["host_adam"]
    assert "host Adam cpp/" in summary_md
    assert (evidence / "train_llama" / "timeline" / "trace.json").is_file()
    # each feature ran its steps on the simulated device and matched its CPU reference
    for feature in FEATURES:
        result = json.loads((evidence / "features" / f"{feature}.json").read_text())
        assert result["passed"] and result["problems"] == [], result
        assert result["device"] == "cpu (simulated)" and result["steps_ran"] == result["reference_steps_ran"] == 3
        assert len(result["losses"]) == 3 and result["host_adam"].startswith("host Adam cpp/")
        assert re.search(rf"  - {feature}: 3 steps ran on cpu \(simulated\) .* max \|diff\| from the CPU reference "
                         r".*tokens/s, device idle .* peak device .* \(dry run's state .*: PASSED", summary_md), feature
    sanitized = json.loads((evidence / "sanitizer" / "activation_offload.json").read_text())
    assert sanitized["passed"] and sanitized["steps_ran"] == 3 and sanitized["reference_steps_ran"] is None
    assert "the sanitizer ran on: the features activation_offload without their CPU references (rehearsal" in summary_md
    # what the sanitizer stage took, against its cap and the plain stages of the same work
    took = re.search(r"It took (\d+)s of its (\d+)s limit \(cap \d+s; the plain stages, which run every GPU test "
                     r"and each feature with its CPU\n    reference: gpu_tests (\d+)s, activation_offload (\d+)s\)", summary_md)
    stage_s = {s["stage"]: (s["seconds"], s["limit_s"]) for s in summary["stages"]}
    assert took and (int(took[1]), int(took[2])) == stage_s["sanitizer"], summary_md
    assert (int(took[3]), int(took[4])) == (stage_s["gpu_tests"][0], stage_s["activation_offload"][0])
    assert "every entry into its handler holds one lock" in summary_md and "It does not see:" in summary_md
    assert "passed" in (evidence / "gpu_tests.log").read_text()
    assert (evidence / "gpu_tests.xml").is_file()
    assert json.loads((evidence / "link.json").read_text())
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
    _files_back(out)
    rows = json.loads((_evidence(out, tmp_path) / "e2e.json").read_text())["rows"]
    assert any(r["contender"].startswith("superoffload") and r["status"] == "ok" for r in rows)
    assert "| contender |" in (out / "summary.md").read_text()
