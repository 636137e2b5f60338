"""The device activation memory of a Llama-style decoder's forward + backward: pure arithmetic.

`estimate_activations(config, micro_batch, seq_len, dtype_bytes, ...)` counts the tensors
autograd keeps (and the largest transients of backward) of a transformers Llama-style model
(LlamaForCausalLM, Mistral, Qwen2: RMSNorm, rotary attention with grouped key/value heads, a
gated SiLU MLP, an untied or tied head) and returns `ActivationTerms`, one named term per kind
of tensor (the dry run prints each) and `total`, the estimated peak. No device call; nothing is
allocated. Weights, their gradients and the optimizer's buffers are not included
(engine/memory.py counts those).

The model of what is saved, per token and per block, in elements of the model's dtype (`e`
bytes each) unless said otherwise (h hidden, i intermediate, H heads, K key/value heads, D head
dimension, V vocabulary):

* attention half: the normed input (h, saved by q/k/v projections), q (H*D), k and v (K*D
  each), the attention output (H*D) and its contiguous copy that o_proj saves (h), the
  logsumexp (H, fp32), the residual sum the second norm saves (h): a flash-style attention
  (sdpa's flash / memory-efficient kernel, flash-attention) that keeps no S x S matrix.
* each RMSNorm: its fp32 upcast of the input (h * 4 bytes, when e < 4; in fp32 the input
  itself, already counted) and the rsqrt (1 fp32).
* MLP half: the normed input (h), gate, up, silu(gate) and their product (4 * i).
* backward of one block: the gradient of the residual stream in and out (2 * h) and the
  MLP's intermediate gradients (2 * i, the largest live at once).
* loss: the logits (V, in e), their fp32 log-softmax (V * 4), and in backward the fp32
  gradients of both (2 * V * 4): `T * V * (e + 12)` bytes for T tokens.

With gradient checkpointing each block keeps only its input (h) until its backward recomputes
it; the peak is then the kept inputs plus the larger of the loss phase (all logits live at the
end of forward) and one block's recompute (its saved tensors and backward transients).
Without checkpointing every block's saved tensors are live when the loss is computed.

Switches: `tiled_loss` computes the head and cross-entropy `loss_chunk` tokens at a time
(parallel/tiled_loss.py): the loss term shrinks to one chunk, plus the fp32 gradient of the
head's input (T * h * 4). `tiled_mlp` computes the MLP `mlp_chunk` tokens at a time with
recomputation (parallel/tiled_mlp.py): its intermediate (5 * i with the gradients' 2) shrinks
to one chunk; the MLP's input (h) stays saved. `activation_offload` moves the checkpointed
block inputs to host memory as forward produces them; `offload_in_flight` of them stay on the
device (one being written, one prefetched for recomputation). `sequence_parallel_size` N
splits the sequence: each device holds T = micro_batch * seq_len / N tokens of every term;
Ulysses attention runs the full sequence on H/N query heads (the same element count) and
max(K, N)/N key/value heads (heads replicated when N exceeds them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

FP32_BYTES = 4
DEFAULT_LOSS_CHUNK = 4096  # tokens per chunk of the tiled loss (parallel/tiled_loss.py uses the same)
DEFAULT_MLP_CHUNK = 8192  # tokens per chunk of the tiled MLP
OFFLOAD_IN_FLIGHT = 2  # checkpointed inputs on the device under activation offload


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a Llama-style decoder that its activations depend on."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> "DecoderShape":
        """From a transformers config (LlamaConfig and alike) or any object with its fields."""
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        return cls(hidden=hidden, intermediate=int(config.intermediate_size), heads=heads,
                   kv_heads=int(kv_heads), head_dim=int(head_dim), layers=int(config.num_hidden_layers),
                   vocab=int(config.vocab_size))


@dataclass(frozen=True)
class ActivationTerms:
    """Device activation bytes by kind (see the module docstring); `total` is the estimated peak."""

    tokens: int  # tokens per device: micro_batch * seq_len / sequence_parallel_size
    checkpointed_inputs: int  # block inputs kept for recomputation on the device
    offloaded_inputs: int  # block inputs held in host memory instead (activation offload; not in total)
    attention: int  # the attention halves' saved tensors of the blocks live at once
    mlp: int  # the MLP halves' saved tensors (one chunk's intermediate under tiled_mlp)
    backward: int  # one block's backward transients (residual gradients, MLP gradients)
    loss: int  # logits, their fp32 log-softmax and gradients (one chunk under tiled_loss)
    blocks_live: int  # blocks whose saved tensors are live at once (1 with checkpointing)
    total: int  # the estimated peak

    def rows(self) -> list[tuple[str, int]]:
        """(name, bytes) of every byte term, in order, for printing."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if f.name not in ("tokens", "blocks_live")]


def estimate_activations(config: Any, micro_batch: int, seq_len: int, dtype_bytes: int = 2, *,
                         gradient_checkpointing: bool = True, tiled_loss: bool = False,
                         tiled_mlp: bool = False, activation_offload: bool = False,
                         sequence_parallel_size: int = 1, loss_chunk: int = DEFAULT_LOSS_CHUNK,
                         mlp_chunk: int = DEFAULT_MLP_CHUNK,
                         offload_in_flight: int = OFFLOAD_IN_FLIGHT) -> ActivationTerms:
    """The device activation bytes of one micro-batch's forward + backward.

    `config`: a transformers config of a Llama-style decoder (or a DecoderShape). `dtype_bytes`:
    the bytes of one element of the model's compute dtype (2 for bf16). The switches are
    described in the module docstring."""
    shape = config if isinstance(config, DecoderShape) else DecoderShape.from_config(config)
    for name, value, least in (("micro_batch", micro_batch, 1), ("seq_len", seq_len, 1),
                               ("dtype_bytes", dtype_bytes, 1), ("sequence_parallel_size", sequence_parallel_size, 1),
                               ("loss_chunk", loss_chunk, 1), ("mlp_chunk", mlp_chunk, 1),
                               ("offload_in_flight", offload_in_flight, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"`{name}` is {value!r}; expected an integer >= {least}.")
    if activation_offload and not gradient_checkpointing:
        raise ValueError("`activation_offload` offloads the checkpointed block inputs: it needs "
                         "`gradient_checkpointing=True`.")
    n = sequence_parallel_size
    tokens = math.ceil(micro_batch * seq_len / n)
    e, h, i = dtype_bytes, shape.hidden, shape.intermediate
    kv_width = shape.head_dim * max(shape.kv_heads, n)  # per local token: heads replicated when n > K
    norm_upcast = (h * FP32_BYTES if e < FP32_BYTES else 0) + FP32_BYTES  # fp32 input copy + rsqrt
    attention_per_token = (e * (3 * h + shape.heads * shape.head_dim + 2 * kv_width)
                           + FP32_BYTES * shape.heads + norm_upcast)
    mlp_tokens = min(tokens, mlp_chunk) if tiled_mlp else tokens
    mlp_bytes = e * h * tokens + (e * 4 * i + norm_upcast) * mlp_tokens
    backward = e * 2 * h * tokens + e * 2 * i * mlp_tokens
    loss_tokens = min(tokens, loss_chunk) if tiled_loss else tokens
    loss = loss_tokens * shape.vocab * (e + 3 * FP32_BYTES)
    if tiled_loss:
        loss += tokens * h * FP32_BYTES  # the fp32 gradient of the head's input, accumulated per chunk
    block_input = e * h * tokens
    if gradient_checkpointing:
        kept = offload_in_flight if activation_offload else shape.layers
        checkpointed = min(kept, shape.layers) * block_input
        offloaded = (shape.layers - min(kept, shape.layers)) * block_input
        blocks_live = 1
        attention, mlp = attention_per_token * tokens, mlp_bytes
        total = checkpointed + max(loss, attention + mlp + backward)
    else:
        checkpointed = offloaded = 0
        blocks_live = shape.layers
        attention, mlp = shape.layers * attention_per_token * tokens, shape.layers * mlp_bytes
        total = attention + mlp + max(loss, backward)
    return ActivationTerms(tokens=tokens, checkpointed_inputs=checkpointed, offloaded_inputs=offloaded,
                           attention=attention, mlp=mlp, backward=backward, loss=loss,
                           blocks_live=blocks_live, total=total)
