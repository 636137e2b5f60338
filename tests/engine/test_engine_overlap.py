"""The overlap and accounting choices of the engine (issue "Memory and overlap on the device
path"): post-validation host steps in the next forward's order, the "auto" policy charged only for
buckets actually rolled back, the host thread default, the device norm without an fp64 copy of
the whole bucket."""

from __future__ import annotations

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.engine.state import stepper
from superoffload_hf.engine.build import auto_host_threads
from superoffload_hf.engine.step.validate import Decision, SpeculationPolicy

from _models import engine_config, micro_batches, tiny_batch, tiny_llama
from superoffload_hf.testing.engine_parts import parts

pytestmark = [pytest.mark.usefixtures("device_mode"), pytest.mark.timeout(120)]


def test_without_speculation_buckets_are_stepped_and_returned_in_the_next_forwards_order():
    model = tiny_llama(num_layers=2)
    # bf16: on the CPU an fp32 model's parameters are its masters, and nothing is copied back
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config=engine_config(speculation="off", device_buckets=0,
                                                                               device_dtype="bf16"))
    with opt:
        model(**micro_batches(0)[0]).loss.backward()
        opt.step()  # the first step learns the gradient order
        opt.zero_grad()
        order = []
        to_device = parts(opt).transfer.params_to_device

        def logged(src, params, offsets):
            order.append(parts(opt).buckets.runtime_of[params[0]].bucket.index)
            return to_device(src, params, offsets)

        parts(opt).transfer.params_to_device = logged
        model(**micro_batches(1)[0]).loss.backward()
        opt.step()
        opt.synchronize()
        host = [rt.bucket.index for rt in parts(opt).buckets.host()]  # gradient-ready order
        assert order == host[::-1], "copy-backs must come back embedding first (forward order)"


def test_auto_policy_charges_only_steps_whose_buckets_were_actually_rolled_back():
    policy = SpeculationPolicy("auto", window=4, max_rollback_rate=0.25)
    clip = Decision("clip", 2.0, 0.5)
    for _ in range(4):  # clipped steps whose first bucket proved the clip: nothing was undone
        policy.record(clip, speculated=True, rolled_back=False)
    assert policy.rollback_rate() == 0.0 and policy.should_speculate()
    policy.record(clip, speculated=True, rolled_back=True)
    policy.record(clip, speculated=True, rolled_back=True)
    assert policy.rollback_rate() == 0.5 and not policy.should_speculate()
    for _ in range(4):  # not speculating: records whether the step would have rolled back
        policy.record(Decision("commit", 1.0, 1.0), speculated=False, rolled_back=False)
    assert policy.should_speculate()


def test_host_threads_auto_leaves_one_core_for_the_training_thread_and_says_so(device_mode):
    assert [auto_host_threads(n) for n in (1, 2, 8, 72)] == [1, 1, 7, 71]
    assert [auto_host_threads(n, device_is_host=True) for n in (1, 2, 8)] == [1, 2, 8]
    model = tiny_llama(num_layers=1)
    with SuperOffloadAdamW(model.parameters(), config=engine_config(host_threads="auto")) as opt:
        # the CPU device runs host jobs inline while the training thread waits: every core
        expected = "jobs run inline" if device_mode == "cpu" else "one left for the training thread"
        assert expected in opt.describe(), opt.describe()


def test_the_device_norm_is_summed_in_chunks_with_the_same_value(monkeypatch):
    flat = torch.randn(10_007, generator=torch.Generator().manual_seed(0))
    whole = float(torch.dot(flat.double(), flat.double()))
    monkeypatch.setattr(stepper, "NORM_CHUNK", 1000)
    seen = []
    original = torch.Tensor.to

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out.dtype == torch.float64:
            seen.append(out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "to", spy)
    chunked = float(stepper.sum_squares_on_device(flat))
    assert max(seen) <= 1000  # never an fp64 copy of the whole bucket
    assert chunked == pytest.approx(whole, rel=1e-12)


def test_speculation_on_says_once_when_rollbacks_dominate_and_what_to_set(caplog):
    """The shipped CPU launch config had `speculation: on`: run_clm.py rolled back 29 of 30 steps
    (every step clipped) without a word. Here every step's norm is just above max_grad_norm, so the
    clip shows only after most buckets were stepped speculatively, and they roll back."""
    model = tiny_llama(num_layers=2)
    batch = tiny_batch()
    model(**batch).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    model.zero_grad()
    config = engine_config(speculation="on", speculation_window=4, device_buckets=0)
    with SuperOffloadAdamW(model.parameters(), lr=1e-6, max_grad_norm=0.95 * norm, config=config) as opt:
        with caplog.at_level("WARNING", logger="superoffload_hf"):
            for _ in range(6):
                model(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
        assert opt.counters.rollbacks >= 5, opt.counters
    said = [r.getMessage() for r in caplog.records if "rolled back and redone" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith('superoffload: speculation "on": 4 of the last 4 steps were rolled back and redone'), said
    assert "set `speculation: auto`" in said[0] and "or `speculation: off`" in said[0], said


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_only_speculation_on_warns_about_rollbacks(mode, caplog):
    policy = SpeculationPolicy(mode, window=2, max_rollback_rate=0.25)
    with caplog.at_level("WARNING", logger="superoffload_hf"):
        for _ in range(4):
            policy.record(Decision("clip", 2.0, 0.5), speculated=True, rolled_back=True)
    assert caplog.records == []
