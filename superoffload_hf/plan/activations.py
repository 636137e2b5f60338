"""The device activation memory of a Llama-style decoder's forward + backward: pure arithmetic.

`estimate_activations(config, micro_batch, seq_len, dtype_bytes, ...)` counts the tensors
autograd keeps (and the largest transients of backward) of a transformers Llama-style model
(LlamaForCausalLM, Mistral, Qwen2: RMSNorm, rotary attention with grouped key/value heads, a
gated SiLU MLP, an untied or tied head) and returns `ActivationTerms`, one named term per kind
of tensor (the dry run prints each) and `total`, the estimated peak. No device call; nothing is
allocated. Weights, their gradients and the optimizer's buffers are not included
(plan/memory.py counts those).

The model of what is saved, per token and per block, in elements of the model's dtype (`e`
bytes each) unless said otherwise (h hidden, i intermediate, H heads, K key/value heads, D head
dimension, V vocabulary):

* attention half: the normed input (h, saved by q/k/v projections), q (H*D), k and v (K*D
  each), the attention output (H*D) and its contiguous copy that o_proj saves (h), the
  logsumexp (H, fp32), the residual sum the second norm saves (h): a flash-style attention
  (sdpa's flash / memory-efficient kernel, flash-attention) that keeps no S x S matrix.
* each RMSNorm: its fp32 upcast of the input (h * 4 bytes, when e < 4; in fp32 the input
  itself, already counted), the rsqrt (1 fp32) and the normalised input before its weight (h).
* MLP half: the normed input (h) and the second norm's upcast, gate, up, silu(gate) and their
  product (4 * i).
* backward of one block: the gradient of the residual stream in and out (2 * h) and the
  MLP's intermediate gradients (2 * i, the largest live at once).
* loss: the head's input and its gradient (2 * h), the final norm's upcast; per logit 12
  bytes at the loss's peak: three fp32 tensors of tokens x V (fp32: the logits, their
  log-softmax and its gradient; bf16: the bf16 logits and their fp32 upcast, the log-softmax
  and the gradients, not all live at once), measured 12.3 (fp32) and 12.2 (bf16) bytes per
  logit with testing/alloc_peak.py.

With gradient checkpointing each block keeps only its input (h) until its backward recomputes
it; the peak is then the kept inputs plus the larger of the loss phase (all logits live at the
end of forward) and one block's recompute (its saved tensors and backward transients).
Without checkpointing every block's saved tensors are live when the loss is computed.

Switches: `tiled_loss` computes the head and cross-entropy `loss_chunk` tokens at a time
(parallel/tiled_loss.py): the logits part shrinks to one chunk, plus the head's gradient summed
in fp32 and one chunk's (V * h * (4 + e)). `tiled_mlp` computes the MLP `mlp_chunk` tokens at a
time with recomputation (parallel/tiled_mlp.py): a block saves only the MLP's input, and one
chunk's intermediate and their gradients exist during one block's backward, plus the MLP weights' gradients summed in fp32 and one chunk's (3 * h * i * (4 + e)).
`activation_offload` moves the checkpointed block inputs to host memory as forward produces
them; `offload_in_flight` of them stay on the device (one being written, one prefetched for
recomputation). `sequence_parallel_size` N
splits the sequence: each device holds T = micro_batch * seq_len / N tokens of every term;
Ulysses attention runs the full sequence on H/N query heads (the same element count) and
max(K, N)/N key/value heads (heads replicated when N exceeds them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Optional

from superoffload_hf.config import AUTO, TILED_AUTO_SHARE, TILED_LOSS_CHUNK_TOKENS, TILED_MLP_CHUNK_TOKENS
from superoffload_hf.plan.memory import DTYPES

FP32_BYTES = 4
LOGIT_BYTES = 12  # per logit at the loss's peak, in bf16 and fp32 alike (see the docstring)
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
    mlp: int  # the MLP halves' saved tensors (under tiled_mlp: their inputs only)
    backward: int  # one block's backward transients (residual and MLP gradients; tiled_mlp's chunk)
    loss: int  # logits, their fp32 log-softmax and gradients (one chunk under tiled_loss)
    blocks_live: int  # blocks whose saved tensors are live at once (1 with checkpointing)
    total: int  # the estimated peak

    def rows(self) -> list[tuple[str, int]]:
        """(name, bytes) of every byte term, in order, for printing."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if f.name not in ("tokens", "blocks_live")]


def estimate_activations(config: Any, micro_batch: int, seq_len: int, dtype_bytes: int = 2, *,
                         gradient_checkpointing: bool = True, tiled_loss: bool = False,
                         tiled_mlp: bool = False, activation_offload: bool = False,
                         sequence_parallel_size: int = 1, loss_chunk: int = TILED_LOSS_CHUNK_TOKENS,
                         mlp_chunk: int = TILED_MLP_CHUNK_TOKENS,
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
    # each RMSNorm: its input's fp32 upcast (the input itself in fp32), rsqrt, x * rsqrt in e
    norm_upcast = (h * FP32_BYTES if e < FP32_BYTES else 0) + FP32_BYTES + e * h
    attention_per_token = (e * (3 * h + shape.heads * shape.head_dim + 2 * kv_width)
                           + FP32_BYTES * shape.heads + norm_upcast)
    mlp_bytes = (e * h + norm_upcast) * tokens  # the normed input and the second norm's upcast
    backward = e * 2 * h * tokens
    if tiled_mlp:  # one chunk's intermediate, recomputed in backward; the weights' gradients
        # summed in fp32 over chunks, and one chunk's
        backward += e * (4 + 2) * i * min(tokens, mlp_chunk) + 3 * h * i * (FP32_BYTES + e)
    else:
        mlp_bytes += e * 4 * i * tokens
        backward += e * 2 * i * tokens
    loss_tokens = min(tokens, loss_chunk) if tiled_loss else tokens
    # the head's input, the final norm's fp32 upcast and the input's gradient
    loss = (2 * e * h + norm_upcast) * tokens + loss_tokens * shape.vocab * LOGIT_BYTES
    if tiled_loss:  # the head's gradient summed in fp32 over chunks, and one chunk's
        loss += shape.vocab * h * (FP32_BYTES + e)
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


# ---- the tiling choice (applied by parallel/tiling.py) -------------------------------------------


@dataclass(frozen=True)
class TilingChoice:
    loss: bool
    mlp: bool
    reason: str

    def describe(self) -> str:
        on = lambda b: "on" if b else "off"  # noqa: E731
        return f"tiled loss {on(self.loss)}, tiled MLP {on(self.mlp)} ({self.reason})"


def untiled_terms(model_config: Any, micro_batch: int, seq_len: int, dtype_bytes: int) -> tuple[int, int]:
    """(the loss's logits bytes, one block's MLP intermediate bytes) untiled: what tiling removes."""
    untiled = estimate_activations(model_config, micro_batch, seq_len, dtype_bytes)
    tiled = estimate_activations(model_config, micro_batch, seq_len, dtype_bytes, tiled_loss=True, tiled_mlp=True,
                                 loss_chunk=1, mlp_chunk=1)
    return untiled.loss - tiled.loss, (untiled.mlp + untiled.backward) - (tiled.mlp + tiled.backward)


def choose_tiling(tiled_loss: str, tiled_mlp: str, device_is_host: bool, *, model_config: Any = None,
                  micro_batch: Optional[int] = None, seq_len: Optional[int] = None, dtype_bytes: int = 2,
                  free_device_bytes: Optional[int] = None) -> TilingChoice:
    """The switches' values for one run; "auto" needs the batch's size and the free device memory
    (else it stays off, saying so)."""
    if AUTO not in (tiled_loss, tiled_mlp):
        return TilingChoice(tiled_loss == "on", tiled_mlp == "on", "as configured")
    if device_is_host:
        return TilingChoice(tiled_loss == "on", tiled_mlp == "on", "auto: off on the CPU device")
    if model_config is None or micro_batch is None or seq_len is None or free_device_bytes is None:
        return TilingChoice(tiled_loss == "on", tiled_mlp == "on", "auto: off, the batch size or free memory unknown")
    loss_bytes, mlp_bytes = untiled_terms(model_config, micro_batch, seq_len, dtype_bytes)
    limit = TILED_AUTO_SHARE * free_device_bytes
    loss = tiled_loss == "on" or (tiled_loss == AUTO and loss_bytes > limit)
    mlp = tiled_mlp == "on" or (tiled_mlp == AUTO and mlp_bytes > limit)
    reason = (f"auto at {micro_batch} x {seq_len} tokens: tiling saves {loss_bytes / 1e9:.2f} GB of logits and "
              f"{mlp_bytes / 1e9:.2f} GB of one block's MLP, against 1/{round(1 / TILED_AUTO_SHARE)} of "
              f"{free_device_bytes / 1e9:.2f} GB free")
    return TilingChoice(loss, mlp, reason)


# ---- what the activations of a run come to (the dry run, the Trainer's optimizer build) ---------


def device_activations(model_config, config, micro_batch: int, seq_len: int, gradient_checkpointing: bool,
                       accelerator: bool, free_device_bytes: Optional[int]):
    """(ActivationTerms, TilingChoice) of one micro-batch, with the tiling `tiled_loss` /
    `tiled_mlp` would choose against `free_device_bytes` (free after the weights)."""
    dtype_bytes = DTYPES[config.device_dtype].itemsize
    choice = choose_tiling(config.tiled_loss, config.tiled_mlp, not accelerator, model_config=model_config,
                           micro_batch=micro_batch, seq_len=seq_len, dtype_bytes=dtype_bytes,
                           free_device_bytes=free_device_bytes)
    terms = estimate_activations(model_config, micro_batch, seq_len, dtype_bytes,
                                 gradient_checkpointing=gradient_checkpointing,
                                 tiled_loss=choice.loss, tiled_mlp=choice.mlp,
                                 loss_chunk=config.tiled_loss_chunk_tokens, mlp_chunk=config.tiled_mlp_chunk_tokens)
    return terms, choice


def dataset_seq_len(dataset, samples: int = 64) -> Optional[int]:
    """The longest `input_ids` among the first `samples` of a map-style dataset (what a padding
    collator makes a batch's length); None for an iterable dataset or samples without input_ids."""
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        return None
    lengths = []
    for i in range(min(len(dataset), samples)):
        item = dataset[i]
        ids = item.get("input_ids") if isinstance(item, dict) else None
        if ids is None:
            return None
        lengths.append(len(ids))
    return max(lengths, default=None)


def with_trainer_activations(config, explicit: dict, model, micro_batch: int, gradient_checkpointing: bool,
                             dataset, free_device_bytes) -> tuple[Any, Optional[str]]:
    """The Trainer's counterpart of `with_recipe_activations`: `config` with `device_activation_bytes`
    estimated at `micro_batch` x the train dataset's longest sequence among its first samples, for
    `weights` "auto" or "flow" on an accelerator when the user did not set it, and a line saying
    so (None: unchanged). `free_device_bytes()`: free device memory now (the weights are there)."""
    accelerator = next(model.parameters()).device.type != "cpu"
    if "device_activation_bytes" in explicit or not accelerator or config.weights == "stationary":
        return config, None
    seq = dataset_seq_len(dataset)
    model_config = getattr(model, "config", None)
    if seq is None or model_config is None:
        return config, ("activations not counted by `weights` auto: the train dataset's sequence length is "
                        "unknown (an iterable dataset, or no input_ids); set `device_activation_bytes`")
    try:
        terms, _ = device_activations(model_config, config, micro_batch, seq, gradient_checkpointing, True,
                                      free_device_bytes())
    except (ValueError, AttributeError, TypeError) as error:  # not a Llama-style config
        return config, f"activations not counted by `weights` auto ({error}); set `device_activation_bytes`"
    chosen = config.replace(device_activation_bytes=int(terms.total))
    return chosen, (f"weights {config.weights} counts {terms.total / 1e9:.3f} GB of activations (the estimate at "
                    f"{micro_batch} x {seq} tokens, the train dataset's longest of its first samples; "
                    "`device_activation_bytes` sets it)")
