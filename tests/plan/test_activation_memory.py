"""plan/activations.py: the activation estimate against hand-computed numbers, and against
the peak of a real tiny Llama's forward + backward on the CPU (testing/alloc_peak.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from superoffload_hf.plan.activations import DecoderShape, estimate_activations
from superoffload_hf.testing.alloc_peak import AllocationPeak

REPO = Path(__file__).resolve().parents[2]

# h 64, i 176, 8 heads of 8, 2 kv heads, 4 layers, vocab 512
SMALL = DecoderShape(hidden=64, intermediate=176, heads=8, kv_heads=2, head_dim=8, layers=4, vocab=512)


def test_checkpointed_bf16_terms_are_the_hand_computed_ones():
    t = estimate_activations(SMALL, micro_batch=1, seq_len=1024, dtype_bytes=2)
    assert t.tokens == 1024
    assert t.checkpointed_inputs == 4 * 1024 * 64 * 2
    # normed in, attention output's copy, residual sum (3h) + q (H*D) + k, v (2*K*D) in bf16;
    # logsumexp 8 fp32; the norm's fp32 upcast 64 * 4 + its rsqrt 4, x * rsqrt in bf16 2 * 64
    assert t.attention == 1024 * (2 * (3 * 64 + 64 + 2 * 16) + 4 * 8 + 64 * 4 + 4 + 2 * 64)
    assert t.mlp == 1024 * (2 * 64 + 64 * 4 + 4 + 2 * 64 + 2 * 4 * 176)
    assert t.backward == 1024 * 2 * (2 * 64 + 2 * 176)
    # the head's input and its gradient, the final norm's upcast; 12 bytes per logit
    assert t.loss == 1024 * (2 * 2 * 64 + 64 * 4 + 4 + 2 * 64) + 1024 * 512 * 12
    assert t.total == t.checkpointed_inputs + max(t.loss, t.attention + t.mlp + t.backward) == 7475200


def test_tiled_loss_keeps_one_chunk_of_logits_and_the_fp32_head_input_gradient():
    t = estimate_activations(SMALL, 1, 1024, 2, tiled_loss=True, loss_chunk=100)
    head_grad = 512 * 64 * (4 + 2)  # summed in fp32, and one chunk's in bf16
    assert t.loss == 1024 * (2 * 2 * 64 + 64 * 4 + 4 + 2 * 64) + 100 * 512 * 12 + head_grad
    whole = estimate_activations(SMALL, 1, 1024, 2, tiled_loss=True, loss_chunk=4096)
    assert whole.loss == estimate_activations(SMALL, 1, 1024, 2).loss + head_grad


def test_tiled_mlp_keeps_one_chunk_of_the_intermediate():
    untiled = estimate_activations(SMALL, 1, 1024, 2)
    t = estimate_activations(SMALL, 1, 1024, 2, tiled_mlp=True, mlp_chunk=256)
    assert t.mlp == 1024 * (2 * 64 + 64 * 4 + 4 + 2 * 64)  # the input only
    # one chunk's gate, up, activation, product and 2 gradients; the weights' gradients in fp32 + bf16
    assert t.backward == 1024 * 2 * 2 * 64 + 256 * 2 * 6 * 176 + 3 * 64 * 176 * (4 + 2)
    assert t.attention == untiled.attention and t.loss == untiled.loss


def test_activation_offload_keeps_two_block_inputs_on_the_device():
    t = estimate_activations(SMALL, 1, 1024, 2, activation_offload=True)
    assert t.checkpointed_inputs == 2 * 1024 * 64 * 2
    assert t.offloaded_inputs == 2 * 1024 * 64 * 2
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        estimate_activations(SMALL, 1, 1024, 2, activation_offload=True, gradient_checkpointing=False)


def test_sequence_parallel_splits_the_tokens_and_replicates_kv_heads_past_their_count():
    one = estimate_activations(SMALL, 1, 1024, 2)
    two = estimate_activations(SMALL, 1, 1024, 2, sequence_parallel_size=2)
    assert two.tokens == 512 and two.checkpointed_inputs * 2 == one.checkpointed_inputs
    assert two.loss * 2 == one.loss and two.attention * 2 == one.attention  # K = 2 heads split over 2
    four = estimate_activations(SMALL, 1, 1024, 2, sequence_parallel_size=4)  # 4 > K: 1 kv head per rank
    assert four.attention == 256 * (2 * (3 * 64 + 64 + 2 * 8 * 4) + 4 * 8 + 64 * 4 + 4 + 2 * 64)


def test_without_checkpointing_every_block_is_live():
    t = estimate_activations(SMALL, 1, 1024, 2, gradient_checkpointing=False)
    one = estimate_activations(SMALL, 1, 1024, 2)
    assert t.blocks_live == 4 and t.checkpointed_inputs == 0
    assert t.attention == 4 * one.attention and t.mlp == 4 * one.mlp
    assert t.total == t.attention + t.mlp + max(t.loss, t.backward)


def test_llama_8b_at_512k_tokens_matches_the_issue_figures():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(REPO / "recipes" / "models" / "llama-3.1-8b")
    t = estimate_activations(config, 1, 512 * 1024, 2)
    assert t.checkpointed_inputs == 32 * 512 * 1024 * 4096 * 2  # 4 GiB per block, 128 GiB in all
    assert 512 * 1024 * 128256 * 4 // 10**9 == 268  # the issue's "268 GB" of fp32 logits
    assert t.loss == 512 * 1024 * (2 * 2 * 4096 + 4096 * 4 + 4 + 2 * 4096) + 512 * 1024 * 128256 * 12


def test_bad_sizes_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="`seq_len` is 0"):
        estimate_activations(SMALL, 1, 0)
    with pytest.raises(ValueError, match="`dtype_bytes`"):
        estimate_activations(SMALL, 1, 8, dtype_bytes=2.0)


@pytest.mark.parametrize("checkpointing,dtype,tiled", [(True, torch.float32, False), (True, torch.bfloat16, True),
                                                       (False, torch.float32, True), (False, torch.bfloat16, False)])
def test_estimate_is_within_15_percent_of_the_measured_cpu_peak(checkpointing, dtype, tiled):
    from transformers import LlamaConfig, LlamaForCausalLM

    from superoffload_hf.parallel.tiled_loss import apply_tiled_loss
    from superoffload_hf.parallel.tiled_mlp import apply_tiled_mlp

    config = LlamaConfig(hidden_size=64, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                         num_hidden_layers=4, vocab_size=2048, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)  # sdpa: a flash kernel on the CPU (no S x S matrix)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if tiled:
        apply_tiled_mlp(apply_tiled_loss(model, chunk_tokens=128), chunk_tokens=128)
    ids = torch.randint(0, 2048, (1, 1024))
    with AllocationPeak() as peak:
        model(input_ids=ids, labels=ids).loss.backward()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())  # made inside, not activations
    measured = peak.peak_bytes - grads
    estimate = estimate_activations(config, 1, 1024, dtype.itemsize, gradient_checkpointing=checkpointing,
                                    tiled_loss=tiled, tiled_mlp=tiled, loss_chunk=128, mlp_chunk=128).total
    assert 0.85 <= measured / estimate <= 1.15, (measured, estimate)
