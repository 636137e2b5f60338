"""The GraceAdam core's own torch-free test driver (csrc/grace_adam/selftest.cpp).

csrc/grace_adam/run_selftest.sh builds it natively and, when the cross tools exist, for aarch64,
and runs it: natively (every ISA this CPU has), and under qemu with SVE at 128 bits (Grace),
512 bits, and SVE off (NEON only). Each run checks step and rollback against a float64 loop,
every ISA path bitwise against the scalar one, the bf16/fp16 outputs, the sum of squares, the
gradient conversions (grad_copy / grad_accumulate of fp32, bf16 and fp16 sources), and the
compact-state step (every path bitwise against the scalar one);
it exits non-zero on any failure. These tests run the script once and read each run's report.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from superoffload_hf.host import kernel

# Builds two programs and runs four (three under qemu): ~45 s of CPU, ~30 s on an idle 2-core box.
# The builds are cached with the kernel's (SELFTEST_CACHE_DIR, keyed by compiler, flags and
# sources): a later run with the same sources only runs them.
pytestmark = pytest.mark.slow

GRACE_ADAM_DIR = Path(__file__).resolve().parents[2] / "csrc" / "grace_adam"
SCRIPT = GRACE_ADAM_DIR / "run_selftest.sh"
SUMMARY = re.compile(r"GraceAdam selftest \(([a-z0-9,]+)\): (\d+) passed, (\d+) failed")
QEMU_RUNS = {  # run label in run_selftest.sh -> the ISAs that run must test
    "qemu_max_sve128_on": "scalar,neon,sve",
    "qemu_max_sve512_on": "scalar,neon,sve",
    "qemu_max_sve_off": "scalar,neon",
}
CROSS_TOOLS = {
    "aarch64-linux-gnu-g++": "apt-get install g++-aarch64-linux-gnu",
    "qemu-aarch64": "apt-get install qemu-user",
}


def _native_compiler() -> str:
    return os.environ.get("CXX", "g++")


def _missing_cross_tools() -> list[str]:
    return [f"`{tool}` ({hint})" for tool, hint in CROSS_TOOLS.items() if shutil.which(tool) is None]


@pytest.fixture(scope="module")
def selftest_runs(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Runs run_selftest.sh once (builds, then all runs in parallel); returns its build dir."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed; run_selftest.sh needs it")
    build = tmp_path_factory.mktemp("grace_adam_selftest")
    env = dict(os.environ)
    env.setdefault("SELFTEST_CACHE_DIR", str(kernel.cache_root() / "selftest"))
    if shutil.which(_native_compiler()) is None:
        env["SELFTEST_SKIP_NATIVE"] = "1"
    proc = subprocess.run(["bash", str(SCRIPT), str(build)], capture_output=True, text=True, env=env, timeout=540)
    return build, proc


def _run_report(build: Path, proc: subprocess.CompletedProcess, label: str) -> tuple[int, str]:
    log, rc = build / f"{label}.log", build / f"{label}.rc"
    if not (log.exists() and rc.exists()):
        pytest.fail(f"run_selftest.sh produced no `{label}` run (a build failed?); its output:\n{proc.stdout}\n{proc.stderr}")
    return int(rc.read_text()), log.read_text()


def _assert_run_passed(build: Path, proc: subprocess.CompletedProcess, label: str, isas: str | None) -> None:
    rc, text = _run_report(build, proc, label)
    summary = SUMMARY.search(text)
    assert summary is not None, f"`{label}` printed no summary line; its output ends:\n{text[-3000:]}"
    tested, passed, failed = summary.group(1), int(summary.group(2)), int(summary.group(3))
    failures = "\n".join(line for line in text.splitlines() if line.startswith("FAIL"))
    assert rc == 0 and failed == 0, f"`{label}` failed (exit {rc}, {failed} failed checks):\n{failures}"
    assert passed > 10_000, f"`{label}` passed only {passed} checks; the driver ran far less than it should"
    if isas is not None:
        assert tested == isas, f"`{label}` tested ISAs {tested}, expected {isas}"


def test_native_selftest_passes_for_every_isa_of_this_cpu(selftest_runs):
    if shutil.which(_native_compiler()) is None:
        pytest.skip(f"no C++ compiler `{_native_compiler()}` on PATH (set CXX to use another)")
    build, proc = selftest_runs
    _assert_run_passed(build, proc, "native", None)


@pytest.mark.parametrize("label", sorted(QEMU_RUNS))
def test_aarch64_selftest_passes_under_qemu(selftest_runs, label):
    missing = _missing_cross_tools()
    if missing:
        pytest.skip("aarch64 runs need " + " and ".join(missing))
    build, proc = selftest_runs
    _assert_run_passed(build, proc, label, QEMU_RUNS[label])


def _passed_by_path(report: str, kind: str) -> dict[str, int]:
    """{path: passed count} of one check kind in a driver report."""
    passed, path = {}, None
    for line in report.splitlines():
        if re.fullmatch(r"\[[^\]]+\]", line):
            path = line[1:-1]
        row = re.fullmatch(r"  (.+?)\s+(\d+) passed\s+\d+ failed", line)
        if path is not None and row and row.group(1) == kind:
            passed[path] = int(row.group(2))
    return passed


@pytest.mark.parametrize("label", ["native", *sorted(QEMU_RUNS)])
def test_every_isa_path_runs_the_compact_step_checks(selftest_runs, label):
    # the compact-state kernels (NEON, SVE at 128 and 512 bits under qemu) against the scalar path
    if label == "native" and shutil.which(_native_compiler()) is None:
        pytest.skip(f"no C++ compiler `{_native_compiler()}` on PATH (set CXX to use another)")
    if label != "native" and _missing_cross_tools():
        pytest.skip("aarch64 runs need " + " and ".join(_missing_cross_tools()))
    build, proc = selftest_runs
    _, text = _run_report(build, proc, label)
    passed = _passed_by_path(text, "compact bitwise == scalar")
    isas = QEMU_RUNS[label].split(",") if label != "native" else [p for p in passed if "(" not in p]
    for isa in isas:
        assert passed.get(isa, 0) > 100, f"`{label}`: path {isa} ran {passed.get(isa, 0)} compact checks: {passed}"
    assert _passed_by_path(text, "compact format properties").get("scalar", 0) > 100


def test_run_selftest_script_exits_zero_when_every_run_passes(selftest_runs):
    if shutil.which(_native_compiler()) is None and _missing_cross_tools():
        pytest.skip(f"nothing to run: no `{_native_compiler()}` and no aarch64 tools")
    _, proc = selftest_runs
    assert proc.returncode == 0, f"run_selftest.sh exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert "all runs passed" in proc.stdout.splitlines()[-1]


def _failed_by_path(report: str) -> dict[str, dict[str, int]]:
    """The per-path tables of a driver report: {path: {check kind: failed count}}."""
    tables: dict[str, dict[str, int]] = {}
    path = None
    for line in report.splitlines():
        if re.fullmatch(r"\[[^\]]+\]", line):
            path = line[1:-1]
            tables[path] = {}
        row = re.fullmatch(r"  (.+?)\s+\d+ passed\s+(\d+) failed", line)
        if path is not None and row:
            tables[path][row.group(1)] = int(row.group(2))
    return tables


def test_selftest_exits_nonzero_when_a_path_is_wrong(selftest_runs):
    if shutil.which(_native_compiler()) is None:
        pytest.skip(f"no C++ compiler `{_native_compiler()}` on PATH (set CXX to use another)")
    build, proc = selftest_runs
    binary = build / "selftest_native"
    if not binary.exists():
        pytest.fail(f"run_selftest.sh built no native driver; its output:\n{proc.stdout}\n{proc.stderr}")
    run = subprocess.run([str(binary), "--quick", "--inject-fault"], capture_output=True, text=True, timeout=300)
    summary = SUMMARY.search(run.stdout)
    assert run.returncode == 1 and summary is not None and int(summary.group(3)) > 0, run.stdout[-3000:]
    tables = _failed_by_path(run.stdout)
    faulty = tables.pop("faulty(scalar)")
    for kind in ("step bitwise == scalar", "rollback bitwise == scalar", "guards untouched", "sum_squares bitwise == scalar",
                 "grad bitwise == spec", "compact bitwise == scalar"):
        assert faulty.get(kind, 0) > 0, f"the planted fault was not reported as `{kind}`: {faulty}"
    assert "scalar" in tables and all(
        failed == 0 for kinds in tables.values() for failed in kinds.values()
    ), f"paths without a planted fault failed: {tables}"
