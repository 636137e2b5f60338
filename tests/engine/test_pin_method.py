"""How the engine page-locks its host arenas (engine/state/pin_method.py, config `pin_method`): the
method chosen once, in force only while the arenas are allocated, torch's default after."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.engine.state.pin_method import AUTO_MIN_PINNED_BYTES, choose_pin_method
from superoffload_hf.testing.sim import SimRuntime

from _models import engine_config, tiny_llama, tiny_batch
from superoffload_hf.testing.engine_parts import parts


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
        engine = parts(opt)
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


class _TorchAllocatorSettings:
    """torch's allocator settings as its parser keeps them: every parse resets max_split_size_mb,
    roundup_power2_divisions and garbage_collection_threshold to their defaults before applying
    the string's keys; the getter returns the last string parsed."""

    RESET = {"max_split_size_mb": None, "roundup_power2_divisions": None, "garbage_collection_threshold": None}

    def __init__(self, initial: str):
        self.state = {"pinned_use_cuda_host_register": "False", "pinned_num_register_threads": "1", **self.RESET}
        self.writes = []
        self.parse(initial)

    def parse(self, settings: str) -> None:
        self.last = settings
        self.state.update(self.RESET)
        for item in re.split(r",(?![^\[]*\])", settings):  # commas outside brackets
            if item.strip():
                key, _, value = item.strip().partition(":")
                self.state[key] = value

    def set(self, settings: str) -> None:
        self.writes.append(settings)
        self.parse(settings)


def _cuda_runtime_with(monkeypatch, user: str):
    from superoffload_hf.device.accelerator import AcceleratorRuntime

    torch_settings = _TorchAllocatorSettings(user)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: torch_settings.last, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", torch_settings.set, raising=False)
    return AcceleratorRuntime(torch.device("cuda", 0)), torch_settings


USER_SETTINGS = "max_split_size_mb:256,roundup_power2_divisions:[256:1,>:2],garbage_collection_threshold:0.6,expandable_segments:True"


@pytest.mark.parametrize("mode", ["register", "auto"])
def test_switching_the_pinning_method_keeps_every_allocator_setting_the_user_made(monkeypatch, mode):
    """torch resets three settings at every parse: the user's max_split_size_mb,
    roundup_power2_divisions and garbage_collection_threshold stay in force while the engine pins
    by cudaHostRegister and after it switches back; the settings read back are the user's."""
    runtime, torch_settings = _cuda_runtime_with(monkeypatch, USER_SETTINGS)
    user_state = dict(torch_settings.state)
    measure = lambda *args: _measured(9.0, 50.0)  # noqa: E731 (register pins faster)
    method = choose_pin_method(runtime, mode, 8, AUTO_MIN_PINNED_BYTES, measure)
    assert method.register
    with method.applied(runtime):
        assert torch_settings.state == {**user_state, "pinned_use_cuda_host_register": "True",
                                        "pinned_num_register_threads": "8"}
    assert torch_settings.state == {**user_state, "pinned_num_register_threads": "8"}  # (no effect with alloc)
    assert runtime.host_register(False, 8)  # nothing of the engine's left: nothing more written
    writes = len(torch_settings.writes)
    assert choose_pin_method(runtime, "register", 8, AUTO_MIN_PINNED_BYTES).register  # a second engine
    assert len(torch_settings.writes) == writes


@pytest.mark.parametrize("user", ["pinned_use_cuda_host_register:True,pinned_num_register_threads:16",
                                  "max_split_size_mb:128,pinned_use_cuda_host_register:False",
                                  "pinned_num_register_threads:4"])
@pytest.mark.parametrize("mode", ["alloc", "register", "auto"])
def test_a_pinning_method_the_user_set_in_the_allocator_settings_is_never_changed(monkeypatch, user, mode):
    runtime, torch_settings = _cuda_runtime_with(monkeypatch, user)
    method = choose_pin_method(runtime, mode, 8, AUTO_MIN_PINNED_BYTES, lambda *args: _measured(9.0, 50.0))
    with method.applied(runtime):
        pass
    assert torch_settings.writes == [] and torch_settings.last == user
    assert not method.register and "user's allocator settings" in method.reason


def test_the_allocator_settings_written_are_the_users_plus_the_pinning_keys():
    from superoffload_hf.device.accelerator import pinning_settings

    assert pinning_settings("", True, 8) == "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    assert pinning_settings(USER_SETTINGS, False, 8) == USER_SETTINGS + ",pinned_use_cuda_host_register:False"
    assert pinning_settings(" max_split_size_mb:64 ,", True, 2) == \
        "max_split_size_mb:64,pinned_use_cuda_host_register:True,pinned_num_register_threads:2"
    assert pinning_settings("pinned_use_hip_host_register:True", True, 8) is None


def test_switching_the_pinning_method_repeats_the_users_allocator_settings_and_leaves_their_own_choice(monkeypatch):
    """torch resets the allocator settings a parse does not name (issue 29 item 12): every string
    the engine hands the parser keeps what the user set, with the register threads rounded down to
    the power of two torch takes, and a pinning method the user chose is never changed."""
    from superoffload_hf.engine.state.pin_method import PinMethod

    runtime, torch_settings = _cuda_runtime_with(monkeypatch, "expandable_segments:True,max_split_size_mb:128")
    with PinMethod(True, 6, "test").applied(runtime):
        pass
    user = "expandable_segments:True,max_split_size_mb:128"
    assert torch_settings.writes == [user + ",pinned_use_cuda_host_register:True,pinned_num_register_threads:4",
                                     user + ",pinned_use_cuda_host_register:False"]
    user = "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"
    runtime, torch_settings = _cuda_runtime_with(monkeypatch, user)
    with PinMethod(True, 6, "test").applied(runtime):
        assert not runtime.host_register(False)
    assert torch_settings.writes == []
