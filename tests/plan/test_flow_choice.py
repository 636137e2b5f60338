"""Per-unit weight placement (plan/flow.py): which units flow under `weights: auto`, at
which prefetch depth, and the exposed transfer time predicted; on the simulated device with a
budget of a quarter of the weights, "auto" keeps some units on the device, stays within the
budget and trains to the same parameters as stationary on the CPU."""

from __future__ import annotations

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.device import SIM_ENV_VAR
from superoffload_hf.plan.flow import (DEVICE_MARGIN_SHARE, UnitCost, choose_depth, choose_flow, choose_weights,
                                                device_margin, device_peak, exposed_seconds, hiding_order,
                                                spread_order)
from superoffload_hf.testing.sim import SimRuntime, on_device

from _models import engine_config, one_torch_thread, params_snapshot, tiny_batch, tiny_llama  # noqa: F401
from superoffload_hf.testing.engine_parts import parts

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180)]

# an embedding (a gather: no multiply), four blocks, a head that computes 8x a block's forward
UNITS = ([UnitCost("embed", 100, 0)] + [UnitCost(f"block{i}", 100, 100) for i in range(4)]
         + [UnitCost("head", 100, 800)])
SECONDS_PER_ELEMENT = 0.01  # a block's forward: 1 s


def test_the_prefetch_depth_grows_when_a_fetch_takes_longer_than_the_compute_it_hides_behind():
    every = choose_flow("flow", UNITS, other_bytes=0, free_bytes=None)
    depths = {}
    for link in (1000.0, 50.0, 30.0, 20.0):  # bytes/s: a block's fetch 0.1, 2, 3.3, 5 s against 1 s of forward
        depths[link] = choose_depth(every, link, SECONDS_PER_ELEMENT).depth
    assert depths == {1000.0: 1, 50.0: 1, 30.0: 3, 20.0: 4}, depths
    # (at 50 B/s a block's backward, 2 s, hides its 2 s fetch: deeper would only hold more weights)
    slow = choose_depth(every, 20.0, SECONDS_PER_ELEMENT)
    assert slow.exposed_s == pytest.approx(exposed_seconds(UNITS, every.flowing, 4, 20.0, SECONDS_PER_ELEMENT))
    assert slow.exposed_s < exposed_seconds(UNITS, every.flowing, 1, 20.0, SECONDS_PER_ELEMENT)
    # the device memory left bounds it: one more unit ahead (100 bytes) fits, two do not
    assert choose_depth(every, 20.0, SECONDS_PER_ELEMENT, headroom_bytes=150).depth == 2


def test_a_fast_link_exposes_only_the_first_fetch_of_each_pass():
    every = choose_flow("flow", UNITS, other_bytes=0, free_bytes=None)
    link = 1000.0  # 0.1 s a fetch
    # forward: the embedding's fetch, then block0's (the embedding computes nothing to hide it);
    # backward: the head's
    assert exposed_seconds(UNITS, every.flowing, 1, link, SECONDS_PER_ELEMENT) == pytest.approx(0.3)
    assert exposed_seconds(UNITS, (False,) * len(UNITS), 1, link, SECONDS_PER_ELEMENT) == 0.0


def test_auto_flows_the_fewest_units_that_fit_the_best_hidden_first():
    # the head first, the embedding last; the equal blocks spread out (ends, then the middles)
    assert hiding_order(UNITS) == [5, 1, 4, 2, 3, 0]
    assert spread_order(8) == [0, 7, 3, 1, 5, 2, 4, 6] and sorted(spread_order(33)) == list(range(33))
    # 600 bytes of weights + 50 other do not fit 450: the head flows, then the blocks; the first two
    # save nothing (a unit and the next are on the device at once), the next two 100 each
    choice = choose_flow("auto", UNITS, other_bytes=50, free_bytes=450)
    assert choice.flowing_names == ("block0", "block1", "block3", "head") and choice.peak_flow == 450
    assert device_peak(UNITS, choice.flowing, 1, 50) == 2 * 100 + 2 * 100 + 50  # 2 kept, a window of 2
    assert device_peak(UNITS, choice.flowing, 2, 50) == 2 * 100 + 3 * 100 + 50
    assert choice.peak_stationary == 650
    assert choose_flow("auto", UNITS, other_bytes=50, free_bytes=449).flowing_names == (
        "block0", "block1", "block2", "block3", "head")
    assert choose_flow("auto", UNITS, other_bytes=50, free_bytes=650).flowing_names == ()
    everything = choose_flow("auto", UNITS, other_bytes=50, free_bytes=100)
    assert all(everything.flowing) and "does not fit" in everything.reason
    assert all(choose_flow("flow", UNITS, other_bytes=0, free_bytes=10**9).flowing)


def test_auto_leaves_the_margin_free_and_a_stationary_choice_is_the_users():
    """The caching allocator's pools (flow's stream, compute's) cannot serve each other: "auto"
    keeps DEVICE_MARGIN_SHARE of the device, or the allocator's measured slack where larger."""
    assert device_margin(1000) == 50 and device_margin(1000, slack_bytes=80) == 80
    margin = choose_flow("auto", UNITS, other_bytes=50, free_bytes=500, margin_bytes=50)
    assert margin.flowing == choose_flow("auto", UNITS, other_bytes=50, free_bytes=450).flowing
    assert margin.peak_flow <= 500 - 50 and (margin.free_bytes, margin.margin_bytes) == (450, 50)
    assert "of 0.000 MB free after a margin of 0.000 MB" in margin.describe()
    assert choose_flow("auto", UNITS, other_bytes=50, free_bytes=650).flowing_names == ()  # fits without one
    assert choose_flow("auto", UNITS, other_bytes=50, free_bytes=650, margin_bytes=1).flowing_names != ()
    assert choose_weights("auto", 600, 50, 650, 1000) == "stationary"
    assert choose_weights("auto", 600, 50, 650, 1000, margin_bytes=1) == "flow"
    assert choose_weights("stationary", 600, 50, 650, 1000, margin_bytes=50) == "stationary"


def test_the_activation_bytes_are_a_config_field_counted_against_the_device():
    assert SuperOffloadConfig().device_activation_bytes == 0
    with pytest.raises(ConfigError, match=r"`device_activation_bytes` is -1; expected an integer >= 0"):
        SuperOffloadConfig(device_activation_bytes=-1)


# ---- the simulated device with a quarter of the weights -----------------------------------------

LAYERS, VOCAB, LR = 16, 64, 1e-2


@pytest.fixture
def quarter_budget(monkeypatch):
    weight_bytes = sum(p.numel() * 4 for p in tiny_llama(LAYERS, vocab_size=VOCAB).parameters())
    SimRuntime.reset_shared(index=1, device_budget_bytes=weight_bytes // 4)
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    yield weight_bytes
    errors = list(SimRuntime.shared().errors)
    SimRuntime.reset_shared()
    assert not errors, errors


def _train(weights: str, activation_bytes: int = 0, steps: int = 3):
    model = tiny_llama(LAYERS, vocab_size=VOCAB)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, weight_decay=1e-2, model=model, max_grad_norm=1.0,
                            config=engine_config(device_buckets=0, bucket_size_mb=0.01, weights=weights,
                                                 speculation="on", device_activation_bytes=activation_bytes))
    for step in range(steps):
        model(**tiny_batch(vocab_size=VOCAB, seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    masters = [v["master_param"].clone() for _, v in sorted(opt.state_dict()["state"].items())]
    return model, opt, masters


def test_auto_keeps_some_units_on_a_quarter_budget_and_trains_like_stationary_on_the_cpu(quarter_budget):
    with pytest.MonkeyPatch.context() as mp:  # the CPU device
        mp.delenv(SIM_ENV_VAR)
        *_, want = _train("stationary")
    with on_device(1):
        model, opt, got = _train("auto")
        with opt:
            layout = parts(opt).layout
            flowing, units = sum(layout.flow_choice.flowing), len(layout.flow_choice.units)
            assert 0 < flowing < units == 19, str(layout)
            assert len(layout.flow.units) == flowing and parts(opt).flow.fetches > 0
            peak = opt.device_memory_peak()
            assert peak <= quarter_budget // 4, (peak, quarter_budget // 4)
            # what stays is what hides worst: the embedding
            assert "model.embed_tokens" not in layout.flow_choice.flowing_names
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"parameter {i} differs from stationary on the CPU"


def test_auto_on_the_simulated_device_leaves_the_margin_of_its_memory_free(monkeypatch):
    """A budget of half the weights, where the margin makes one more unit flow (13, not 12)."""
    budget = sum(p.numel() * 4 for p in tiny_llama(LAYERS, vocab_size=VOCAB).parameters()) // 2
    SimRuntime.reset_shared(index=1, device_budget_bytes=budget)
    monkeypatch.setenv(SIM_ENV_VAR, "1")
    try:
        with on_device(1):
            _, opt, _ = _train("auto", steps=1)
            with opt:
                choice = parts(opt).layout.flow_choice
                margin = int(DEVICE_MARGIN_SHARE * budget)  # the simulated device has no allocator slack
                assert choice.margin_bytes == margin and choice.peak_flow <= choice.free_bytes
                without = choose_flow("auto", choice.units, other_bytes=choice.other_bytes,
                                      free_bytes=choice.free_bytes + margin)
                assert (sum(choice.flowing), sum(without.flowing)) == (13, 12)
                assert without.peak_flow > choice.free_bytes  # without the margin it would have eaten into it
                assert opt.device_memory_peak() <= budget - margin
        assert not SimRuntime.shared().errors
    finally:
        SimRuntime.reset_shared()


def test_activation_bytes_make_auto_flow_more_units(quarter_budget):
    with on_device(1):
        _, without, _ = _train("auto", steps=0)
        with without:
            fewer = sum(parts(without).layout.flow_choice.flowing)
        _, with_activations, _ = _train("auto", activation_bytes=quarter_budget // 16, steps=0)
        with with_activations:
            more = sum(parts(with_activations).layout.flow_choice.flowing)
    assert fewer < more, (fewer, more)


def _steps(model, opt, steps: int) -> None:
    for step in range(steps):
        model(**tiny_batch(seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()


def test_the_engine_takes_the_depth_the_measured_link_and_forward_call_for_and_trains_alike_at_it():
    """(engine/core.py _choose_prefetch_depth, which an accelerator's first step runs, called here
    with a made-up measurement: a link far slower than the forward)"""
    from superoffload_hf.plan.cost_model import Bandwidth, Machine, Workload

    def make(weights):
        model = tiny_llama(num_layers=4)
        return model, SuperOffloadAdamW(model.parameters(), lr=LR, model=model, max_grad_norm=1.0,
                                        config=engine_config(device_buckets=0, weights=weights, speculation="on"))

    model, opt = make("stationary")
    with opt:
        _steps(model, opt, 3)
        want = params_snapshot(model)
    model, opt = make("flow")
    with opt:
        engine = parts(opt)
        link = Bandwidth.constant(1e-5)  # GB/s: a block's fetch takes seconds, the forward one
        machine = Machine(name="made up", h2d=link, d2h=link, host_adam_rate=1e9, host_adam_rate_busy=1e9,
                          device_adam_rate=1e9, device_free_bytes=1e9)
        workload = Workload(num_params=sum(p.numel() for p in model.parameters()), forward_s=1.0, backward_s=2.0)
        before = engine.layout.flow_choice
        assert before.depth == 1 and before.exposed_s is None
        engine._choose_prefetch_depth(machine, workload)
        expected = choose_depth(before, 1e4, 1.0 / sum(u.compute for u in before.units),
                                headroom_bytes=int(engine.runtime.memory_info()[0]))
        assert engine.layout.flow_choice == expected and expected.depth > 1
        assert engine.flow.plan.depth == engine.layout.flow.depth == expected.depth
        assert f"prefetch depth {expected.depth}" in opt.describe() and "ms a step" in str(engine.layout)
        _steps(model, opt, 3)
        got = params_snapshot(model)  # (the documented read: the flowing units are fetched for it)
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name}: depth {expected.depth} differs from stationary"
