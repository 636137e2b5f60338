"""The checks of tests/engine/test_gpu.py (tests/_gpu_checks.py) run on the simulated asynchronous device:
each cast policy's pinning, three distinct streams, no host<->device copy from pageable memory;
and each check, fed a broken case, reports it."""

from __future__ import annotations

import pytest
import torch

import _gpu_checks
from _models import tiny_llama
from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.device import SIM_ENV_VAR
from superoffload_hf.testing.engine_parts import parts

CASES = (("bf16", "device", 1), ("bf16", "host", 1), ("fp32", "host", 2), ("fp32", "device", 2))


@pytest.fixture
def sim(monkeypatch):
    from superoffload_hf.testing.sim import SimRuntime

    SimRuntime.reset_shared()
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    runtime = SimRuntime.shared()
    recorder = _gpu_checks.SeamRecorder(runtime)  # before the optimizer: its arenas are allocated at build
    yield runtime, recorder
    recorder.restore()
    errors = list(runtime.errors)
    SimRuntime.reset_shared()
    assert not errors, f"the simulated device reported races: {errors}"


def train(model, opt, micro_batches: int, steps: int = 2) -> None:
    for _ in range(steps):
        for _ in range(micro_batches):
            ids = torch.randint(0, model.config.vocab_size, (2, 16))
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()


@pytest.mark.sim
@pytest.mark.parametrize("dtype,cast,micro_batches", CASES)
def test_each_cast_policy_pins_what_crosses_the_link_and_copies_only_pinned_memory(sim, dtype, cast, micro_batches):
    runtime, recorder = sim
    model = tiny_llama()
    cfg = {"bucket_size_mb": 0.05, "device_buckets": 0, "host_threads": 1, "device_dtype": dtype, "cast": cast,
           "gradient_accumulation_steps": micro_batches}
    with SuperOffloadAdamW(model.parameters(), lr=1e-3, config=cfg) as opt:
        engine = parts(opt)
        assert engine.runtime is runtime
        expected = _gpu_checks.expected_host_pinning(engine)
        if cast == "host" and dtype == "bf16":  # the PCIe policy: the bf16 copy crosses, the master stays
            # (one micro-batch: no fp32 gradient buffer at all, BufferPolicy.grad_lazy)
            assert expected["lowp"] and expected["recv"] and not expected["master"] and not expected.get("grad")
        else:
            assert expected["master"] and expected["grad"] and "lowp" not in expected
        train(model, opt, micro_batches)
        assert not _gpu_checks.pinning_mismatches(engine, recorder.is_pinned)
        assert not _gpu_checks.copy_streams_problems(engine)
        crossing = [c for c in recorder.copies if sum(map(recorder.is_host_given(model.parameters()), c)) == 1]
        assert crossing, "no host<->device copy was recorded"
        assert not _gpu_checks.pageable_copies(recorder.copies, recorder.is_host_given(model.parameters()),
                                               recorder.is_pinned)


@pytest.mark.sim
def test_the_checks_report_what_is_wrong(sim):
    runtime, recorder = sim
    model = tiny_llama()
    cfg = {"bucket_size_mb": 0.05, "device_buckets": 0, "host_threads": 1, "device_dtype": "bf16", "cast": "host"}
    with SuperOffloadAdamW(model.parameters(), lr=1e-3, config=cfg) as opt:
        engine = parts(opt)
        train(model, opt, 1, steps=1)
        # the old assertion (master and grad pinned) is wrong for cast "host": the check says so
        wrong = _gpu_checks.pinning_mismatches(engine, lambda t: True)
        assert wrong and all("should be pageable" in w for w in wrong)
        assert any("master should" in w for w in wrong) and any("exp_avg should" in w for w in wrong)
        assert _gpu_checks.pinning_mismatches(engine, lambda t: False)
        engine.transfer.h2d = engine.transfer.d2h
        try:
            assert _gpu_checks.copy_streams_problems(engine) == [
                f"d2h and h2d are the same stream {_gpu_checks.stream_key(engine.transfer.d2h)}"]
        finally:
            engine.transfer.h2d = runtime.new_stream()
    pageable_host, pinned_host = torch.ones(8), runtime.host_empty(8, torch.float32, pinned=True)
    device = runtime.device_empty(8, torch.float32)
    is_host = recorder.is_host_given([])
    copies = [(device, pageable_host), (pageable_host, device), (pinned_host, device), (device, pinned_host),
              (device, device), (pageable_host, pinned_host)]
    assert _gpu_checks.pageable_copies(copies, is_host, recorder.is_pinned) == [
        "host->device copy of 8 torch.float32 elements: the host src is pageable",
        "device->host copy of 8 torch.float32 elements: the host dst is pageable"]


def test_stream_key_compares_the_wrappers_of_one_stream_by_id():
    class FakeStream:  # torch.Stream's identifying attributes
        def __init__(self, stream_id):
            self.device_type, self.device_index, self.stream_id = 1, 0, stream_id

    assert _gpu_checks.stream_key(FakeStream(3)) == _gpu_checks.stream_key(FakeStream(3))
    assert _gpu_checks.stream_key(FakeStream(3)) != _gpu_checks.stream_key(FakeStream(4))
    cpu = torch.Stream(device="cpu")
    assert _gpu_checks.stream_key(cpu) == (cpu.device_type, cpu.device_index, cpu.stream_id)
