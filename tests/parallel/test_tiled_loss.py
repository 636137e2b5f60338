"""parallel/tiled_loss.py: the tiled head + cross-entropy equals the untiled one (fp32: to rounding,
element by element, on the loss and every gradient), chunk edges included; on a tiny Llama it
gives the same loss and parameter gradients as the model's own forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from superoffload_hf.parallel.tiled_loss import (apply_tiled_loss, is_tiled_loss, remove_tiled_loss,
                                                 shift_labels_for_causal_lm, tiled_cross_entropy)
from tests._models import tiny_batch, tiny_llama

B, S, H, V = 2, 13, 16, 37  # 26 tokens: chunks of 5 leave a ragged last chunk of 1


def _inputs(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / 4).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) / 4).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 3:6] = -100  # ignored, inside a chunk and across a chunk edge
    labels[1, 0] = -100
    return hidden, weight, b, labels


def _untiled(hidden, weight, bias, labels, num_items=None):
    """transformers' ForCausalLMLoss on F.linear's logits."""
    logits = F.linear(hidden, weight, bias).float().view(-1, V)
    shifted = shift_labels_for_causal_lm(labels).reshape(-1)
    if num_items is None:
        return F.cross_entropy(logits, shifted, ignore_index=-100)
    return F.cross_entropy(logits, shifted, ignore_index=-100, reduction="sum") / num_items


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 5, 26, 1000])
def test_loss_and_every_gradient_equal_the_untiled_in_fp32(chunk):
    hidden, weight, bias, labels = _inputs()
    expected = _untiled(hidden, weight, bias, labels)
    got = tiled_cross_entropy(hidden, weight, labels, bias=bias, chunk_tokens=chunk)
    assert_close(got, expected)
    for g, e in zip(_grads(got, (hidden, weight, bias)), _grads(expected, (hidden, weight, bias))):
        assert_close(g, e)


def test_pre_shifted_labels_and_num_items_in_batch_give_the_token_weighted_mean():
    hidden, weight, bias, labels = _inputs()
    expected = _untiled(hidden, weight, bias, labels, num_items=torch.tensor(40))
    got = tiled_cross_entropy(hidden, weight, shift_labels_for_causal_lm(labels), bias=bias, chunk_tokens=4,
                              shift=False, num_items_in_batch=torch.tensor(40))
    assert_close(got, expected)
    for g, e in zip(_grads(got, (hidden, weight, bias)), _grads(expected, (hidden, weight, bias))):
        assert_close(g, e)


def test_sum_reduction_and_a_scaled_gradient():
    hidden, weight, _, labels = _inputs(bias=False)
    expected = F.cross_entropy(F.linear(hidden, weight).view(-1, V), shift_labels_for_causal_lm(labels).reshape(-1),
                               reduction="sum")
    got = tiled_cross_entropy(hidden, weight, labels, chunk_tokens=3, reduction="sum")
    assert_close(got, expected)
    for g, e in zip(_grads(got * 0.37, (hidden, weight)), _grads(expected * 0.37, (hidden, weight))):
        assert_close(g, e)


def test_chunks_whose_labels_are_all_ignored_give_zero_gradient_rows():
    hidden, weight, _, labels = _inputs(bias=False)
    labels[0] = -100  # the first sequence's 13 tokens (and the shift's ignored last one): chunks 0-1 of 4 predict nothing
    got = tiled_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    expected = _untiled(hidden, weight, None, labels)
    assert_close(got, expected)
    (grad_hidden,) = torch.autograd.grad(got, [hidden])
    assert torch.equal(grad_hidden[0], torch.zeros_like(grad_hidden[0]))
    assert_close(grad_hidden, torch.autograd.grad(expected, [hidden])[0])


def test_the_tiled_loss_reads_nothing_on_the_host_in_forward_or_backward():
    """On a GPU each host read of device data (`.tolist()`, `bool()`, ...) synchronises the device:
    the simulated device counts them (before: one `.tolist()` in forward, one in backward)."""
    from superoffload_hf.testing.sim import SimRuntime

    hidden, weight, bias, labels = _inputs()
    labels[0] = -100  # chunks that predict nothing as well
    sim = SimRuntime()
    try:
        with sim.count_host_reads() as reads:
            loss = tiled_cross_entropy(hidden, weight, labels, bias=bias, chunk_tokens=4)
            grads = torch.autograd.grad(loss, [hidden, weight, bias])
    finally:
        sim.close()
    assert reads == {}, reads
    expected = _untiled(hidden, weight, bias, labels)
    assert_close(loss, expected)
    for g, e in zip(grads, _grads(expected, (hidden, weight, bias))):
        assert_close(g, e)
    assert torch.equal(grads[0][0], torch.zeros_like(grads[0][0]))  # the ignored sequence's rows


def test_every_label_ignored_is_nan_as_torch_with_zero_gradients():
    hidden, weight, _, labels = _inputs(bias=False)
    labels.fill_(-100)
    got = tiled_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    assert torch.isnan(got) and torch.isnan(_untiled(hidden, weight, None, labels))
    grad_hidden, grad_weight = torch.autograd.grad(got, [hidden, weight])
    assert not grad_hidden.any() and not grad_weight.any()


def test_bf16_head_matches_the_untiled_bf16_loss_and_gradients():
    hidden, weight, _, labels = _inputs(dtype=torch.bfloat16, bias=False)
    expected = _untiled(hidden, weight, None, labels)
    got = tiled_cross_entropy(hidden, weight, labels, chunk_tokens=5)
    assert got.dtype == torch.float32
    assert_close(got, expected)
    got_grads, expected_grads = _grads(got, (hidden, weight)), _grads(expected, (hidden, weight))
    assert all(g.dtype == torch.bfloat16 for g in got_grads)
    assert_close(got_grads[0], expected_grads[0])  # each row: the same ops on the same chunk of logits
    # the head's gradient: summed over chunks in fp32 and rounded once, untiled in one bf16 matmul
    assert_close(got_grads[1], expected_grads[1], rtol=1.6e-2, atol=1e-3)


def test_bad_arguments_are_refused_naming_the_value():
    hidden, weight, _, labels = _inputs(bias=False)
    with pytest.raises(ValueError, match="`chunk_tokens` is 0"):
        tiled_cross_entropy(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="labels of shape"):
        tiled_cross_entropy(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="`reduction`"):
        tiled_cross_entropy(hidden, weight, labels, reduction="none")


# ---- on a tiny Llama --------------------------------------------------------------------------


def _param_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_a_tiny_llama_with_the_tiled_loss_has_the_untiled_loss_and_gradients(tied):
    batch = tiny_batch(batch=2, seq=16)
    batch["labels"][1, :5] = -100  # a masked prompt
    reference = tiny_llama(num_layers=2, tie_word_embeddings=tied)
    out = reference(**batch)
    out.loss.backward()
    tiled = apply_tiled_loss(tiny_llama(num_layers=2, tie_word_embeddings=tied), chunk_tokens=7)
    assert is_tiled_loss(tiled)
    got = tiled(**batch)
    assert got.logits is None  # the full logits never exist
    got.loss.backward()
    assert_close(got.loss, out.loss)
    expected_grads, got_grads = _param_grads(reference), _param_grads(tiled)
    assert expected_grads.keys() == got_grads.keys()
    for name in expected_grads:
        assert_close(got_grads[name], expected_grads[name], msg=name)


def test_num_items_in_batch_and_return_logits_and_no_labels():
    batch = tiny_batch(batch=2, seq=16)
    reference, tiled = tiny_llama(num_layers=1), apply_tiled_loss(tiny_llama(num_layers=1), chunk_tokens=5,
                                                                  return_logits=True)
    items = torch.tensor(50)
    expected = reference(**batch, num_items_in_batch=items)
    got = tiled(**batch, num_items_in_batch=items)
    assert_close(got.loss, expected.loss)
    assert_close(got.logits, expected.logits)
    assert not got.logits.requires_grad  # computed without a graph
    plain = tiled(input_ids=batch["input_ids"])  # no labels: the model's own forward
    assert plain.loss is None and plain.logits.requires_grad
    assert_close(plain.logits, expected.logits)


def test_applying_twice_is_refused_and_remove_restores_the_own_forward():
    model = apply_tiled_loss(tiny_llama(num_layers=1))
    with pytest.raises(ValueError, match="already computes its loss tiled"):
        apply_tiled_loss(model)
    remove_tiled_loss(model)
    assert not is_tiled_loss(model)
    assert model(**tiny_batch()).logits is not None


def test_a_model_with_logit_softcapping_is_refused():
    model = tiny_llama(num_layers=1)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        apply_tiled_loss(model)


def test_the_tiled_forward_keeps_the_model_forward_signature():
    """A Trainer keeps the dataset columns the forward's signature names (a second Trainer on a
    model an earlier one tiled dropped `input_ids` when the signature was (*args, **kwargs))."""
    import inspect

    model = tiny_llama(num_layers=1)
    own = inspect.signature(model.forward)
    apply_tiled_loss(model)
    assert inspect.signature(model.forward) == own
    assert "input_ids" in inspect.signature(model.forward).parameters
