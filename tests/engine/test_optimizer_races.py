"""Races: models whose layers are so small that every bucket holds one or two parameters, so a
missing wait (a forward reading a weight before its host step landed, a host step reading a
gradient before it was staged, a rollback racing a speculative step) shows up as a wrong number.

Every parameter is compared with torch after every step, and so is every forward output: the
forward that follows step() must see the updated weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from superoffload_hf import SuperOffloadAdamW

from _models import (  # noqa: F401  (one_torch_thread is a fixture)
    GradPoison,
    RelativeMaxNorm,
    assert_close_fast,
    assert_params_close,
    engine_config,
    micro_batches,
    one_torch_thread,
    tiny_llama,
)

pytestmark = [pytest.mark.usefixtures("one_torch_thread", "device_mode"), pytest.mark.timeout(180)]

LR = 1e-3
HUGE, TINY = 1e6, 1e-3
WIDTH = 8


class TinyLayers(nn.Module):
    """24 Linear(8, 8) + tanh: 48 parameters of 64 and 8 elements."""

    def __init__(self, num_layers: int = 24, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, WIDTH, generator=generator), torch.randn(16, WIDTH, generator=generator)


MILD = RelativeMaxNorm(0.9)  # clips by ~10%: speculated buckets are rolled back and replayed


def clip_for(step: int, with_tiny: bool = True):
    """No clipping, mild clipping, and (with_tiny) clipping to 1e-3, in turn."""
    return [HUGE, MILD, TINY if with_tiny else MILD][step % 3]


def reference_update(ref_model, ref_opt, max_norm) -> tuple[bool, float]:
    """clip_grad_norm_, skip on non-finite, step. Returns (skipped, the max norm used)."""
    params = list(ref_model.parameters())
    if isinstance(max_norm, RelativeMaxNorm):
        max_norm = max_norm.resolve(float(torch.nn.utils.get_total_norm([p.grad for p in params])))
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    skipped = not math.isfinite(float(total))
    if not skipped:
        ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    return skipped, max_norm


def offload_update(opt, max_norm: float) -> bool:
    opt.max_grad_norm = max_norm
    opt.step()
    opt.zero_grad(set_to_none=True)
    return bool(opt.last_step_skipped)


def compare_outputs(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert_close_fast(got.detach(), want.detach(), 1e-5, 1e-6, lambda m: f"{where}: forward output: {m}")


@pytest.mark.parametrize("rollback", ["inverse", "snapshot"])
@pytest.mark.parametrize("bucket_size_mb", [0.0002, 0.0003])  # 1 parameter / 2 parameters per bucket
@pytest.mark.parametrize("device_buckets", [0, 1])
def test_many_tiny_layers_match_torch_after_every_step(device_buckets, bucket_size_mb, rollback):
    model, ref_model = TinyLayers(), TinyLayers()
    config = engine_config(speculation="on", bucket_size_mb=bucket_size_mb, device_buckets=device_buckets,
                           host_threads=2, rollback=rollback)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=config)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, foreach=False)
    poisons = (GradPoison(model.layers[5].weight, {9: math.inf}),
               GradPoison(ref_model.layers[5].weight, {9: math.inf}))
    probe = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(99))
    try:
        for step in range(30):
            where = f"step {step}"
            for poison in poisons:
                poison.step = step
            x, y = mlp_batch(step)
            out, ref_out = model(x), ref_model(x)
            compare_outputs(out, ref_out, f"{where}, training forward")
            ((out - y) ** 2).mean().backward()
            ((ref_out - y) ** 2).mean().backward()
            ref_skipped, max_norm = reference_update(ref_model, ref_opt, clip_for(step))
            assert offload_update(opt, max_norm) == ref_skipped == (step == 9), where
            with torch.no_grad():
                compare_outputs(model(probe), ref_model(probe), f"{where}, forward right after step()")
            assert_params_close(model, ref_model, where)
        assert opt.counters.rollbacks > 0 and opt.counters.speculative_steps > 0, opt.counters.as_dict()
    finally:
        opt.close()


@pytest.mark.parametrize("device_buckets, weights", [(0, "stationary"), (1, "stationary"), (0, "flow")])
def test_tiny_llama_with_twelve_layers_matches_torch_after_every_step(device_buckets, weights):
    model, ref_model = tiny_llama(12, hidden_size=16), tiny_llama(12, hidden_size=16)
    config = engine_config(speculation="on", bucket_size_mb=0.001, device_buckets=device_buckets,
                           host_threads=2, weights=weights)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=config, model=model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, foreach=False)
    try:
        for step in range(12):
            batch = micro_batches(step, seq=8)[0]
            out, ref_out = model(**batch), ref_model(**batch)
            compare_outputs(out.logits, ref_out.logits, f"step {step}, training forward")
            out.loss.backward()
            ref_out.loss.backward()
            # (no 1e-3 clipping here: test_optimizer_equivalence covers that regime)
            ref_skipped, max_norm = reference_update(ref_model, ref_opt, clip_for(step, with_tiny=False))
            assert offload_update(opt, max_norm) == ref_skipped
            assert_params_close(model, ref_model, f"step {step}")
        assert opt.counters.rollbacks > 0, opt.counters.as_dict()
        assert (opt.counters.weight_fetches > 0) == (weights == "flow"), opt.counters.as_dict()
    finally:
        opt.close()


def test_parameter_reads_right_after_step_see_the_update_without_a_forward():
    """model.state_dict() right after step() (what a checkpoint saves) holds the updated weights."""
    model, ref_model = TinyLayers(), TinyLayers()
    config = engine_config(speculation="on", bucket_size_mb=0.0002, device_buckets=0, host_threads=2)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=config)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, foreach=False)
    try:
        for step in range(10):
            x, y = mlp_batch(step)
            ((model(x) - y) ** 2).mean().backward()
            ((ref_model(x) - y) ** 2).mean().backward()
            _, max_norm = reference_update(ref_model, ref_opt, clip_for(step))
            offload_update(opt, max_norm)
            saved = {name: t.clone() for name, t in model.state_dict().items()}
            assert_params_close(ref_model, saved, f"step {step}: model.state_dict() right after step()")
    finally:
        opt.close()


def test_zero_grad_without_set_to_none_still_matches_torch():
    """zero_grad(set_to_none=False) must not leave stale gradients that a later step re-reads."""
    model, ref_model = TinyLayers(8), TinyLayers(8)
    config = engine_config(speculation="on", bucket_size_mb=0.0003, device_buckets=1, host_threads=2)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=config)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, foreach=False)
    try:
        for step in range(8):
            x, y = mlp_batch(step)
            ((model(x) - y) ** 2).mean().backward()
            ((ref_model(x) - y) ** 2).mean().backward()
            max_norm = [HUGE, TINY][step % 2]
            torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), max_norm)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=False)
            opt.max_grad_norm = max_norm
            opt.step()
            opt.zero_grad(set_to_none=False)
            assert_params_close(model, ref_model, f"step {step}")
    finally:
        opt.close()
