"""Checkpoints: the state dict is plain CPU fp32 tensors and primitives, survives torch.save /
torch.load(weights_only=True) from any map location and dtype, and resuming mid-run continues
bit-identically with an uninterrupted run."""

from __future__ import annotations

import io
import math
from typing import Callable

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.engine import checkpoint

from _models import (  # noqa: F401  (one_torch_thread is a fixture)
    GradPoison,
    RelativeMaxNorm,
    assert_params_close,
    assert_state_equal,
    engine_config,
    micro_batches,
    offload_step,
    one_torch_thread,
    reference_step,
    state_tensors,
    tiny_llama,
)
from superoffload_hf.testing.engine_parts import parts

pytestmark = [pytest.mark.usefixtures("one_torch_thread", "device_mode"), pytest.mark.timeout(180)]

LR = 1e-3
HUGE, TINY = 1e6, 1e-3


def alternating(step: int) -> float:
    return HUGE if step % 2 == 0 else TINY


def build(config: dict, seed: int = 0, **model_kwargs):
    model = tiny_llama(seed=seed, **model_kwargs)
    return model, SuperOffloadAdamW(model.parameters(), lr=LR, config=config, model=model)


def train(model, opt, steps: range, poison_steps: dict[int, float] | None = None) -> None:
    poison = GradPoison(model.lm_head.weight, poison_steps or {})
    for step in steps:
        poison.step = step
        offload_step(model, opt, micro_batches(step), alternating(step))
    poison.handle.remove()


def save_and_load(obj, map_location="cpu"):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location=map_location, weights_only=True)


def map_tensors(obj, fn: Callable[[torch.Tensor], torch.Tensor]):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(value, fn) for value in obj)
    return obj


def non_contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        return t.clone()
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    strided = wide[..., ::2]
    strided.copy_(t)
    assert not strided.is_contiguous()
    return strided


ARRIVALS: dict[str, Callable] = {
    "as_saved": lambda t: t,
    "float64": lambda t: t.to(torch.float64) if t.is_floating_point() else t,
    "non_contiguous": non_contiguous_copy,
    "float64_non_contiguous": lambda t: non_contiguous_copy(t.to(torch.float64) if t.is_floating_point() else t),
}


def assert_runs_equal(model, opt, full_model, full_opt, where: str) -> None:
    assert_params_close(model, full_model, where, exact=True)
    assert_state_equal(state_tensors(opt), state_tensors(full_opt), where)


def assert_plain_cpu_fp32(obj, path: str = "state_dict") -> None:
    if isinstance(obj, torch.Tensor):
        assert obj.device.type == "cpu" and obj.dtype == torch.float32, f"{path}: {obj.dtype} on {obj.device}"
    elif isinstance(obj, dict):
        for key, value in obj.items():
            assert isinstance(key, (str, int)), f"{path}: key {key!r} is a {type(key).__name__}"
            assert_plain_cpu_fp32(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            assert_plain_cpu_fp32(value, f"{path}[{index}]")
    else:
        assert obj is None or isinstance(obj, (bool, int, float, str)), f"{path}: {type(obj).__name__}"


def compact_config(precision: str) -> dict:
    """Compact host state: bf16 device weights (the default back end: the GraceAdam kernel)."""
    return {} if precision == "fp32" else {"state_precision": precision, "device_dtype": "bf16"}


COMPACT_MODEL = {"hidden_size": 40}  # norm weights of 40 elements: padded slots


@pytest.mark.parametrize("speculation, rollback, precision, weights", [
    ("on", "inverse", "fp32", "stationary"), ("off", "inverse", "fp32", "stationary"),
    ("auto", "inverse", "fp32", "stationary"), ("on", "snapshot", "fp32", "stationary"),
    ("on", "inverse", "compact", "stationary"),
    ("on", "inverse", "fp32", "flow"), ("on", "snapshot", "compact", "flow"),  # (weight-flow: no device bucket)
])
def test_resume_mid_run_continues_bit_identically(speculation, rollback, precision, weights):
    flow = {"weights": "flow", "device_buckets": 0} if weights == "flow" else {}
    config = engine_config(speculation=speculation, rollback=rollback, **compact_config(precision), **flow)
    model_kwargs = COMPACT_MODEL if precision != "fp32" else {}
    poison = {3: math.inf, 7: math.nan}  # a skipped step before and after the checkpoint
    full_model, full_opt = build(config, **model_kwargs)
    model, opt = build(config, **model_kwargs)
    try:
        train(full_model, full_opt, range(5), poison)
        train(model, opt, range(5), poison)
        model_state, opt_state = save_and_load(model.state_dict()), save_and_load(opt.state_dict())
        opt.close()
        model = tiny_llama(seed=1, **model_kwargs)  # different weights: the checkpoint must restore them
        model.load_state_dict(model_state)
        opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=config, model=model)
        opt.load_state_dict(opt_state)
        if weights == "flow":
            assert "weights flow" in opt.describe(), opt.describe()
        if precision != "fp32":  # the compact bytes themselves were saved (the host buckets' parameters)
            assert opt_state["superoffload"]["state_precision"] == precision
            assert "master_bf16" in opt_state["state"][len(opt_state["state"]) - 1]
        assert_runs_equal(model, opt, full_model, full_opt, "right after load")
        for step in range(5, 10):
            train(full_model, full_opt, range(step, step + 1), poison)
            train(model, opt, range(step, step + 1), poison)
            assert_runs_equal(model, opt, full_model, full_opt, f"step {step}")
            assert opt.last_step_skipped == full_opt.last_step_skipped
    finally:
        full_opt.close()
        opt.close()


def test_resume_with_the_optimizer_built_before_the_weights_are_loaded():
    """Accelerate's load_state order: prepare (optimizer exists), then model weights, then
    optimizer state. The host master copies must follow the checkpoint, not the fresh init."""
    config = engine_config(speculation="on")
    full_model, full_opt = build(config)
    model, opt = build(config)
    try:
        train(full_model, full_opt, range(5))
        train(model, opt, range(5))
        model_state, opt_state = save_and_load(model.state_dict()), save_and_load(opt.state_dict())
        opt.close()
        model, opt = build(config, seed=1)
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)
        for step in range(5, 9):
            train(full_model, full_opt, range(step, step + 1))
            train(model, opt, range(step, step + 1))
            assert_runs_equal(model, opt, full_model, full_opt, f"step {step}")
    finally:
        full_opt.close()
        opt.close()


@pytest.mark.parametrize("map_location", ["cpu", None])
@pytest.mark.parametrize("arrival", list(ARRIVALS))
def test_state_dict_loads_from_any_map_location_and_dtype(arrival, map_location):
    config = engine_config(speculation="on")
    full_model, full_opt = build(config)
    model, opt = build(config)
    try:
        train(full_model, full_opt, range(4))
        train(model, opt, range(4))
        saved = opt.state_dict()
        opt_state = map_tensors(save_and_load(saved, map_location), ARRIVALS[arrival])
        model_state = save_and_load(model.state_dict(), map_location)
        opt.close()
        model = tiny_llama(seed=2)
        model.load_state_dict(model_state)
        opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=config)
        opt.load_state_dict(opt_state)
        reloaded = opt.state_dict()
        assert_plain_cpu_fp32(reloaded)
        assert_state_equal(state_tensors(opt), {k: v.reshape(-1) for k, v in _flat(saved).items()}, "after load")
        for step in range(4, 7):
            train(full_model, full_opt, range(step, step + 1))
            train(model, opt, range(step, step + 1))
            assert_runs_equal(model, opt, full_model, full_opt, f"step {step}")
    finally:
        full_opt.close()
        opt.close()


def _flat(state_dict: dict) -> dict:
    return {(int(i), key): value for i, entry in state_dict["state"].items()
            for key, value in entry.items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("device_buckets", [0, 1])
def test_state_dict_holds_only_cpu_fp32_tensors_and_primitives(device_buckets):
    model, opt = build(engine_config(speculation="on", device_buckets=device_buckets))
    try:
        train(model, opt, range(3))
        state_dict = opt.state_dict()
        assert_plain_cpu_fp32(state_dict)
        assert set(state_dict) >= {"state", "param_groups"}
        params = list(model.parameters())
        indices = sorted(i for group in state_dict["param_groups"] for i in group["params"])
        assert indices == list(range(len(params)))
        assert sorted(int(i) for i in state_dict["state"]) == indices, "every parameter has state"
        for index, param in enumerate(params):
            entry = state_dict["state"][index]
            for key in ("exp_avg", "exp_avg_sq"):
                assert entry[key].numel() == param.numel(), f"param {index} {key}: per-parameter layout"
            assert float(entry["step"]) == 3
        loaded = save_and_load(state_dict)
        assert_state_equal({k: v.reshape(-1) for k, v in _flat(loaded).items()},
                           {k: v.reshape(-1) for k, v in _flat(state_dict).items()}, "torch.load")
    finally:
        opt.close()


def test_state_dict_of_a_fresh_optimizer_round_trips():
    config = engine_config(speculation="on")
    a_model, a_opt = build(config)
    b_model, b_opt = build(config)
    try:
        b_opt.load_state_dict(save_and_load(b_opt.state_dict()))
        for step in range(4):
            train(a_model, a_opt, range(step, step + 1))
            train(b_model, b_opt, range(step, step + 1))
            assert_runs_equal(b_model, b_opt, a_model, a_opt, f"step {step}")
    finally:
        a_opt.close()
        b_opt.close()


@pytest.mark.parametrize("other", [
    {"num_layers": 2},  # fewer parameters
    {"vocab_size": 64},  # same parameters, different shapes
])
def test_loading_the_state_dict_of_another_model_raises(other):
    config = engine_config(speculation="on")
    other_model, other_opt = build(config, **other)
    model, opt = build(config)
    try:
        other_model(**micro_batches(0, vocab_size=64)[0]).loss.backward()
        other_opt.step()
        with pytest.raises((ValueError, RuntimeError)) as info:
            opt.load_state_dict(save_and_load(other_opt.state_dict()))
        assert len(str(info.value)) > 20, f"unclear error: {info.value!r}"
    finally:
        other_opt.close()
        opt.close()


@pytest.mark.parametrize("resume_config", [
    {"bucket_size_mb": 0.05, "device_buckets": 0},
    {"bucket_size_mb": 0.008, "device_buckets": 2},
])
def test_checkpoint_taken_with_one_bucket_size_resumes_under_another(resume_config):
    """The state dict is per parameter, so the bucket layout may change across a resume. The
    norm is summed over other buckets and device buckets may round differently: tight fp32
    tolerance, not bitwise. Both runs are also checked against torch."""
    config = engine_config(speculation="on")
    full_model, full_opt = build(config)
    model, opt = build(config)
    ref_model = tiny_llama()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, foreach=False)
    mild = RelativeMaxNorm(0.9)  # (1e-3 clipping is covered, against torch, by test_optimizer_equivalence)

    def step_all(models_and_opts, step):
        threshold = reference_step(ref_model, ref_opt, micro_batches(step), mild).max_grad_norm
        for m, o in models_and_opts:
            offload_step(m, o, micro_batches(step), threshold)

    try:
        for step in range(5):
            step_all([(full_model, full_opt), (model, opt)], step)
        model_state, opt_state = save_and_load(model.state_dict()), save_and_load(opt.state_dict())
        opt.close()
        model = tiny_llama(seed=3)
        model.load_state_dict(model_state)
        opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=engine_config(speculation="on", **resume_config))
        opt.load_state_dict(opt_state)
        for step in range(5, 10):
            step_all([(full_model, full_opt), (model, opt)], step)
            assert_params_close(model, full_model, f"step {step} vs uninterrupted")
            assert_params_close(model, ref_model, f"step {step} vs torch")
        assert float(opt.state_dict()["state"][0]["step"]) == 10
    finally:
        full_opt.close()
        opt.close()


def test_loaded_param_group_hyperparameters_take_effect():
    """load_state_dict restores param_groups (lr etc.), as torch's does."""
    config = engine_config(speculation="off")
    model, opt = build(config)
    try:
        opt.param_groups[0]["lr"] = 7e-4
        state = save_and_load(opt.state_dict())
        opt.close()
        model, opt = build(config)
        opt.load_state_dict(state)
        assert opt.param_groups[0]["lr"] == 7e-4
        ref_model = tiny_llama()
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=7e-4, foreach=False)
        for step in range(3):
            reference_step(ref_model, ref_opt, micro_batches(step), alternating(step))
            offload_step(model, opt, micro_batches(step), alternating(step))
            assert_params_close(model, ref_model, f"step {step}")
    finally:
        opt.close()


def test_state_damaged_after_saving_is_refused_naming_the_tensor_and_changes_nothing():
    # Finite garbage in a moment: without a checksum this resumed "successfully" to a wrong run.
    config = engine_config(speculation="on")
    model, opt = build(config)
    fresh_model, fresh_opt = build(config)
    try:
        train(model, opt, range(2))
        saved = save_and_load(opt.state_dict())
        assert set(saved["superoffload"]["checksums"]) == set(saved["state"])
        before = state_tensors(fresh_opt)
        index = sorted(saved["state"])[-1]
        saved["state"][index]["exp_avg_sq"].view(-1)[:16] = 0.125
        with pytest.raises(checkpoint.CorruptStateError, match=rf"state\[{index}\]\['exp_avg_sq'\].*checksum.*earlier checkpoint"):
            fresh_opt.load_state_dict(saved)
        assert_state_equal(state_tensors(fresh_opt), before, "after the refused load")
        del saved["superoffload"]["checksums"]  # a state dict saved without checksums loads unchecked
        fresh_opt.load_state_dict(saved)
    finally:
        opt.close()
        fresh_opt.close()


# ---- compact state: conversion and size ----------------------------------------------------------


def _trained_state(config: dict, steps: int = 3) -> tuple[dict, dict]:
    model, opt = build(config, **COMPACT_MODEL)
    try:
        train(model, opt, range(steps))
        return save_and_load(model.state_dict()), save_and_load(opt.state_dict())
    finally:
        opt.close()


def _fresh(config: dict, model_state: dict):
    model = tiny_llama(seed=1, **COMPACT_MODEL)
    model.load_state_dict(model_state)
    return model, SuperOffloadAdamW(model.parameters(), lr=LR, config=config)


def test_fp32_checkpoint_loads_into_compact_state_encoded_with_one_notice(caplog):
    from superoffload_hf.host import compact

    fp32 = engine_config(speculation="off", device_buckets=0, device_dtype="bf16")
    model_state, opt_state = _trained_state(fp32)
    model, opt = _fresh(engine_config(speculation="off", device_buckets=0, **compact_config("compact")), model_state)
    try:
        with caplog.at_level("WARNING", logger="superoffload_hf"):
            opt.load_state_dict(opt_state)
        notices = [r.getMessage() for r in caplog.records if "converted" in r.getMessage()]
        n = len(opt_state["state"])
        assert notices == [f"SuperOffload: converted the saved optimizer state of {n} parameters from fp32 to "
                           "compact (this optimizer's state precision there)"], notices
        for index, entry in opt.state_dict()["state"].items():
            saved = opt_state["state"][index]
            want = compact.empty_state(saved["exp_avg"].numel(), "compact")
            compact.compact_encode_(*want, *(saved[k].reshape(-1) for k in ("master_param", "exp_avg", "exp_avg_sq")))
            for key, value in zip(("master_bf16", "master_err", "exp_avg_q", "exp_avg_scale", "exp_avg_sq_q",
                                   "exp_avg_sq_scale"), want):
                assert torch.equal(entry[key], value), f"parameter {index} {key}"
            assert int(entry["step"]) == int(saved["step"])
        for name, p in model.named_parameters():  # the device weights are the encoded masters
            index = [q is p for q in model.parameters()].index(True)
            assert torch.equal(p.detach().reshape(-1), opt.state_dict()["state"][index]["master_bf16"]), name
    finally:
        opt.close()


def test_compact_checkpoint_loads_into_fp32_state_decoded_with_one_notice(caplog):
    from superoffload_hf.host import compact

    model_state, opt_state = _trained_state(engine_config(speculation="off", **compact_config("compact")))
    model, opt = _fresh(engine_config(speculation="off", device_dtype="bf16"), model_state)
    try:
        with caplog.at_level("WARNING", logger="superoffload_hf"):
            opt.load_state_dict(opt_state)
        compact_entries = [i for i, e in opt_state["state"].items() if "master_bf16" in e]
        notices = [r.getMessage() for r in caplog.records if "converted" in r.getMessage()]
        assert notices == [f"SuperOffload: converted the saved optimizer state of {len(compact_entries)} parameters "
                           "from compact to fp32 (this optimizer's state precision there)"], notices
        got = opt.state_dict()["state"]
        for index in compact_entries:
            saved = opt_state["state"][index]
            n = saved["master_bf16"].numel()
            want = [torch.empty(n) for _ in range(3)]
            compact.compact_decode(*(saved[k] for k in ("master_bf16", "master_err", "exp_avg_q", "exp_avg_scale",
                                                         "exp_avg_sq_q", "exp_avg_sq_scale")), *want)
            for key, value in zip(("master_param", "exp_avg", "exp_avg_sq"), want):
                assert torch.equal(got[index][key].reshape(-1), value), f"parameter {index} {key}"
    finally:
        opt.close()


@pytest.mark.parametrize("precision, low, high", [("compact", 5.0, 5.5), ("compact32", 6.0, 6.5), ("fp32", 12.0, 12.5)])
def test_a_checkpoint_file_stores_the_compact_bytes(tmp_path, precision, low, high):
    """~5-6 B/param on disk for compact state (12 for fp32): the bytes, not a decoded copy."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False))
    config = engine_config(**{"speculation": "off", "device_buckets": 0, "device_dtype": "bf16",
                              **compact_config(precision)})
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=config)
    try:
        model(torch.randn(4, 512, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
        torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
        per_param = (tmp_path / "optimizer.pt").stat().st_size / (512 * 512)
        assert low <= per_param <= high, per_param
    finally:
        opt.close()


def test_a_replan_moves_compact_bytes_as_they_are_and_converts_across_residency():
    """Re-planned with more device-resident buckets, a parameter that moves to the device gets the
    decoded (fp32) state of its compact bytes; one that stays on the host keeps its bytes; moved
    back, it is encoded again (engine/state/precision.py)."""
    from superoffload_hf.host import compact

    keys = ("master_bf16", "master_err", "exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale")
    model, opt = build(engine_config(speculation="off", device_buckets=0, **compact_config("compact")), **COMPACT_MODEL)
    try:
        train(model, opt, range(2))
        engine = parts(opt)
        before = map_tensors(opt.state_dict()["state"], torch.clone)
        engine.replan(engine.layout.plan(2))
        moved = {s.index for b in engine.plan.buckets if b.device_resident for s in b.slots}
        assert moved
        after = opt.state_dict()["state"]
        for index, entry in before.items():
            if index in moved:
                want = [torch.empty(entry["master_bf16"].numel()) for _ in range(3)]
                compact.compact_decode(*(entry[k] for k in keys), *want)
                got = [after[index][k].reshape(-1) for k in ("master_param", "exp_avg", "exp_avg_sq")]
                assert all(torch.equal(g, w) for g, w in zip(got, want)), index
            else:
                assert all(torch.equal(after[index][k], entry[k]) for k in keys), index
        fp32 = map_tensors(after, torch.clone)
        engine.replan(engine.layout.plan(0))
        back = opt.state_dict()["state"]
        for index in moved:
            want = compact.empty_state(fp32[index]["exp_avg"].numel(), "compact")
            compact.compact_encode_(*want, *(fp32[index][k].reshape(-1) for k in ("master_param", "exp_avg", "exp_avg_sq")))
            assert all(torch.equal(back[index][k], w) for k, w in zip(keys, want)), index
        train(model, opt, range(2, 3))  # and it trains on
    finally:
        opt.close()
