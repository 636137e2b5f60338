"""parallel/tiled_mlp.py: the chunked MLP with recomputation equals the untiled (fp32: to rounding,
element by element, on the output and every gradient), chunk edges included; on a tiny Llama,
with and without gradient checkpointing, and together with the tiled loss."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from superoffload_hf.parallel.tiled_loss import apply_tiled_loss
from superoffload_hf.parallel.tiled_mlp import apply_tiled_mlp, is_tiled_mlp, remove_tiled_mlp, tiled_mlp_forward
from tests._models import tiny_batch, tiny_llama


def _mlp(dtype=torch.float32, bias=False):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2, mlp_bias=bias)).to(dtype)


def _x(dtype=torch.float32):
    return torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()


@pytest.mark.parametrize("chunk", [1, 5, 26, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_output_and_every_gradient_equal_the_untiled_in_fp32(chunk, bias):
    mlp, x = _mlp(bias=bias), _x()
    grad_out = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(2))
    expected = mlp(x)
    expected_grads = torch.autograd.grad(expected, [x, *mlp.parameters()], grad_out)
    got = tiled_mlp_forward(mlp, x, chunk)
    assert_close(got, expected)
    got_grads = torch.autograd.grad(got, [x, *mlp.parameters()], grad_out)
    for g, e in zip(got_grads, expected_grads):
        assert g.dtype == e.dtype
        assert_close(g, e)


def test_bf16_matches_the_untiled_with_the_weights_gradient_summed_in_fp32():
    mlp, x = _mlp(torch.bfloat16), _x(torch.bfloat16)
    expected = mlp(x)
    got = tiled_mlp_forward(mlp, x, 5)
    assert_close(got, expected)
    got_grads = torch.autograd.grad(got.float().sum(), [x, *mlp.parameters()])
    expected_grads = torch.autograd.grad(expected.float().sum(), [x, *mlp.parameters()])
    assert_close(got_grads[0], expected_grads[0])
    for g, e in zip(got_grads[1:], expected_grads[1:]):
        assert g.dtype == torch.bfloat16
        assert_close(g, e, rtol=1.6e-2, atol=1e-2)


def test_only_the_input_is_saved_not_the_intermediate():
    mlp, x = _mlp(), _x()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        tiled_mlp_forward(mlp, x, 5)
    assert sorted(saved) == sorted([(2, 13, 16), (40, 16), (40, 16), (16, 40)])  # x and the 3 weights


def _grads_of(model, batch):
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_tiny_llama_with_tiled_mlps_has_the_untiled_gradients_each_accumulated_once(checkpointing):
    batch = tiny_batch(batch=2, seq=16)
    reference, tiled = tiny_llama(num_layers=2), apply_tiled_mlp(tiny_llama(num_layers=2), chunk_tokens=5)
    assert is_tiled_mlp(tiled)
    if checkpointing:
        for model in (reference, tiled):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    accumulated = {}
    for name, p in tiled.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: accumulated.update({name: accumulated.get(name, 0) + 1}))
    expected, got = _grads_of(reference, batch), _grads_of(tiled, batch)
    for name in expected:
        assert_close(got[name], expected[name], msg=name)
    assert accumulated == {name: 1 for name in expected}  # the engine's hooks see one gradient per backward


def test_tiled_mlp_and_tiled_loss_together_equal_the_untiled():
    batch = tiny_batch(batch=2, seq=16)
    batch["labels"][0, :4] = -100
    reference = tiny_llama(num_layers=2)
    tiled = apply_tiled_loss(apply_tiled_mlp(tiny_llama(num_layers=2), chunk_tokens=3), chunk_tokens=6)
    expected, got = _grads_of(reference, batch), _grads_of(tiled, batch)
    for name in expected:
        assert_close(got[name], expected[name], msg=name)


def test_applying_twice_is_refused_remove_restores_and_a_model_without_layers_is_refused():
    model = apply_tiled_mlp(tiny_llama(num_layers=1))
    with pytest.raises(ValueError, match="already tiled"):
        apply_tiled_mlp(model)
    remove_tiled_mlp(model)
    assert not is_tiled_mlp(model)
    with pytest.raises(ValueError, match="no decoder layers with an `mlp`"):
        apply_tiled_mlp(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="`chunk_tokens` is 0"):
        apply_tiled_mlp(model, chunk_tokens=0)


@pytest.mark.usefixtures("device_mode")
def test_a_compiled_model_with_the_tiled_mlp_and_loss_trains_bitwise_like_the_uncompiled_one():
    from superoffload_hf import SuperOffloadAdamW
    from tests._models import engine_config, micro_batches

    def train(compiled: bool) -> tuple[list, list]:
        torch._dynamo.reset()
        model = apply_tiled_mlp(apply_tiled_loss(tiny_llama(num_layers=1), 8), 8)
        run = torch.compile(model, backend="eager") if compiled else model
        losses = []
        with SuperOffloadAdamW(model.parameters(), lr=1e-2, model=model,
                               config=engine_config(device_buckets=0)) as opt:
            for step in range(2):
                (batch,) = micro_batches(step)
                loss = run(**batch).loss
                loss.backward()
                losses.append(loss.detach().clone())
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            return losses, [p.detach().clone() for p in model.parameters()]

    want, got = train(False), train(True)
    torch._dynamo.reset()
    for a, b in zip(want[0] + want[1], got[0] + got[1]):
        assert torch.equal(a, b)
