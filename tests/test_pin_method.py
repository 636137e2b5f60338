"""How the engine page-locks its host arenas (engine/pin_method.py, config `pin_method`): the
method chosen once, in force only while the arenas are allocated, torch's default after."""

from __future__ import annotations

import logging

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.engine.pin_method import AUTO_MIN_PINNED_BYTES, choose_pin_method
from superoffload_hf.testing.sim import SimRuntime

from _models import engine_config, tiny_llama, tiny_batch


class _Runtime:
    """A runtime's pinning switch: `choice` says whether it has one; the calls are recorded."""

    name = "fake:0"

    def __init__(self, choice: bool):
        self.choice, self.calls = choice, []

    def host_register(self, enabled: bool, threads: int = 8) -> bool:
        self.calls.append((enabled, threads))
        return self.choice


def _measured(register_pin: float, register_h2d: float) -> dict:
    alloc = {"pin_gbps": 2.0, "h2d_gbps": 50.0}
    register = {"pin_gbps": register_pin, "h2d_gbps": register_h2d}
    faster = register_pin > alloc["pin_gbps"] and register_h2d >= 0.95 * alloc["h2d_gbps"]
    return {"cudaHostAlloc": alloc, "cudaHostRegister": register,
            "faster": "cudaHostRegister" if faster else "cudaHostAlloc"}


def test_the_method_is_the_users_where_the_runtime_has_a_choice_and_alloc_where_it_has_none():
    big = AUTO_MIN_PINNED_BYTES
    assert choose_pin_method(_Runtime(True), "register", 4, big).register
    assert not choose_pin_method(_Runtime(True), "alloc", 4, big).register
    none = choose_pin_method(_Runtime(False), "register", 4, big)
    assert not none.register and "no choice" in none.reason
    assert not choose_pin_method(_Runtime(True), "register", 4, 0).register  # nothing page-locked


def test_auto_measures_only_a_large_plan_and_keeps_the_method_that_pins_faster_at_the_same_bandwidth():
    calls = []

    def measure(answer):
        def run(runtime, nbytes, threads, seconds):
            calls.append((nbytes, threads))
            return answer
        return run

    small = choose_pin_method(_Runtime(True), "auto", 8, AUTO_MIN_PINNED_BYTES - 1, measure(_measured(9.0, 50.0)))
    assert not small.register and "torch's default" in small.reason and not calls
    faster = choose_pin_method(_Runtime(True), "auto", 8, AUTO_MIN_PINNED_BYTES, measure(_measured(9.0, 49.0)))
    assert faster.register and faster.measured["faster"] == "cudaHostRegister" and calls == [(64 << 20, 8)]
    assert "cudaHostRegister 9.00 GB/s pinned" in faster.reason and faster.describe().startswith("cudaHostRegister, 8 threads")
    slower_copies = choose_pin_method(_Runtime(True), "auto", 8, AUTO_MIN_PINNED_BYTES, measure(_measured(9.0, 40.0)))
    assert not slower_copies.register
    no_choice = choose_pin_method(_Runtime(True), "auto", 8, AUTO_MIN_PINNED_BYTES, measure({}))
    assert not no_choice.register and "no choice" in no_choice.reason


def test_applied_switches_the_allocator_setting_only_inside_and_back_to_torchs_default_after_an_error():
    runtime = _Runtime(True)
    method = choose_pin_method(runtime, "register", 4, 1)
    runtime.calls.clear()
    with pytest.raises(RuntimeError):
        with method.applied(runtime):
            assert runtime.calls == [(True, 4)]
            raise RuntimeError("allocation failed")
    assert runtime.calls == [(True, 4), (False, 4)]


@pytest.mark.parametrize("mode, expected", [("register", "cudaHostRegister"), ("alloc", "cudaHostAlloc"),
                                            ("auto", "cudaHostAlloc")])
def test_every_page_locked_arena_of_the_engine_is_pinned_by_the_chosen_method(monkeypatch, caplog, mode, expected):
    """On the simulated device (which records the method of every page-locked block): the arenas
    by the chosen method ("auto" on a plan of a few MB: torch's default, not measured), the
    setting back to torch's default once they exist, the log line naming the method."""
    monkeypatch.setenv("SUPEROFFLOAD_SIM_DEVICE", "1")
    SimRuntime.reset_shared()
    sim = SimRuntime.shared()
    model = tiny_llama(2)
    with caplog.at_level(logging.INFO, logger="superoffload_hf"):
        opt = SuperOffloadAdamW(model.parameters(), lr=1e-3,
                                config=engine_config(device_dtype="bf16", pin_method=mode, device_buckets=0))
    try:
        engine = opt._engine
        assert engine.buckets.pin_method.name == expected
        segments = [seg for arena in engine.buckets.arenas.values() for seg in arena.segments]
        methods = {sim.pin_method_of(seg) for seg in segments}
        assert expected in methods and methods <= {expected, None}, methods  # None: an arena not page-locked
        assert not sim.host_registered  # torch's default again for everything else
        assert sim.pin_method_of(torch.empty(4)) is None
        line = next(r.getMessage() for r in caplog.records if "page-locking" in r.getMessage())
        assert f"by {expected}" in line, line
        model(**tiny_batch()).loss.backward()
        opt.step()
    finally:
        opt.close()
        SimRuntime.reset_shared()


def test_a_pin_method_that_is_not_one_of_the_three_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"`pin_method` is 'cudaHostRegister'; valid choices are \['auto', 'alloc', 'register'\]"):
        SuperOffloadConfig(pin_method="cudaHostRegister")


@pytest.mark.parametrize("var", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_switching_the_pinning_method_repeats_the_users_allocator_settings_and_leaves_their_own_choice(
        monkeypatch, var):
    """torch resets the allocator settings a parse does not name (issue 29 item 12): every string
    the engine hands the parser keeps what the user set, and a pinning method the user chose
    is never changed. On the CPU: the CUDA runtime's call, with the parser recorded."""
    from superoffload_hf.device.accelerator import AcceleratorRuntime
    from superoffload_hf.engine.pin_method import PinMethod

    parsed = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", parsed.append, raising=False)
    for other in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(var, "expandable_segments:True,max_split_size_mb:128")
    runtime = AcceleratorRuntime(torch.device("cuda", 0))
    with PinMethod(True, 6, "test").applied(runtime):
        pass
    assert parsed == ["expandable_segments:True,max_split_size_mb:128,pinned_use_cuda_host_register:True,"
                      "pinned_num_register_threads:4",
                      "expandable_segments:True,max_split_size_mb:128,pinned_use_cuda_host_register:False"]
    parsed.clear()
    monkeypatch.setenv(var, "pinned_use_cuda_host_register:True,pinned_num_register_threads:16")
    with PinMethod(True, 6, "test").applied(runtime):
        assert not runtime.host_register(False)
    assert parsed == []
