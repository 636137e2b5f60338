"""The sequence-tiled MLP: each decoder block's MLP computed `chunk_tokens` tokens at a time, with
recomputation in backward, so that its intermediate (tokens x intermediate: gate, up, their
activation and product, and their gradients) exists one chunk at a time.

An MLP is token-wise (each output row depends on its input row only), so the chunked forward is
the untiled one row by row. `_TiledMLP` saves only the MLP's input (and its parameters, no
copy); backward recomputes each chunk with the module's own forward (torch.func.functional_call
on detached parameters, a graph of one chunk) and takes its gradients with autograd: each row of
the input's gradient is the untiled one to rounding; the parameters' gradients are summed over
chunks in fp32 and cast once, and each parameter receives one gradient per backward (as
untiled: the engine's per-parameter hooks fire once).

`apply_tiled_mlp(model)` wraps the `mlp` of every decoder layer of a transformers model (the
instances' forward, not the class's). Under gradient checkpointing the block's recompute runs
the tiled forward again, which saves only the input.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch.func import functional_call

from superoffload_hf.config import TILED_MLP_CHUNK_TOKENS

_WRAPPED = "_superoffload_tiled_mlp_chunk"  # on each wrapped MLP: its chunk size
_RECOMPUTING = "_superoffload_tiled_mlp_recomputing"  # set while backward runs the MLP's own forward


# torch.compile runs it eagerly (a graph break): Dynamo fails tracing this autograd.Function,
# which takes the module and recomputes its forward under enable_grad in backward
@torch.compiler.disable
def tiled_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor, chunk_tokens: int = TILED_MLP_CHUNK_TOKENS) -> torch.Tensor:
    """`mlp`'s own forward of x (..., h), computed `chunk_tokens` tokens at a time."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` is {chunk_tokens!r}; expected an integer >= 1.")
    names, params = zip(*mlp.named_parameters()) if any(True for _ in mlp.parameters()) else ((), ())
    return _TiledMLP.apply(mlp, names, chunk_tokens, x, *params)


@contextlib.contextmanager
def _recomputing(mlp: torch.nn.Module):
    """functional_call calls the module: its tiled wrapper then runs the module's own forward."""
    setattr(mlp, _RECOMPUTING, True)
    try:
        yield
    finally:
        delattr(mlp, _RECOMPUTING)


def _wrapped_forward(self, x):
    if getattr(self, _RECOMPUTING, False):
        return _own_forward(self)(x)
    return tiled_mlp_forward(self, x, getattr(self, _WRAPPED))


def _own_forward(mlp: torch.nn.Module):
    return type(mlp).forward.__get__(mlp)  # the class's forward: not the tiled wrapper


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mlp, names, chunk_tokens, x, *params):
        ctx.mlp, ctx.names, ctx.chunk_tokens = mlp, names, chunk_tokens
        ctx.save_for_backward(x, *params)
        x_flat = x.reshape(-1, x.shape[-1])
        forward = _own_forward(mlp)
        if x_flat.shape[0] == 0:
            return forward(x)
        out_flat = None
        for start in range(0, x_flat.shape[0], chunk_tokens):  # no graph here: each chunk's intermediate is freed
            chunk = forward(x_flat[start:start + chunk_tokens])
            if out_flat is None:
                out_flat = chunk.new_empty((x_flat.shape[0],) + chunk.shape[1:])
            out_flat[start:start + chunk.shape[0]] = chunk
        return out_flat.view(x.shape[:-1] + out_flat.shape[1:])

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        need_x, need_params = ctx.needs_input_grad[3], ctx.needs_input_grad[4:]
        x_flat = x.reshape(-1, x.shape[-1])
        grad_out_flat = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x_flat = torch.zeros_like(x_flat) if need_x else None
        leaves = [p.detach().requires_grad_(need) for p, need in zip(params, need_params)]
        # the parameters' gradients are summed over chunks in fp32 and cast once
        sums_fp32 = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) if need else None
                     for p, need in zip(params, need_params)]
        wanted_leaves = [leaf for leaf, need in zip(leaves, need_params) if need]
        for start in range(0, x_flat.shape[0], ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, x_flat.shape[0])
            x_leaf = x_flat[start:end].detach().requires_grad_(need_x)
            with torch.enable_grad(), _recomputing(ctx.mlp):
                out = functional_call(ctx.mlp, dict(zip(ctx.names, leaves)), (x_leaf,))
            wanted = ([x_leaf] if need_x else []) + wanted_leaves
            grads = list(torch.autograd.grad(out, wanted, grad_out_flat[start:end]))
            if need_x:
                grad_x_flat[start:end] = grads.pop(0)
            for i, need in enumerate(need_params):
                if need:
                    sums_fp32[i] += grads.pop(0)
            del out, grads
        grad_params = [None if s is None else s.to(p.dtype) for s, p in zip(sums_fp32, params)]
        grad_x = None if grad_x_flat is None else grad_x_flat.view(x.shape)
        return (None, None, None, grad_x, *grad_params)


def apply_tiled_mlp(model: torch.nn.Module, chunk_tokens: int = TILED_MLP_CHUNK_TOKENS) -> torch.nn.Module:
    """Compute the MLP of every decoder layer of `model` `chunk_tokens` tokens at a time; returns
    the model. The layers are `model.get_decoder().layers` (Llama, Mistral, Qwen), each with an
    `mlp` that maps tokens to tokens independently (a dense MLP; a mixture of experts with an
    auxiliary loss is not token-wise in that sense and is not supported)."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"`chunk_tokens` is {chunk_tokens!r}; expected an integer >= 1.")
    mlps = decoder_mlps(model)
    if any(hasattr(mlp, _WRAPPED) for mlp in mlps):
        raise ValueError(f"{type(model).__name__}'s MLPs are already tiled (apply_tiled_mlp was called before); "
                         "call remove_tiled_mlp(model) first to change the chunk size.")
    for mlp in mlps:
        setattr(mlp, _WRAPPED, chunk_tokens)
        mlp.forward = types.MethodType(_wrapped_forward, mlp)
    return model


def remove_tiled_mlp(model: torch.nn.Module) -> torch.nn.Module:
    """Undo apply_tiled_mlp: the MLPs' own forward again."""
    mlps = [mlp for mlp in decoder_mlps(model) if hasattr(mlp, _WRAPPED)]
    if not mlps:
        raise ValueError(f"{type(model).__name__}'s MLPs are not tiled (apply_tiled_mlp was not called).")
    for mlp in mlps:
        delattr(mlp, _WRAPPED)
        del mlp.forward  # the instance attribute: the class's forward shows again
    return model


def is_tiled_mlp(model: torch.nn.Module) -> bool:
    return any(hasattr(mlp, _WRAPPED) for mlp in decoder_mlps(model))


def decoder_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `mlp` of each decoder layer, in order; an error naming the model when there are none."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else model
    layers = getattr(decoder, "layers", None)
    mlps = [layer.mlp for layer in layers] if layers is not None and all(
        isinstance(getattr(layer, "mlp", None), torch.nn.Module) for layer in layers) else []
    if not mlps:
        raise ValueError(f"{type(model).__name__} has no decoder layers with an `mlp` module (looked for "
                         "`model.get_decoder().layers[i].mlp`): the tiled MLP cannot wrap it. Use `tiled_mlp: off`, "
                         "or tiled_mlp_forward(mlp, x) in your own module.")
    return mlps
