"""What the simulated device models of CUDA beyond ordering (superoffload_hf/testing/sim.py):
autograd's device thread, the virtual device clock and CUDA's event rules, the side-stream pool,
and host-blocking waits per thread; and what the engine must do about each."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.device import SIM_ENV_VAR
from superoffload_hf.device.transfer import Transfer
from superoffload_hf.engine import core
from superoffload_hf.testing.sim import KERNEL_MS, LINK_BYTES_PER_MS, SimRuntime, current_device, on_device
from superoffload_hf.testing.engine_parts import parts

pytestmark = [pytest.mark.sim, pytest.mark.timeout(300)]

CONFIG = {"device_dtype": "fp32", "bucket_size_mb": 0.002, "host_threads": 1, "device_buckets": 0}


@pytest.fixture
def rt():
    runtime = SimRuntime()
    yield runtime
    runtime.close()


@pytest.fixture
def sim_env(monkeypatch):
    """The engine on the shared simulated device; no race may be reported."""
    SimRuntime.reset_shared()
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    yield
    errors = list(SimRuntime.shared().errors)
    SimRuntime.reset_shared()
    assert not errors, f"the simulated device reported races: {errors}"


def in_thread(fn, name="user-thread"):
    caught, out = [], []

    def body():
        try:
            out.append(fn())
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            caught.append(error)

    worker = threading.Thread(target=body, name=name)
    worker.start()
    worker.join()
    if caught:
        raise caught[0]
    return out[0]


def mlp(seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                   torch.nn.GELU(), torch.nn.Linear(32, 8))


def loss_of(model, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def train(steps, backward=lambda loss: loss.backward(), each_step=None, **config):
    model = mlp()
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-2, config={**CONFIG, **config})
    with opt:
        for step in range(steps):
            if each_step is not None:
                each_step(step, opt)
            backward(loss_of(model, step))
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        return [p.detach().clone() for p in model.parameters()], opt


def reference(steps):
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def assert_params_close(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------- autograd's device thread

def test_backward_runs_the_hooks_on_the_autograd_device_thread_with_the_device_current():
    rt = SimRuntime(index=1)  # a rank's device: the autograd thread starts on device 0 and must set it
    try:
        with on_device(1):
            model = torch.nn.Linear(3, 2)
            rt.adopt(list(model.parameters()))
            seen = []
            model.weight.register_post_accumulate_grad_hook(
                lambda p: seen.append((threading.current_thread(), current_device(), rt.current_stream())))
            model(torch.ones(1, 3)).sum().backward()
        (thread, device, stream), = seen
        assert thread is not threading.current_thread() and thread.name.startswith("autograd device thread")
        assert device == 1 and stream is rt.compute
        assert model.weight.grad is not None
    finally:
        rt.close()


def test_backward_hands_the_hook_s_exception_to_the_caller(rt):
    model = torch.nn.Linear(3, 2)
    rt.adopt(list(model.parameters()))

    def fail(p):
        raise ValueError("from the hook")

    model.weight.register_post_accumulate_grad_hook(fail)
    with pytest.raises(ValueError, match="from the hook"):
        model(torch.ones(1, 3)).sum().backward()


def test_closing_the_runtime_restores_torch_autograd_backward():
    original = torch.autograd.backward
    runtime = SimRuntime()
    runtime.adopt(list(torch.nn.Linear(2, 2).parameters()))
    assert torch.autograd.backward is not original
    runtime.close()
    assert torch.autograd.backward is original


def test_engine_trains_when_backward_is_called_from_a_user_thread(sim_env):
    """The issue's defect: backward() from another thread raised a simulator race error (the
    hooks ran on the caller's thread); on CUDA it is autograd's device thread that runs them."""
    got, _ = train(4, backward=lambda loss: in_thread(loss.backward), speculation="on")
    assert_params_close(got, reference(4))


# ------------------------------------------------------- the virtual clock and CUDA's events

def test_elapsed_time_needs_timing_events(rt):
    a, b = rt.new_event(), rt.new_event()
    a.record(rt.compute)
    b.record(rt.compute)
    with pytest.raises(RuntimeError, match="timing=True"):
        a.elapsed_time(b)


def test_elapsed_time_needs_recorded_and_completed_events(rt):
    side = rt.new_stream()
    src = rt.host_empty(1000, torch.float32, pinned=True).fill_(1.0)
    with rt.on_stream(side):
        dst = rt.device_empty(1000, torch.float32)
    start, end = rt.new_event(timing=True), rt.new_event(timing=True)
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(end)
    start.record(side)
    with rt.on_stream(side):
        rt.copy_(dst, src)
    end.record(side)
    with pytest.raises(RuntimeError, match="completed"):
        start.elapsed_time(end)
    end.synchronize()
    assert start.elapsed_time(end) == pytest.approx(KERNEL_MS + 4000 / LINK_BYTES_PER_MS)


def test_device_time_is_not_host_time_and_waits_carry_it(rt):
    model = torch.nn.Linear(64, 64)
    rt.adopt(list(model.parameters()))
    side = rt.new_stream()
    start, after_forward, waited = (rt.new_event(timing=True) for _ in range(3))
    start.record(rt.compute)
    model(torch.ones(1, 64))
    time.sleep(0.05)  # host time passes; device time does not
    after_forward.record(rt.compute)
    assert 0 < start.elapsed_time(after_forward) < 1.0  # ms: the modelled forward
    side.wait_event(after_forward)  # the side stream starts no earlier than that
    waited.record(side)
    assert start.elapsed_time(waited) == start.elapsed_time(after_forward)


def test_h2d_bandwidth_is_measured_in_device_time(rt):
    gbps = Transfer(rt, pin_memory=True).measure_h2d_gbps(megabytes=1, repeats=2)
    nbytes = 2**20
    assert gbps == pytest.approx(nbytes / (KERNEL_MS + nbytes / LINK_BYTES_PER_MS) / 1e6)


def test_the_bandwidth_measurement_needs_its_synchronize(rt, monkeypatch):
    """`Transfer._drain`'s synchronize is needed: without it the timing events have not completed."""
    monkeypatch.setattr(Transfer, "_drain", lambda self, done: None)
    with pytest.raises(RuntimeError, match="completed"):
        Transfer(rt, pin_memory=True).measure_h2d_gbps(megabytes=1, repeats=2)


def test_the_learned_plan_uses_device_time_not_host_issue_time(sim_env, monkeypatch):
    """A backward whose host side is slow (a hook sleeps) but whose device time is short: the
    plan learned from the first step sees the device's backward and step span."""
    seen = {}

    def capture(log, numels, step_seconds, rollback_rate):
        seen.update(backward=log.seconds, span=step_seconds, profile=dict(log.first_fired))
        return measured_workload(log, numels, step_seconds, rollback_rate)

    measured_workload = core.measured_workload
    monkeypatch.setattr(core, "measured_workload", capture)

    def slow_backward(loss):
        started = time.perf_counter()
        loss.backward()
        seen["host_backward"] = time.perf_counter() - started

    def slow_host_hooks(step, opt):
        if step == 0:
            for module in parts(opt).params[:2]:
                module.register_hook(lambda grad: time.sleep(0.1))

    train(2, backward=slow_backward, each_step=slow_host_hooks)
    assert seen["host_backward"] >= 0.2
    assert 0 < seen["backward"] < 0.01 and 0 < seen["span"] < 0.01  # modelled device seconds
    assert all(0 <= t <= seen["backward"] for t in seen["profile"].values())


# -------------------------------------------------------------------------- the stream pool

def test_side_streams_come_from_a_small_pool():
    runtime = SimRuntime(side_streams=2)
    try:
        a, b, c = runtime.new_stream(), runtime.new_stream(), runtime.new_stream()
        assert a is not b and c is a and not a.is_compute
    finally:
        runtime.close()


def test_engine_is_correct_when_its_d2h_and_h2d_streams_are_one_stream(monkeypatch):
    SimRuntime.reset_shared(side_streams=1)
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    try:
        got, opt = train(4, speculation="on")
        assert parts(opt).transfer.d2h is parts(opt).transfer.h2d
        assert not SimRuntime.shared().errors
    finally:
        SimRuntime.reset_shared()
    assert_params_close(got, reference(4))


# ------------------------------------------------------------------------ host-blocking waits

def test_steady_state_steps_do_not_block_the_training_thread(sim_env):
    waits = []

    def count(step, opt):
        waits.append(SimRuntime.shared().blocking_waits())

    train(6, each_step=count, speculation="on")
    per_step = [b - a for a, b in zip(waits, waits[1:])]
    assert per_step[1:] == [0] * (len(per_step) - 1), per_step  # after step 1 (which learns the plan)


def test_a_forward_that_blocks_the_host_is_counted(sim_env, monkeypatch):
    """The check above catches a host-blocking wait in the step: here a forward blocks the host
    on each bucket's copy-back instead of queueing the wait on the compute stream."""
    waits = []
    monkeypatch.setattr(Transfer, "wait_device", lambda self, event: event is not None and event.synchronize())

    def count(step, opt):
        waits.append(SimRuntime.shared().blocking_waits())

    train(4, each_step=count, speculation="on")
    assert waits[3] - waits[2] > 0


def test_blocking_waits_are_counted_per_thread(rt):
    side = rt.new_stream()
    event = rt.new_event()
    event.record(side)
    event.synchronize()
    side.synchronize()
    in_thread(lambda: rt.synchronize_all())
    assert rt.blocking_waits() == 2
