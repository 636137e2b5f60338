"""The one layout value (plan/layout.py Layout, DESIGN.md section 6): decided once, the same
for the same inputs, printable, what the engine runs with, stored in checkpoints and compared on
load with one notice naming what changed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW, SuperOffloadConfig
from superoffload_hf.plan.layout import Layout, MachineFacts, decide_layout

from _models import engine_config, micro_batches, one_torch_thread, tiny_llama  # noqa: F401
from superoffload_hf.testing.engine_parts import parts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GPU_LIKE = MachineFacts(device_type="cuda", host_is_device=False, asynchronous=True, pin=True, rounds_pinned=True,
                        h2d_gbps=50.0, free_bytes=10**9, total_bytes=2 * 10**9)


def _groups(model):
    return [{"params": list(model.parameters()), "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}]


def test_the_layout_is_the_same_value_for_the_same_inputs_and_prints_every_decision():
    model = tiny_llama(num_layers=2)
    config = SuperOffloadConfig(device_dtype="bf16", bucket_size_mb=0.02, device_buckets=0, weights="flow")
    first = decide_layout(list(model.parameters()), _groups(model), config, GPU_LIKE, model)
    second = decide_layout(list(model.parameters()), _groups(model), config, GPU_LIKE, model)
    assert first == second and str(first) == str(second) and first.to_dict() == second.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.cast = "device"
    text = str(first)
    for decided in ("device cuda bf16", "cast on the host", "gradients cross in bf16", "host state fp32",
                    f"{len(first.bucket_plan.buckets)} of <= {first.bucket_numel} elements", "page-locked",
                    "weights flow, 5 units (model.embed_tokens, model.layers.0, model.layers.1, ...)", "prefetch depth 1"):
        assert decided in text, (decided, text)
    assert first.to_dict()["flowing"] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
                                          "lm_head"]  # forward order
    assert "flow choice 5 of 5 units flow" in text and ": " not in text  # (the CPU device's memory is not decided on)


def test_a_fast_link_casts_on_the_device_and_a_slow_one_on_the_host():
    model = tiny_llama(num_layers=1)
    params, config = list(model.parameters()), SuperOffloadConfig(device_dtype="bf16")
    slow = decide_layout(params, _groups(model), config, GPU_LIKE)
    fast = decide_layout(params, _groups(model), config, dataclasses.replace(GPU_LIKE, h2d_gbps=400.0))
    assert (slow.cast, slow.link_dtype, slow.policy.lowp_dtype) == ("host", torch.bfloat16, torch.bfloat16)
    assert (fast.cast, fast.link_dtype, fast.policy.lowp_dtype) == ("device", torch.float32, None)


def test_the_engine_runs_with_the_decided_value_and_keeps_it_current_after_the_first_step():
    model = tiny_llama()
    with SuperOffloadAdamW(model.parameters(), lr=1e-3, config=engine_config()) as opt:
        engine = parts(opt)
        assert isinstance(engine.layout, Layout) and engine.layout.bucket_plan == engine.plan
        assert engine.layout.policy is engine.buckets.policy
        for step in range(2):  # the first step re-plans from the order the hooks fired
            (batch,) = micro_batches(step)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        assert engine.layout.bucket_plan == engine.plan and engine.learned is not None


def _trained(config: dict, steps: int = 2):
    model = tiny_llama()
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-3, config=config)
    for step in range(steps):
        (batch,) = micro_batches(step)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_the_layout_round_trips_through_a_checkpoint_and_a_changed_one_is_named_on_load(tmp_path, caplog):
    model, opt = _trained(engine_config())
    with opt:
        saved = opt.state_dict()
        assert saved["superoffload"]["layout"] == parts(opt).layout.to_dict()
        torch.save(saved, tmp_path / "opt.pt")
    loaded = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert loaded["superoffload"]["layout"] == saved["superoffload"]["layout"]

    _, same = _trained(engine_config(), steps=0)
    with same, caplog.at_level("WARNING", logger="superoffload_hf"):
        same.load_state_dict(loaded)
    assert not [r for r in caplog.records if "layout" in r.getMessage()]

    caplog.clear()
    _, other = _trained(engine_config(device_buckets=0, bucket_size_mb=0.05), steps=0)
    with other, caplog.at_level("WARNING", logger="superoffload_hf"):
        other.load_state_dict(loaded)
        notices = [r.getMessage() for r in caplog.records if "layout" in r.getMessage()]
        assert len(notices) == 1, notices
        saved_layout = loaded["superoffload"]["layout"]
        ours = parts(other).layout.to_dict()
        assert f"bucket_numel: {saved_layout['bucket_numel']} -> {ours['bucket_numel']}" in notices[0]
