"""Installed like a normal package (`pip install .`, a wheel, `pip install git+...`), superoffload_hf
carries the GraceAdam C++ sources and builds the kernel from them, not the reference fallback; and
that build, left as a killed build leaves it, is recovered by two concurrent loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What `pip install git+...` sees of the checkout (tests and benchmarks are not needed).
BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "superoffload_hf", "csrc", "recipes")

CHECK_INSTALLED = """
import sys, torch
import superoffload_hf
from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.host import kernel
site = sys.argv[1]
assert superoffload_hf.__file__.startswith(site), superoffload_hf.__file__
assert str(kernel.SOURCE_DIR).startswith(site), kernel.SOURCE_DIR
model = torch.nn.Linear(8, 4)
opt = SuperOffloadAdamW(model.parameters(), lr=1e-2, config={"host_kernel": "cpp", "device_dtype": "fp32"})
model(torch.ones(2, 8)).sum().backward()
opt.step()
print(opt.host_adam.name, opt.describe())
"""


def test_setup_copies_the_csrc_sources_into_the_package():
    setup = (REPO / "setup.py").read_text()
    assert '"_csrc" / "grace_adam"' in setup and "editable_mode" in setup
    assert "recursive-include csrc *.cpp *.h" in (REPO / "MANIFEST.in").read_text()
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["build-backend"] == "setuptools.build_meta"


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory):
    """A wheel built from a copy of the checkout, installed into a plain directory, and one process
    that imports it from there and steps with the cpp kernel, built into a fresh cache from the
    wheel's own sources. Shared by the tests below: the build (~50 s on 2 cores) is paid once."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "checkout"
    source.mkdir()
    for name in BUILD_INPUTS:
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__", "_csrc")}
                                            if (REPO / name).is_dir() else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp / "dist")], check=True, cwd=tmp, timeout=300)
    (wheel,) = (tmp / "dist").glob("superoffload_hf-*.whl")
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    proc = subprocess.run([sys.executable, "-c", CHECK_INSTALLED, str(site)], cwd=tmp,
                          env=installed_env(site, tmp / "cache"), capture_output=True, text=True, timeout=600)
    return {"tmp": tmp, "wheel": wheel, "site": site, "cache": tmp / "cache", "proc": proc}


def installed_env(site: Path, cache: Path) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "SUPEROFFLOAD_FORCE_REFERENCE")}
    env.update(PYTHONPATH=str(site), SUPEROFFLOAD_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_wheel_install_builds_the_kernel_from_its_own_sources(installed_wheel):
    names = zipfile.ZipFile(installed_wheel["wheel"]).namelist()
    for shipped in ("binding.cpp", "dispatch.cpp", "adam_scalar.cpp", "adam_avx2.cpp", "adam_neon.cpp",
                    "grace_adam.h", "thread_pool.h"):
        assert f"superoffload_hf/_csrc/grace_adam/{shipped}" in names, shipped
    for recipe in ("tiny_llama_cpu.yaml", "tiny_llama_cpu_stock.yaml", "accelerate/superoffload_cpu.yaml"):
        assert f"superoffload_hf/_recipes/{recipe}" in names, recipe
    proc = installed_wheel["proc"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("cpp "), proc.stdout
    assert "building the GraceAdam host Adam kernel" in proc.stderr  # built here, from the wheel's sources
    assert str(installed_wheel["cache"]) in proc.stderr
    # The shipped recipes, by name, from a directory that has no recipes/.
    site, tmp = installed_wheel["site"], installed_wheel["tmp"]
    env = installed_env(site, installed_wheel["cache"])
    listed = subprocess.run([sys.executable, "-m", "superoffload_hf.cli", "recipes"], cwd=tmp, env=env,
                            capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0 and f"(in {site / 'superoffload_hf' / '_recipes'})" in listed.stdout, listed
    dry = subprocess.run([sys.executable, "-m", "superoffload_hf.cli", "train", "tiny_llama_cpu", "--dry-run"],
                         cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0 and "\nmemory: " in dry.stdout, dry.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stale_torch_lock_file_does_not_hang_and_concurrent_loads_agree(installed_wheel, tmp_path):
    # A copy of a finished build with the state a killed build leaves: no completion marker, and
    # torch's `lock` baton still there (torch alone would wait on it forever). The build is the
    # installed wheel's, so its ninja files name these very sources: ninja finds it up to date and
    # the test costs two process starts, not a rebuild (a copy of the user's cache built from
    # another checkout would be rebuilt, ~60-140 s).
    assert installed_wheel["proc"].returncode == 0, installed_wheel["proc"].stderr[-4000:]
    (built,) = installed_wheel["cache"].glob("grace_adam_*/build-complete")
    name = built.parent.name
    cache = tmp_path / "cache"
    shutil.copytree(built.parent, cache / name)
    (cache / name / "build-complete").unlink()
    (cache / name / "lock").write_text("")
    code = "from superoffload_hf.host import kernel; print(kernel.load_extension().__name__)"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=installed_env(installed_wheel["site"], cache),
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outputs = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
        assert out.strip() == name
    assert (cache / name / "build-complete").is_file()
    assert not (cache / name / "lock").exists()
