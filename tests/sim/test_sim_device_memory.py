"""The simulated device's memory budget (testing/device_memory.py, sim.py): allocations past it
raise torch's out-of-memory error, the peak is tracked, freed and released storage returns."""

from __future__ import annotations

import gc

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.device import SIM_ENV_VAR
from superoffload_hf.testing.device_memory import TOTAL_BYTES
from superoffload_hf.testing.sim import SimRaceError, SimRuntime

from _models import engine_config, one_torch_thread, tiny_batch, tiny_llama  # noqa: F401

pytestmark = [pytest.mark.sim, pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(120)]


def test_an_allocation_past_the_budget_raises_torchs_out_of_memory_error_and_the_peak_is_kept():
    sim = SimRuntime(device_budget_bytes=4000)
    try:
        a = sim.device_empty(500, torch.float32)  # 2000 bytes
        assert sim.memory_allocated() == 2000 and sim.max_memory_allocated() == 2000
        b = sim.device_empty(250, torch.float64)  # 2000 more: exactly the budget
        assert sim.memory_allocated() == 4000
        with pytest.raises(torch.OutOfMemoryError, match=r"needs 4 bytes, 4000 of the 4000-byte"):
            sim.device_empty(1, torch.float32)
        del a
        gc.collect()
        assert sim.memory_allocated() == 2000 and sim.max_memory_allocated() == 4000  # freed: returned
        c = sim.device_empty(500, torch.float32)  # fits again
        sim.reset_peak_memory_stats()
        del b, c
        gc.collect()
        assert sim.memory_allocated() == 0 and sim.max_memory_allocated() == 4000  # the peak since the reset
        assert sim.memory_info() == (4000, 4000)
    finally:
        sim.close()
    assert not sim.errors


def test_adopted_parameters_count_once_per_storage_and_a_storage_resized_to_zero_returns_its_bytes():
    sim = SimRuntime(device_budget_bytes=10_000)
    try:
        weight = torch.nn.Parameter(torch.ones(1000))  # 4000 bytes
        view_of_it = weight.detach()[:10]  # the same storage: counted once
        sim.adopt([weight])
        sim.adopt([weight])
        assert sim.memory_allocated() == 4000 and view_of_it.numel() == 10
        sim.resize_storage(weight, 0)
        assert sim.memory_allocated() == 0 and sim.max_memory_allocated() == 4000
        with pytest.raises(torch.OutOfMemoryError, match="growing a device storage"):
            sim.resize_storage(weight, 10_004)
        sim.resize_storage(weight, 4000)
        assert torch.isnan(weight.detach()).all()  # refilled storage is poisoned until written
        assert weight._version == 0  # (the poison does not count as a write autograd could see)
        too_big = torch.nn.Parameter(torch.ones(1600))  # 6400 bytes more
        with pytest.raises(torch.OutOfMemoryError, match="adopted parameters"):
            sim.adopt([too_big])
    finally:
        sim.close()


def test_releasing_a_storage_a_pending_copy_writes_is_a_race_unless_recorded_on_its_stream():
    sim = SimRuntime()
    try:
        weight = torch.nn.Parameter(torch.zeros(256))
        sim.adopt([weight])
        source = sim.host_empty(256, torch.float32, pinned=True).fill_(3.0)
        side = sim.new_stream()
        with sim.on_stream(side):
            sim.copy_(weight.data, source)
        with pytest.raises(SimRaceError, match=r"released \(storage resized to 0\) while side stream 1"):
            sim.resize_storage(weight, 0)
        sim.errors.clear()
        sim.record_stream(weight.data, side)
        sim.synchronize_all()
        with sim.on_stream(side):
            sim.copy_(weight.data, source)
        sim.resize_storage(weight, 0)  # the copy runs first, as CUDA's allocator defers the reuse
        assert sim.pending_ops() == 0 and weight.untyped_storage().nbytes() == 0
    finally:
        sim.close()


def test_the_shared_device_reads_its_memory_from_the_environment(monkeypatch):
    monkeypatch.setenv("SUPEROFFLOAD_SIM_DEVICE_MEMORY", "3e6")
    SimRuntime.reset_shared()
    try:
        assert SimRuntime.shared().device_memory.budget_bytes == 3_000_000
        assert SimRuntime.shared().memory_info()[1] == 3_000_000
    finally:
        SimRuntime.reset_shared()
    monkeypatch.setenv("SUPEROFFLOAD_SIM_DEVICE_MEMORY", "-1")
    with pytest.raises(ValueError, match="SUPEROFFLOAD_SIM_DEVICE_MEMORY='-1'; expected a number of bytes"):
        SimRuntime.shared()
    SimRuntime.reset_shared()
    monkeypatch.delenv("SUPEROFFLOAD_SIM_DEVICE_MEMORY")
    assert SimRuntime.shared().memory_info()[1] == TOTAL_BYTES
    SimRuntime.reset_shared()


def test_training_on_the_simulated_device_reports_a_peak_that_covers_the_weights_and_the_engines_buffers(monkeypatch):
    SimRuntime.reset_shared()
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    try:
        model = tiny_llama(num_layers=2)
        weight_bytes = sum(p.numel() * 4 for p in model.parameters())
        opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config=engine_config(device_buckets=0, cast="device"))
        batch = tiny_batch()
        for step in range(3):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 0:  # after the first step's one-off link measurement (a 16 MiB buffer)
                assert opt.device_memory_peak() > 16 * 2**20
                SimRuntime.shared().reset_peak_memory_stats()
        peak = opt.device_memory_peak()
        # the weights, the gradient ring and the copy-back staging (one largest host bucket each)
        assert weight_bytes < peak <= weight_bytes + 4 * 4 * max(b.numel for b in opt.plan.buckets)
        opt.close()
        errors = list(SimRuntime.shared().errors)
    finally:
        SimRuntime.reset_shared()
    assert not errors
