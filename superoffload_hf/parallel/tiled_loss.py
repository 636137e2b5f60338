"""The sequence-tiled loss: a causal LM's head and cross-entropy over chunks of the tokens, so that
the full logits (tokens x vocabulary, and their fp32 log-softmax and gradients) never exist.

`tiled_cross_entropy(hidden, weight, labels, ...)` is the math: a custom autograd function whose
forward computes each chunk's logits (`hidden_chunk @ weight.T`, in the head's dtype, then fp32
as transformers' ForCausalLMLoss upcasts them) and its summed cross-entropy without a graph, and
whose backward recomputes each chunk's logits and takes that chunk's gradients with autograd
(the same operators as the untiled loss, so each row of the hidden-state gradient is the untiled
one to rounding; the head's gradient is summed over chunks in fp32 and cast once). Saved for
backward: the head's input, the head's weight (no copy) and the labels. Every chunk is computed,
those with no label to predict included (they add exactly zero to the loss and their gradient
rows are exactly zero, as untiled): skipping them would need the labels on the host, a device
synchronisation in forward and backward every step.

`apply_tiled_loss(model)` wraps one transformers causal LM's forward (the instance's, not its
class; and its head's, so that the loss is computed inside a call of the head module, whose hooks,
weight-flow's among them, then run around it): with `labels` (or pre-shifted `shift_labels`) it runs the decoder, then the tiled loss on
the head's weight (tied embeddings: the same Parameter, so both uses accumulate into its grad),
and returns a CausalLMOutputWithPast whose `logits` are None; `return_logits=True` adds the full
logits computed without a graph (for evaluation metrics; they cost the full logits' memory).
Without labels the model's own forward runs. Supported: models whose forward is decoder ->
`get_output_embeddings()` (an nn.Linear) -> ForCausalLMLoss (Llama, Mistral, Qwen2/3); a logit
soft-cap or scale is refused.
"""

from __future__ import annotations

import inspect
import types
from typing import Optional, Union

import torch
import torch.nn.functional as F

from superoffload_hf.config import TILED_LOSS_CHUNK_TOKENS

IGNORE_INDEX = -100  # transformers' and torch's default
_WRAPPED = "_superoffload_untiled_forward"  # the instance attribute holding the model's own forward


def shift_labels_for_causal_lm(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Position t predicts labels[t + 1]; the last position of each sequence predicts nothing
    (as transformers' ForCausalLMLoss pads and shifts)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def tiled_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                        bias: Optional[torch.Tensor] = None, chunk_tokens: int = TILED_LOSS_CHUNK_TOKENS,
                        ignore_index: int = IGNORE_INDEX, shift: bool = True,
                        num_items_in_batch: Union[torch.Tensor, int, None] = None,
                        reduction: str = "mean") -> torch.Tensor:
    """cross_entropy(F.linear(hidden, weight, bias).float(), labels) computed `chunk_tokens` tokens
    at a time.

    hidden (..., seq, h), labels (..., seq): `shift` shifts the labels as a causal LM does;
    `shift=False` takes them as already shifted (sequence parallel shards). `reduction` "mean":
    the mean over tokens whose label is not `ignore_index` (nan when there are none, as torch),
    or the sum divided by `num_items_in_batch` when given (transformers' token-weighted mean
    over gradient accumulation); "sum": the summed loss."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` is {chunk_tokens!r}; expected an integer >= 1.")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"`reduction` is {reduction!r}; expected \"mean\" or \"sum\".")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states of shape {tuple(hidden.shape)} and labels of shape {tuple(labels.shape)}: "
                         "expected labels of the hidden states' shape without its last dimension.")
    if shift:
        labels = shift_labels_for_causal_lm(labels, ignore_index)
    hidden_flat = hidden.reshape(-1, hidden.shape[-1])
    labels_flat = labels.reshape(-1).to(hidden.device)
    if reduction == "sum":
        divisor = None
    elif num_items_in_batch is not None:
        divisor = num_items_in_batch
    else:
        divisor = (labels_flat != ignore_index).sum()
    loss = _TiledHeadLoss.apply(hidden_flat, weight, bias, labels_flat, chunk_tokens, ignore_index)
    if divisor is None:
        return loss
    if torch.is_tensor(divisor):
        divisor = divisor.to(loss.device)
    return loss / divisor


class _TiledHeadLoss(torch.autograd.Function):
    """sum over tokens of cross_entropy(F.linear(hidden, weight, bias).float(), labels), chunked."""

    @staticmethod
    def forward(ctx, hidden_flat, weight, bias, labels_flat, chunk_tokens, ignore_index):
        ctx.save_for_backward(hidden_flat, weight, bias, labels_flat)
        ctx.chunk_tokens, ctx.ignore_index = chunk_tokens, ignore_index
        total = torch.zeros((), dtype=torch.float32, device=hidden_flat.device)
        for start, end in _chunks(labels_flat.numel(), chunk_tokens):
            logits_fp32 = F.linear(hidden_flat[start:end], weight, bias).float()  # one chunk's logits at a time
            total += F.cross_entropy(logits_fp32, labels_flat[start:end], ignore_index=ignore_index, reduction="sum")
            del logits_fp32
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden_flat, weight, bias, labels_flat = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden_flat) if need_hidden else None
        # the head's gradient is summed over chunks in fp32 and cast once (never summed in bf16)
        grad_weight_fp32 = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias_fp32 = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        weight_leaf = weight.detach().requires_grad_(need_weight)  # a graph of this chunk only
        bias_leaf = None if bias is None else bias.detach().requires_grad_(need_bias)
        for start, end in _chunks(labels_flat.numel(), ctx.chunk_tokens):
            hidden_leaf = hidden_flat[start:end].detach().requires_grad_(need_hidden)
            with torch.enable_grad():  # (the logits are not held: the graph keeps only their log-softmax)
                loss = F.cross_entropy(F.linear(hidden_leaf, weight_leaf, bias_leaf).float(), labels_flat[start:end],
                                       ignore_index=ctx.ignore_index, reduction="sum")
            wanted = [t for t, need in ((hidden_leaf, need_hidden), (weight_leaf, need_weight),
                                        (bias_leaf, need_bias)) if need]
            grads = list(torch.autograd.grad(loss, wanted, grad_total))
            if need_hidden:
                grad_hidden[start:end] = grads.pop(0)
            if need_weight:
                grad_weight_fp32 += grads.pop(0)
            if need_bias:
                grad_bias_fp32 += grads.pop(0)
            del loss, grads
        grad_weight = None if grad_weight_fp32 is None else grad_weight_fp32.to(weight.dtype)
        grad_bias = None if grad_bias_fp32 is None else grad_bias_fp32.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _chunks(n: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of each chunk of `n` tokens (no read of the labels: no device synchronisation)."""
    return [(start, min(n, start + chunk_tokens)) for start in range(0, n, chunk_tokens)]


# ---- applying it to a transformers causal LM ---------------------------------------------------


def apply_tiled_loss(model: torch.nn.Module, chunk_tokens: int = TILED_LOSS_CHUNK_TOKENS,
                     return_logits: bool = False, decide=None) -> torch.nn.Module:
    """Compute `model`'s loss with the tiled loss whenever labels are given (see the module
    docstring); returns the model. Applying it twice is an error (remove_tiled_loss undoes it).
    `decide(kwargs) -> bool`: called once, at the first forward with labels (its keyword
    arguments); False keeps the model's own forward from then on (parallel/tiling.py "auto")."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` is {chunk_tokens!r}; expected an integer >= 1.")
    if hasattr(model, _WRAPPED):
        raise ValueError(f"{type(model).__name__} already computes its loss tiled (apply_tiled_loss was called "
                         "before); call remove_tiled_loss(model) first to change its settings.")
    head, decoder = _head_and_decoder(model)
    own_forward = model.forward
    parameters = inspect.signature(own_forward).parameters
    positional = [name for name, p in parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    decided = [None if decide is not None else True]  # the decision, made once

    def tiled_loss_forward(self, *args, **kwargs):
        kwargs.update(zip(positional, args))  # named, as the decoder takes them
        if kwargs.get("labels") is None and kwargs.get("shift_labels") is None:
            return own_forward(**kwargs)
        if decided[0] is None:
            decided[0] = bool(decide(kwargs))
        if not decided[0]:
            return own_forward(**kwargs)
        labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
        kwargs.pop("logits_to_keep", None)  # the loss needs every position
        outputs = decoder(**kwargs)
        hidden = outputs.last_hidden_state
        # through the head module's call, so that its hooks (weight-flow's fetch, release and
        # backward fetch) see the loss as the head's output
        loss = head(hidden, tiled_loss=dict(labels=labels if shift_labels is None else shift_labels,
                                            chunk_tokens=chunk_tokens, ignore_index=ignore_index,
                                            shift=shift_labels is None, num_items_in_batch=num_items))
        logits = None
        if return_logits:
            with torch.no_grad():
                logits = head(hidden)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        rest = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
        return CausalLMOutputWithPast(loss=loss, logits=logits, **rest)

    # the model's own signature: a Trainer built on the tiled model keeps the dataset columns
    # the forward takes (it reads them from the signature; (*args, **kwargs) would drop them)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    tiled_loss_forward.__signature__ = inspect.signature(own_forward).replace(
        parameters=[self_parameter, *parameters.values()])
    setattr(model, _WRAPPED, own_forward)
    model.forward = types.MethodType(tiled_loss_forward, model)
    head.forward = types.MethodType(_head_forward, head)
    return model


def _head_forward(self, hidden, tiled_loss=None):
    """The head's forward; with `tiled_loss` (tiled_cross_entropy's arguments), the tiled loss."""
    if tiled_loss is None:
        return type(self).forward(self, hidden)
    return tiled_cross_entropy(hidden, self.weight, bias=self.bias, **tiled_loss)


def remove_tiled_loss(model: torch.nn.Module) -> torch.nn.Module:
    """Undo apply_tiled_loss: the model's own forward again."""
    if not hasattr(model, _WRAPPED):
        raise ValueError(f"{type(model).__name__} does not compute its loss tiled (apply_tiled_loss was not called).")
    delattr(model, _WRAPPED)
    del model.forward  # the instance attributes: the classes' forward shows again
    del _head_and_decoder(model)[0].forward
    return model


def is_tiled_loss(model: torch.nn.Module) -> bool:
    return hasattr(model, _WRAPPED)


def _head_and_decoder(model):
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "output_logits_scale"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__} sets `{name}` = {getattr(config, name)!r}: its logits are not "
                             "the head's output, which the tiled loss computes. Use `tiled_loss: off` for this model.")
    get_head, get_decoder = getattr(model, "get_output_embeddings", None), getattr(model, "get_decoder", None)
    head = get_head() if get_head is not None else None
    decoder = get_decoder() if get_decoder is not None else None
    if not isinstance(head, torch.nn.Linear) or decoder is None or decoder is model:
        raise ValueError(f"{type(model).__name__} is not a transformers causal LM with a decoder (`get_decoder()`) "
                         "and an nn.Linear head (`get_output_embeddings()`): the tiled loss cannot wrap it. Use "
                         "`tiled_loss: off`, or tiled_cross_entropy(hidden, head_weight, labels) in your own loss.")
    return head, decoder
