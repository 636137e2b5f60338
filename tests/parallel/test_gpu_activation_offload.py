"""Activation offload on CUDA (superoffload_hf/parallel/activation_offload.py): the same numbers as
without it, bitwise, and a device peak that holds about three block inputs instead of one per
block. Skipped without CUDA; SUPEROFFLOAD_GPU_TEST_DEVICE=cpu runs the same checks on the CPU (a
dry run of the test logic: the CPU has no device peak to compare). Run it with
TORCH_CUDA_SANITIZER=1 to have the CUDA stream sanitizer check its streams and events.
"""

from __future__ import annotations

import os

import pytest
import torch

from superoffload_hf.device import make_runtime
from superoffload_hf.parallel.activation_offload import apply_activation_offload

DEVICE = os.environ.get("SUPEROFFLOAD_GPU_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
LAYERS, HIDDEN = 8, 256
SEQ = 2048 if ON_CUDA else 128  # (the CPU dry run: small)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"),
]


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(DEVICE)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _train(offload: bool, steps: int = 3):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hooks = apply_activation_offload(model, make_runtime(torch.device(DEVICE))) if offload else None
    losses, peaks = [], []
    for step in range(steps):
        ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(step)).to(DEVICE)
        if ON_CUDA:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.detach().cpu())
        if ON_CUDA:
            peaks.append(torch.cuda.max_memory_allocated() - base)
    if hooks is not None:
        assert hooks.bytes_fetched == steps * (LAYERS - 1) * SEQ * HIDDEN * 4
        hooks.remove()
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}, peaks


def test_offload_on_the_device_trains_bitwise_like_no_offload_and_its_peak_holds_fewer_block_inputs():
    want_losses, want_params, want_peaks = _train(False)
    again = _train(False)
    # (a GPU whose kernels are not bitwise reproducible run to run gets the closest check it allows)
    reproducible = all(torch.equal(again[1][n], v) for n, v in want_params.items())
    got_losses, got_params, got_peaks = _train(True)
    same = torch.equal if reproducible else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-7))
    for step, (g, w) in enumerate(zip(got_losses, want_losses)):
        assert same(g, w), f"step {step}: loss {g} vs {w} (bitwise: {reproducible})"
    for name, value in want_params.items():
        assert same(got_params[name], value), f"{name} (bitwise: {reproducible})"
    if ON_CUDA:
        block_input = SEQ * HIDDEN * 4
        # without: every block's input lives until the backward; with: about three at once
        assert want_peaks[-1] - got_peaks[-1] >= (LAYERS - 4) * block_input, (want_peaks, got_peaks)
