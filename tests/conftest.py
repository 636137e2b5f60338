"""Shared fixtures: the GraceAdam extension, built once per test run (skipped when it cannot be)."""

from __future__ import annotations

import gc

import platform

import pytest

from superoffload_hf.device import SIM_ENV_VAR
from superoffload_hf.host import kernel

# The ISA paths this architecture builds (the Arm ones have their own native tests as well).
ARCH_ISAS = {"x86_64": ["scalar", "avx2", "avx512"], "aarch64": ["scalar", "neon", "sve"]}


@pytest.fixture(autouse=True)
def scratch_cwd(tmp_path_factory, monkeypatch):
    """Every test starts in an empty directory of its own: what the checkout holds (the main job's
    out/tiny_llama_cpu, a user's recipes) never changes a result, and no test writes into it."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session")
def grace_adam_extension():
    """The compiled GraceAdam module (cached across runs); skips the test when it cannot be built."""
    try:
        return kernel.load_extension()
    except kernel.KernelBuildError as error:
        pytest.skip(f"the GraceAdam C++ extension cannot be built here: {str(error).splitlines()[0]}")


@pytest.fixture(params=ARCH_ISAS.get(platform.machine().lower(), ["scalar"]))
def isa(request, grace_adam_extension) -> str:
    """Each instruction-set path of the kernel; the ones this CPU lacks are skipped."""
    if not grace_adam_extension.isa_supported(kernel.ISA_CODES[request.param]):
        pytest.skip(f"isa {request.param!r} is not supported on this CPU")
    return request.param


@pytest.fixture
def cpp_adam(grace_adam_extension):
    """make(isa, threads=1) -> the kernel back end forced to one ISA path. One thread by default:
    on a busy 2-core machine a pool worker can wait milliseconds for a core on every call; tests
    of the pool ask for more threads explicitly."""
    threads_before = grace_adam_extension.get_num_threads()

    def make(isa: str, threads: int = 1) -> kernel.CppHostAdam:
        backend = kernel.CppHostAdam(grace_adam_extension, isa)
        backend.set_num_threads(threads)
        return backend

    yield make
    grace_adam_extension.set_num_threads(threads_before)


@pytest.fixture
def supported_isas(grace_adam_extension) -> list:
    return kernel.supported_isas(grace_adam_extension)


@pytest.fixture(params=["cpu", pytest.param("sim", marks=pytest.mark.sim)])
def device_mode(request, monkeypatch):
    """Run the test with the CPU as the (synchronous) device, and again on the simulated
    asynchronous device (SUPEROFFLOAD_SIM_DEVICE=1), where a missing synchronisation reads
    NaN poison or raises SimRaceError. The simulated device is a rank's device 1, current in the
    test's thread (as torch.cuda.set_device(local_rank) makes it): every other thread starts on
    device 0, so an engine thread that does not set its device fails. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("device_mode")`."""
    if request.param == "cpu":
        monkeypatch.delenv(SIM_ENV_VAR, raising=False)
        yield "cpu"
        return
    from superoffload_hf.testing.sim import SimRuntime, on_device

    # Everything alive now is frozen (out of the collector's sight) for the test: the collect below
    # then walks only what the test allocated (a full collect walks the ~400k objects of torch and
    # transformers: ~0.5-1 s on 2 cores, in each of the ~350 sim tests). Unfrozen after it.
    gc.freeze()
    try:
        SimRuntime.reset_shared(index=1)
        monkeypatch.setenv(SIM_ENV_VAR, "1")
        with on_device(1):
            yield "sim"
            # An optimizer the test left unclosed is closed by its finalizer: here, on its device,
            # not during a later test whose thread is on device 0 (a SimRaceError there, blamed on
            # that test).
            gc.collect()
    finally:
        gc.unfreeze()
    sim = SimRuntime.shared()
    errors = list(sim.errors)
    SimRuntime.reset_shared()
    assert not errors, f"the simulated device reported races: {errors}"
