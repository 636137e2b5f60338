"""The host Adam loader: back-end choice, ISA forcing, build failures, the build cache and its locks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from superoffload_hf.host import kernel

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader as in a new process, with an empty cache in tmp_path (the real cache is untouched)."""
    monkeypatch.setattr(kernel, "_extension", None)
    monkeypatch.setattr(kernel, "_extension_error", None)
    monkeypatch.setattr(kernel, "_warned_fallback", False)
    monkeypatch.setenv(kernel.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(kernel.FORCE_REFERENCE_ENV, raising=False)
    return tmp_path


@pytest.fixture
def failing_compiler(fresh_loader, monkeypatch):
    script = fresh_loader / "broken-c++"
    # Answers torch's version probes like the real compiler, fails every compilation.
    script.write_text("#!/bin/sh\ncase \" $* \" in *' -c '*) ;; *) exec g++ \"$@\" ;; esac\n"
                      "echo 'broken-c++: deliberate failure for the test' >&2\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    return script


def test_force_reference_env_var_selects_the_reference(monkeypatch):
    monkeypatch.setenv(kernel.FORCE_REFERENCE_ENV, "1")
    for mode in ("auto", "cpp"):
        adam = kernel.get_host_adam(mode, threads=3)
        assert (adam.name, adam.isa, adam.threads) == ("reference", "none", 3)
        assert kernel.FORCE_REFERENCE_ENV in kernel.describe()


def test_reference_mode_works_like_the_reference():
    adam = kernel.get_host_adam("reference", threads=2)
    assert (adam.name, adam.isa, adam.threads) == ("reference", "none", 2)
    p, m, v, g = torch.ones(5), torch.zeros(5), torch.zeros(5), torch.full((5,), 0.5)
    adam.adam_step_(p, m, v, g, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    torch.testing.assert_close(p, torch.full((5,), 0.9))
    assert adam.sum_squares(g) == 1.25
    adam.set_num_threads(1)
    assert adam.threads == 1


def test_cpp_mode_reports_isa_and_threads(grace_adam_extension, monkeypatch):
    monkeypatch.delenv(kernel.FORCE_REFERENCE_ENV, raising=False)
    adam = kernel.get_host_adam("cpp")
    assert adam.name == "cpp"
    assert adam.isa == grace_adam_extension.isa_name(grace_adam_extension.best_isa())
    assert adam.threads == len(os.sched_getaffinity(0))
    line = kernel.describe()
    assert "cpp" in line and adam.isa in line and "\n" not in line


def test_extension_is_built_once_per_process(grace_adam_extension):
    assert kernel.load_extension() is grace_adam_extension


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_isa_can_be_forced(grace_adam_extension, monkeypatch, isa):
    monkeypatch.delenv(kernel.FORCE_REFERENCE_ENV, raising=False)
    if not grace_adam_extension.isa_supported(kernel.ISA_CODES[isa]):
        pytest.skip(f"{isa} is not supported on this CPU")
    adam = kernel.get_host_adam("cpp", threads=1, isa=isa)
    assert (adam.isa, adam.threads) == (isa, 1)


def test_unknown_or_unsupported_isa_raises_naming_the_choices(grace_adam_extension, monkeypatch):
    monkeypatch.delenv(kernel.FORCE_REFERENCE_ENV, raising=False)
    with pytest.raises(ValueError, match="valid choices are"):
        kernel.get_host_adam("cpp", isa="avx1024")
    unsupported = [name for name, code in kernel.ISA_CODES.items() if not grace_adam_extension.isa_supported(code)]
    with pytest.raises(ValueError, match="does not support; supported: .*scalar"):
        kernel.get_host_adam("cpp", isa=unsupported[0])


@pytest.mark.parametrize("kwargs", [dict(mode="fast"), dict(threads=0), dict(threads=1.5)])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError, match="`mode` is|`threads` is"):
        kernel.get_host_adam(**kwargs)


def test_cpp_mode_with_a_failing_build_raises_a_clear_error(failing_compiler):
    with pytest.raises(kernel.KernelBuildError, match="(?s)failed.*deliberate failure"):
        kernel.get_host_adam("cpp")
    with pytest.raises(kernel.KernelBuildError):  # remembered: not rebuilt on every call
        kernel.get_host_adam("cpp")


def test_auto_mode_with_a_failing_build_warns_once_and_uses_the_reference(failing_compiler):
    with pytest.warns(RuntimeWarning, match="(?s)deliberate failure.*Falling back"):
        adam = kernel.get_host_adam("auto", threads=2)
    assert (adam.name, adam.threads) == ("reference", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel.get_host_adam("auto").name == "reference"


def test_a_required_kernel_makes_auto_fail_loudly_instead_of_falling_back(failing_compiler, monkeypatch):
    monkeypatch.setenv(kernel.REQUIRE_KERNEL_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either: an error
        with pytest.raises(kernel.KernelBuildError, match="(?s)failed.*deliberate failure"):
            kernel.get_host_adam("auto")
    monkeypatch.setenv(kernel.FORCE_REFERENCE_ENV, "1")
    with pytest.raises(kernel.KernelBuildError, match="SUPEROFFLOAD_FORCE_REFERENCE and SUPEROFFLOAD_REQUIRE_KERNEL "
                                                      "are both set"):
        kernel.get_host_adam("cpp")
    assert kernel.get_host_adam("reference").name == "reference"  # asked for by name: no fallback


def test_missing_compiler_error_says_to_install_one(fresh_loader, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh_loader / "no-such-compiler"))
    with pytest.raises(kernel.KernelBuildError, match="Install g\\+\\+"):
        kernel.get_host_adam("cpp")


def test_missing_ninja_error_says_to_install_it(fresh_loader, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(kernel.KernelBuildError, match="pip install ninja"):
        kernel.get_host_adam("cpp")


def test_missing_sources_error_says_how_to_install(fresh_loader, monkeypatch):
    monkeypatch.setattr(kernel, "SOURCE_DIR", fresh_loader / "nowhere")
    with pytest.raises(kernel.KernelBuildError, match="sources .* are missing"):
        kernel.get_host_adam("cpp")


# A stale torch `lock` baton with concurrent loads: tests/kernel/test_packaging.py (it reuses the build
# of the installed wheel, whose ninja files name its own sources, so nothing is rebuilt).


def _under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "cache"


@pytest.mark.parametrize("where", [lambda tmp: Path("/proc/nope"), _under_a_file], ids=["proc", "under-a-file"])
def test_an_unwritable_cache_falls_back_in_auto_and_names_the_directory_in_cpp(fresh_loader, monkeypatch, where):
    cache = where(fresh_loader)
    monkeypatch.setenv(kernel.CACHE_DIR_ENV, str(cache))
    with pytest.warns(RuntimeWarning, match=rf"(?s)cache directory {cache} is not writable.*Falling back"):
        assert kernel.get_host_adam("auto", threads=1).name == "reference"
    with pytest.raises(kernel.KernelBuildError, match=rf"{cache} is not writable .*Set {kernel.CACHE_DIR_ENV} to a writable"):
        kernel.get_host_adam("cpp")


def test_a_read_only_cache_holding_the_build_loads_it_without_the_lock(grace_adam_extension, tmp_path):
    # The lock file cannot be created (a directory stands in its place, as a read-only mount
    # refuses it): a finished build must load all the same, in a new process.
    name = f"grace_adam_{kernel.build_key(kernel.SOURCE_DIR)}"
    cache = tmp_path / "cache"
    shutil.copytree(kernel.cache_root() / name, cache / name)
    (cache / f"{name}.lock").unlink(missing_ok=True)
    (cache / f"{name}.lock").mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", **{kernel.CACHE_DIR_ENV: str(cache)})
    env.pop(kernel.FORCE_REFERENCE_ENV, None)
    code = "from superoffload_hf.host import kernel; print(kernel.get_host_adam('cpp', threads=1).name)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip() == "cpp", proc.stderr[-3000:]


def test_the_first_build_says_that_it_builds_and_where_it_caches(failing_compiler, capfd):
    with pytest.warns(RuntimeWarning):
        kernel.get_host_adam("auto")
    err = capfd.readouterr().err
    assert "[superoffload] building the GraceAdam host Adam kernel (first use; ~40 s on 2 quiet cores, longer on busy ones) in " in err
    assert f"{kernel.cache_root()}" in err and "cached there for later runs" in err


def test_sources_are_found_in_the_installed_package_first(monkeypatch, tmp_path):
    package = tmp_path / "site-packages" / "superoffload_hf"
    (package / "_csrc" / "grace_adam").mkdir(parents=True)
    (package / "host").mkdir()
    monkeypatch.setattr(kernel, "__file__", str(package / "host" / "kernel.py"))
    assert kernel._find_source_dir() == package / "_csrc" / "grace_adam"
    (package / "_csrc" / "grace_adam").rmdir()
    assert kernel._find_source_dir() == tmp_path / "site-packages" / "csrc" / "grace_adam"
