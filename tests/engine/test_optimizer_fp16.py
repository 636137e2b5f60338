"""fp16 device parameters with dynamic loss scaling owned by the optimizer.

The reference is torch.amp.GradScaler's policy written out by hand around fp32 master weights:
backward of loss * scale on an fp16 model, unscale the fp16 gradients into fp32 (1/scale is a
power of two: exact), clip_grad_norm_, skip + back off on a non-finite norm, otherwise
AdamW on the fp32 masters, round them into the fp16 model, and grow the scale after
`growth_interval` consecutive good steps.

Chaos control. An fp32 ulp of difference between the engine's masters (fma) and torch's now
and then rounds an fp16 weight the other way, and one fp16 ulp in one weight moves that forward's
gradients at the 1e-3 level, after which near-zero Adam moments can flip sign: per element, two
fp16 runs drift apart by up to ~lr per step. So before each step the reference model takes the
engine model's fp16 weights (`follow`): both forwards are then identical, the gradients bitwise
equal, and the masters and moments differ only by the Adam kernels' rounding: tight fp32 tolerance.
That the engine's fp16 weights are its masters rounded to fp16 is checked bitwise.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW

from _models import (  # noqa: F401  (one_torch_thread is a fixture)
    GradPoison,
    assert_close_fast,
    engine_config,
    micro_batches,
    one_torch_thread,
    tiny_llama,
)

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(180)]

LR = 1e-3
FP16 = torch.float16


def fp16_config(**changes) -> dict:
    base = {"device_dtype": "fp16", "loss_scale_init": 2.0**10, "loss_scale_growth_interval": 3}
    base.update(changes)
    return engine_config(**base)


class ManualScaler:
    """GradScaler's policy around fp32 masters of an fp16 model (the test's reference)."""

    def __init__(self, model: torch.nn.Module, scale: float, growth_interval: int,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5):
        self.model = model
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=LR, foreach=False)
        self.scale, self.good_steps = scale, 0
        self.growth_interval, self.growth_factor, self.backoff_factor = growth_interval, growth_factor, backoff_factor

    def follow(self, engine_model: torch.nn.Module) -> None:
        """Take the engine model's fp16 weights for the next forward (see the module docstring)."""
        with torch.no_grad():
            for p, engine_p in zip(self.model.parameters(), engine_model.parameters()):
                p.copy_(engine_p)

    def step(self, batch: dict, max_grad_norm) -> tuple[bool, float]:
        self.accumulate(batch)
        return self.finish(max_grad_norm)

    def accumulate(self, batch: dict, micro_batches: int = 1) -> None:
        """Backward of one micro-batch; its fp16 gradients are summed in fp32 (as the engine does)."""
        (self.model(**batch).loss / micro_batches * self.scale).backward()
        for master, p in zip(self.masters, self.model.parameters()):
            grad = p.grad.float()
            master.grad = grad if master.grad is None else master.grad + grad
            p.grad = None

    def finish(self, max_grad_norm) -> tuple[bool, float]:
        for master in self.masters:
            master.grad.mul_(1.0 / self.scale)
        max_norm = math.inf if max_grad_norm is None else max_grad_norm
        norm = float(torch.nn.utils.clip_grad_norm_(self.masters, max_norm))
        skipped = not math.isfinite(norm)
        if skipped:
            self.scale *= self.backoff_factor
            self.good_steps = 0
        else:
            self.opt.step()
            with torch.no_grad():
                for master, p in zip(self.masters, self.model.parameters()):
                    p.copy_(master)
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        self.opt.zero_grad(set_to_none=True)
        return skipped, norm


def offload_fp16_step(model, opt, batch: dict, max_grad_norm) -> tuple[bool, float]:
    opt.max_grad_norm = max_grad_norm
    opt.scale_loss(model(**batch).loss).backward()
    opt.step()
    opt.zero_grad()
    return bool(opt.last_step_skipped), float(opt.last_grad_norm)


def masters_of(opt) -> list[torch.Tensor]:
    state = opt.state_dict()["state"]
    return [state[i]["master_param"].reshape(-1) for i in sorted(state)]


def assert_masters_close(opt, scaler: ManualScaler, where: str) -> None:
    got = masters_of(opt)
    if not scaler.opt.state:  # nothing stepped yet (every step so far skipped): nor may the engine
        assert not got, f"{where}: the engine has state although every step was skipped"
        return
    assert len(got) == len(scaler.masters), f"{where}: {len(got)} masters, reference {len(scaler.masters)}"
    for index, (mine, ref) in enumerate(zip(got, scaler.masters)):
        assert_close_fast(mine, ref.detach().reshape(-1), 1e-5, 1e-6,
                          lambda m, i=index: f"{where}: master_param of parameter {i}: {m}")
    assert_moments_carry_the_unscaled_gradient(opt, scaler, where)


def assert_moments_carry_the_unscaled_gradient(opt, scaler: ManualScaler, where: str) -> None:
    state, ref_state = opt.state_dict()["state"], scaler.opt.state_dict()["state"]
    for index in sorted(ref_state):
        for key in ("exp_avg", "exp_avg_sq"):
            ref = ref_state[index][key].reshape(-1)
            atol = 1e-5 * float(ref.abs().max()) + 1e-30
            assert_close_fast(state[index][key].reshape(-1), ref, 1e-5, atol,
                              lambda m, i=index, k=key: f"{where}: {k} of parameter {i}: {m}")


def assert_device_params_are_rounded_masters(model, opt, where: str) -> None:
    for index, (p, master) in enumerate(zip(model.parameters(), masters_of(opt))):
        assert p.dtype == FP16, f"{where}: parameter {index} is {p.dtype}"
        assert torch.equal(p.detach().reshape(-1), master.to(FP16)), (
            f"{where}: fp16 parameter {index} is not its master rounded to fp16")


def pair(speculation: str = "on", **changes):
    model, ref_model = tiny_llama(dtype=FP16), tiny_llama(dtype=FP16)
    config = fp16_config(speculation=speculation, **changes)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=config)
    scaler = ManualScaler(ref_model, config["loss_scale_init"], config["loss_scale_growth_interval"])
    return model, opt, scaler


def test_scale_loss_multiplies_by_the_initial_scale():
    model, opt, _ = pair()
    try:
        assert opt.loss_scale == 2.0**10
        loss = torch.tensor(1.5)
        assert float(opt.scale_loss(loss)) == 1.5 * 2.0**10
    finally:
        opt.close()


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_overflow_skips_and_halves_the_scale_and_good_steps_grow_it(speculation):
    model, opt, scaler = pair(speculation)
    poison_steps = {2: math.inf, 6: math.nan, 7: math.inf}
    poisons = (GradPoison(model.lm_head.weight, poison_steps), GradPoison(scaler.model.lm_head.weight, poison_steps))
    expected_scales, scale, good = [], 2.0**10, 0
    for step in range(14):  # GradScaler's policy, spelled out for the injected steps
        if step in poison_steps:
            scale, good = scale / 2, 0
        else:
            good += 1
            if good == 3:
                scale, good = scale * 2, 0
        expected_scales.append(scale)
    try:
        scales = []
        for step in range(14):
            for poison in poisons:
                poison.step = step
            batch = micro_batches(step)[0]
            before = [m.clone() for m in masters_of(opt)] if step > 0 else None
            scaler.follow(model)
            ref_skipped, ref_norm = scaler.step(batch, 1.0)
            skipped, norm = offload_fp16_step(model, opt, batch, 1.0)
            where = f"step {step}"
            assert skipped == ref_skipped == (step in poison_steps), where
            scales.append(opt.loss_scale)
            assert opt.loss_scale == scaler.scale, where
            if skipped:
                assert not math.isfinite(norm), where
                if before is not None and speculation == "off":
                    for mine, old in zip(masters_of(opt), before):
                        assert torch.equal(mine, old), f"{where}: a skipped step changed a master"
            else:
                assert norm == pytest.approx(ref_norm, rel=1e-5), where
                for p in model.parameters():
                    assert torch.isfinite(p).all(), where
            assert_masters_close(opt, scaler, where)
            assert_device_params_are_rounded_masters(model, opt, where)
        assert scales == expected_scales
        assert opt.counters.skips == 3
    finally:
        opt.close()


def test_natural_overflow_at_a_huge_initial_scale_backs_off_like_grad_scaler():
    """2**24 overflows the fp16 logits gradients: the first steps are skipped, halving each time,
    until the gradients fit, exactly as the reference's policy does."""
    model, opt, scaler = pair("on", loss_scale_init=2.0**24, loss_scale_growth_interval=100)
    try:
        skipped_steps = []
        for step in range(10):
            batch = micro_batches(step)[0]
            scaler.follow(model)
            ref_skipped, _ = scaler.step(batch, None)
            skipped, _ = offload_fp16_step(model, opt, batch, None)
            assert skipped == ref_skipped and opt.loss_scale == scaler.scale, f"step {step}"
            skipped_steps.append(skipped)
            assert_masters_close(opt, scaler, f"step {step}")
        assert skipped_steps[0], "2**24 should overflow the fp16 gradients of the tiny Llama"
        assert not all(skipped_steps)
    finally:
        opt.close()


def test_loss_scale_and_growth_counter_are_restored_from_the_state_dict():
    model, opt, scaler = pair("on")
    try:
        poison = GradPoison(model.lm_head.weight, {1: math.inf})
        for step in range(4):  # skip at 1 (scale 512), good at 2, 3: two good steps counted
            poison.step = step
            offload_fp16_step(model, opt, micro_batches(step)[0], 1.0)
        assert opt.loss_scale == 2.0**9
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
        buffer.seek(0)
        saved = torch.load(buffer, map_location="cpu", weights_only=True)
        resumed_model = tiny_llama(seed=5, dtype=FP16)
        resumed_model.load_state_dict(saved["model"])
        resumed = SuperOffloadAdamW(resumed_model.parameters(), lr=LR, config=fp16_config(speculation="on"))
        try:
            resumed.load_state_dict(saved["opt"])
            assert resumed.loss_scale == 2.0**9
            for step in range(4, 6):
                offload_fp16_step(model, opt, micro_batches(step)[0], 1.0)
                offload_fp16_step(resumed_model, resumed, micro_batches(step)[0], 1.0)
                assert resumed.loss_scale == opt.loss_scale, f"step {step}"
                for a, b in zip(masters_of(resumed), masters_of(opt)):
                    assert torch.equal(a, b), f"step {step}: resumed master differs"
            assert opt.loss_scale == 2.0**10, "the third good step after the skip grows the scale"
        finally:
            resumed.close()
    finally:
        opt.close()


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_fp16_masters_track_the_reference_with_clipping_and_accumulation(speculation):
    model, opt, scaler = pair(speculation, gradient_accumulation_steps=2)
    try:
        for step in range(10):
            batches = micro_batches(step, accumulation=2)
            max_norm = 1e6 if step % 2 == 0 else 1.0
            scaler.follow(model)
            for batch in batches:
                scaler.accumulate(batch, micro_batches=2)
            ref_skipped, _ = scaler.finish(max_norm)
            opt.max_grad_norm = max_norm
            for batch in batches:
                opt.scale_loss(model(**batch).loss / 2).backward()
            opt.step()
            opt.zero_grad()
            assert opt.last_step_skipped == ref_skipped
            assert_masters_close(opt, scaler, f"step {step}")
            assert_device_params_are_rounded_masters(model, opt, f"step {step}")
    finally:
        opt.close()
