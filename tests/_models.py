"""Tiny, deterministic models and batches for tests (no downloads: built from LlamaConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

# transformers is imported where a Llama is built (the multi-process tests spawn children that
# do not need it: its import is most of a child's start-up time)


def tiny_llama_config(num_layers: int = 4, hidden_size: int = 32, vocab_size: int = 128,
                      tie_word_embeddings: bool = False) -> LlamaConfig:
    """A LlamaConfig small enough for a CPU test: 4 heads, 2 kv heads, eager attention."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation="eager",
    )


def tiny_llama(num_layers: int = 4, hidden_size: int = 32, vocab_size: int = 128, seed: int = 0,
               dtype: torch.dtype = torch.float32,
               tie_word_embeddings: bool = False) -> LlamaForCausalLM:
    """A freshly initialised tiny LlamaForCausalLM; the same seed gives bitwise-equal weights."""
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(num_layers, hidden_size, vocab_size, tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def tiny_batch(batch: int = 2, seq: int = 16, vocab_size: int = 128,
               seed: int = 0) -> dict[str, torch.Tensor]:
    """A random causal-LM batch: labels equal input_ids (the model shifts them)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


# ---- reference training loops shared by the optimizer tests ----------------------------------
#
# The reference is the loop a user writes with stock PyTorch: backward, clip_grad_norm_, skip the
# step when the norm is not finite, torch.optim.AdamW / Adam. The SuperOffload side is the loop
# the contract prescribes: backward, opt.step() (clipping and skipping inside), opt.zero_grad().

@pytest.fixture(autouse=False)
def one_torch_thread():
    """Run torch's intra-op work on one thread: the test machine has 2 shared cores, and the
    engine's host pool needs them (two pools spinning on two cores is 10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def engine_config(**changes) -> dict:
    """The fp32 test config: >= 4 buckets on a tiny_llama(4), one of them device-resident."""
    config = {"device_dtype": "fp32", "bucket_size_mb": 0.02, "device_buckets": 1, "host_threads": 1}
    config.update(changes)
    return config


def decay_groups(model: torch.nn.Module, lr: float, weight_decay: float,
                 no_decay_options: Optional[dict] = None) -> list[dict]:
    """HF-Trainer-style groups: matrices decay, vectors (norm weights, biases) do not."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [
        {"params": decay, "lr": lr, "weight_decay": weight_decay},
        {"params": no_decay, "lr": lr, "weight_decay": 0.0, **(no_decay_options or {})},
    ]


class GradPoison:
    """A tensor hook that writes a non-finite value into one gradient on chosen steps.

    Tensor hooks run before gradient accumulation, so the engine's post-accumulate hook sees
    the poisoned gradient. Set `step` before each backward."""

    def __init__(self, param: torch.Tensor, values_by_step: dict[int, float]):
        self.values_by_step = dict(values_by_step)
        self.step = -1
        self.handle = param.register_hook(self)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        value = self.values_by_step.get(self.step)
        if value is None:
            return grad
        poisoned = grad.clone()
        poisoned.view(-1)[poisoned.numel() // 2] = value
        return poisoned


@dataclass
class StepOutcome:
    skipped: bool
    grad_norm: float
    max_grad_norm: Optional[float] = None  # the threshold used (resolved when it was relative)


class RelativeMaxNorm:
    """A max_grad_norm chosen as a fraction of this step's reference gradient norm: 0.9 clips
    every step by ~10%, so speculated buckets are rolled back and replayed with a coefficient
    near 1 (the realistic case: HF's default max_grad_norm 1.0 against norms of 1-2)."""

    def __init__(self, fraction: float):
        self.fraction = fraction

    def resolve(self, grad_norm: float) -> float:
        return self.fraction * grad_norm if math.isfinite(grad_norm) and grad_norm > 0 else 1.0

    def __repr__(self) -> str:
        return f"{self.fraction} x norm"


def micro_batches(step: int, accumulation: int = 1, batch: int = 2, seq: int = 16,
                  vocab_size: int = 128) -> list[dict[str, torch.Tensor]]:
    """Deterministic batches of one optimizer step (distinct seeds per micro-batch)."""
    return [tiny_batch(batch, seq, vocab_size, seed=1000 * step + i) for i in range(accumulation)]


def backward_micro_batches(model: torch.nn.Module, batches: list[dict], loss_fn=None) -> None:
    for batch in batches:
        loss = model(**batch).loss if loss_fn is None else loss_fn(model, batch)
        (loss / len(batches)).backward()


def reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[dict],
                   max_grad_norm: Optional[float], loss_fn=None) -> StepOutcome:
    """backward; clip_grad_norm_ (max_norm inf computes the norm without clipping); skip on a
    non-finite norm; step."""
    backward_micro_batches(model, batches, loss_fn)
    params = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
    if isinstance(max_grad_norm, RelativeMaxNorm):
        max_grad_norm = max_grad_norm.resolve(float(torch.nn.utils.get_total_norm([p.grad for p in params])))
    max_norm = math.inf if max_grad_norm is None else max_grad_norm
    total = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    skipped = not math.isfinite(total)
    if not skipped:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return StepOutcome(skipped, total, max_grad_norm)


def offload_step(model: torch.nn.Module, opt, batches: list[dict], max_grad_norm: Optional[float],
                 loss_fn=None) -> StepOutcome:
    """The contract's plain loop: backward; opt.step(); opt.zero_grad()."""
    opt.max_grad_norm = max_grad_norm
    backward_micro_batches(model, batches, loss_fn)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return StepOutcome(bool(opt.last_step_skipped), float(opt.last_grad_norm), max_grad_norm)


def read_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters, read the documented way: `model.state_dict()` first waits for the
    copy-backs still on the way (on an asynchronous device they land after step() returns); under
    weight-flow its entries are host copies of the flowing weights (the parameters are released)."""
    state = model.state_dict(keep_vars=True)
    return {name: state[name] for name, _ in model.named_parameters()}


def params_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in read_params(model).items()}


def assert_params_close(model: torch.nn.Module, expected: dict[str, torch.Tensor] | torch.nn.Module,
                        where: str, rtol: float = 1e-5, atol: float = 1e-6, exact: bool = False) -> None:
    """Every parameter, element by element (exact: bitwise)."""
    if isinstance(expected, torch.nn.Module):
        expected = read_params(expected)
    for name, p in read_params(model).items():
        want = expected[name].detach()
        got = p.detach()
        if exact:
            assert torch.equal(got, want), (
                f"{where}: parameter {name} differs bitwise in "
                f"{int((got != want).sum())} of {got.numel()} elements, "
                f"max |diff| {float((got.double() - want.double()).abs().max()):.3e}")
        else:
            assert_close_fast(got, want, rtol, atol, lambda m, name=name: f"{where}: parameter {name}: {m}")


def assert_close_fast(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, msg) -> None:
    """torch.testing.assert_close, with a vectorised check first (assert_close's per-call
    overhead dominates these tests); the full assert_close runs to report a mismatch."""
    if got.shape == want.shape and got.dtype == want.dtype and got.device == want.device:
        if bool(((got - want).abs() <= atol + rtol * want.abs()).all()):
            return
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=msg)


def state_tensors(opt) -> dict[tuple[int, str], torch.Tensor]:
    """The tensors of opt.state_dict()['state'], keyed by (param index, key), flattened."""
    tensors = {}
    for index, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[(int(index), key)] = value.detach().reshape(-1).clone()
    return tensors


def assert_adam_state_close(opt, reference_opt: torch.optim.Optimizer, where: str,
                            rtol: float = 1e-5) -> None:
    """exp_avg, exp_avg_sq and the step count of every parameter against torch's."""
    got = opt.state_dict()["state"]
    want = reference_opt.state_dict()["state"]
    missing = sorted(set(int(i) for i in want) - set(int(i) for i in got))
    assert not missing, f"{where}: no state for parameters {missing}, which torch has stepped"
    for index in set(int(i) for i in got) - set(int(i) for i in want):
        entry = got[index]  # torch has not stepped it: the engine may hold it, never stepped
        assert float(entry["step"]) == 0 and not entry["exp_avg"].any() and not entry["exp_avg_sq"].any(), (
            f"{where}: parameter {index} has state (step {float(entry['step'])}) but torch never stepped it")
    for index, ref_entry in want.items():
        entry = got[index]
        assert float(entry["step"]) == float(ref_entry["step"]), (
            f"{where}: param {index} step {float(entry['step'])}, torch {float(ref_entry['step'])}")
        for key in ("exp_avg", "exp_avg_sq"):
            ref = ref_entry[key].reshape(-1)
            atol = 1e-5 * float(ref.abs().max()) + 1e-30
            assert_close_fast(entry[key].reshape(-1), ref, rtol, atol,
                              lambda m, i=index, k=key: f"{where}: param {i} {k}: {m}")


def assert_state_equal(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), f"{where}: state keys differ: {sorted(set(a) ^ set(b))}"
    for key in a:
        assert torch.equal(a[key], b[key]), (
            f"{where}: state {key} differs bitwise, max |diff| "
            f"{float((a[key].double() - b[key].double()).abs().max()):.3e}")
