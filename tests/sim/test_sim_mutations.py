"""Mutation tests of the device seam: remove one synchronisation of `Transfer` at a time, run the
engine on the simulated asynchronous device, and check that the simulator reports the race:
either a `SimRaceError` (raised directly, or by the host worker) or a wrong number (NaN poison
read too early, or weights that differ from the same run on the synchronous CPU device).

The scenario exercises every synchronisation: speculative steps with clipping (rollbacks and
replays), an evaluation forward between backward and step() (the fence), per-module waits of
the next forward, reading parameters through `model.state_dict()`, more host buckets than the
gradient ring has slots. It runs under a "slow host" schedule: the host worker starts a job
only while the training thread waits for the worker, so that no race is hidden by a worker that
happened to be quick (a legal schedule: the host may always be that slow).
"""

from __future__ import annotations

import threading

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.device import SIM_ENV_VAR
from superoffload_hf.device.transfer import GRAD_RING_SLOTS, SYNCS
from superoffload_hf.engine.step.worker import HostWorker
from superoffload_hf.testing.sim import SimRaceError, SimRuntime, on_device

from _models import RelativeMaxNorm, engine_config, micro_batches, read_params, tiny_llama
from superoffload_hf.testing.engine_parts import parts

pytestmark = [pytest.mark.sim, pytest.mark.timeout(120)]

STEPS = 4


@pytest.fixture(autouse=True)
def slow_host(monkeypatch):
    """Host jobs start only while the training thread waits for the worker (or it stops)."""
    gate = threading.Event()
    submit, wait, stop = HostWorker.submit, HostWorker.wait, HostWorker.stop

    def gated_submit(self, fn, pending):
        def when_waited_for():
            gate.wait()
            fn()
        submit(self, when_waited_for, pending)

    def opening_wait(self, event):
        gate.set()
        try:
            return wait(self, event)
        finally:
            gate.clear()

    def opening_stop(self, *args, **kwargs):
        gate.set()
        stop(self, *args, **kwargs)

    monkeypatch.setattr(HostWorker, "submit", gated_submit)
    monkeypatch.setattr(HostWorker, "wait", opening_wait)
    monkeypatch.setattr(HostWorker, "stop", opening_stop)


def _run(omitted=()) -> dict[str, torch.Tensor]:
    """Train a tiny Llama for STEPS steps; return its parameters, read the documented way."""
    model = tiny_llama(num_layers=2)
    ref = tiny_llama(num_layers=2)  # only for the norm that makes every step clip by ~10%
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-2,
                            config=engine_config(speculation="on", device_buckets=0))
    assert len(opt.plan.buckets) > GRAD_RING_SLOTS  # backward reuses ring slots
    parts(opt).transfer.omitted = frozenset(omitted)
    clip = RelativeMaxNorm(0.9)
    with opt:
        for step in range(STEPS):
            (batch,) = micro_batches(step)
            ref.zero_grad()
            ref(**batch).loss.backward()
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
            # clip from step 2 on (the first step learns the plan; step 1 speculates and commits)
            opt.max_grad_norm = clip.resolve(norm) if step >= 2 else None
            model(**batch).loss.backward()
            if step == 2:
                with torch.no_grad():  # an evaluation between backward and step() (the fence)
                    model(**micro_batches(99)[0])
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                ref.load_state_dict(read_params(model))
        return {name: p.detach().clone() for name, p in read_params(model).items()}


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    """The same run on the synchronous CPU device."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SIM_ENV_VAR, raising=False)
        return _run()


@pytest.fixture
def sim(monkeypatch):
    """The shared simulated device as a rank's device 1, current in the training thread (as
    torch.cuda.set_device(local_rank) makes it): the engine's own threads start on device 0."""
    SimRuntime.reset_shared(index=1)
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    with on_device(1):
        yield SimRuntime.shared()
    SimRuntime.reset_shared()


def _differs(got: dict, want: dict) -> list[str]:
    return [name for name in want if not torch.equal(got[name], want[name])]


def test_the_full_seam_on_the_simulated_device_matches_the_cpu_device_bitwise(sim, expected):
    got = _run()
    assert not sim.errors, sim.errors
    assert not _differs(got, expected)


def test_the_simulated_run_is_asynchronous():
    """step() returns before the copy-backs have run: the parameters hold NaN poison until the
    forward's per-module wait (or state_dict, or synchronize) lets them land."""
    with pytest.MonkeyPatch.context() as mp:
        SimRuntime.reset_shared()
        mp.setenv(SIM_ENV_VAR, "1")
        model = tiny_llama(num_layers=2)
        opt = SuperOffloadAdamW(model.parameters(), lr=1e-2, config=engine_config(device_buckets=0))
        with opt:
            assert "sim:0" in opt.describe()
            for step in range(2):
                model(**micro_batches(step)[0]).loss.backward()
                opt.step()
                opt.zero_grad()
            poisoned = [name for name, p in model.named_parameters() if torch.isnan(p).all()]
            assert poisoned, "no parameter was still in flight after step(): the device path is synchronous"
            opt.synchronize()
            assert not any(torch.isnan(p).any() for p in model.parameters())
        SimRuntime.reset_shared()


@pytest.mark.parametrize("sync", SYNCS)
def test_removing_a_synchronisation_is_caught_by_the_simulator(sync, sim, expected):
    try:
        got = _run(omitted={sync})
    except (SimRaceError, RuntimeError) as error:  # the worker re-raises its SimRaceError
        assert isinstance(error, SimRaceError) or isinstance(error.__cause__, SimRaceError) or sim.errors, error
        return
    if sim.errors:
        return
    differs = _differs(got, expected)
    assert differs, f"without {sync!r} the run still matched the CPU device bitwise and raised nothing"
