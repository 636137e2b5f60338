"""Ulysses sequence parallelism around the model's own attention (DESIGN.md section 12).

Each rank of a sequence-parallel (SP) group of N ranks holds 1/N of every sequence. Everything
but attention is token-wise, so it runs on the local shard as it is; attention needs every
token. Around it, an all-to-all switches the sharding from the sequence to the heads:

  q (B, H, S/N, D) --all-to-all--> (B, H/N, S, D)     this rank: heads [r H/N, (r+1) H/N), all tokens
  the model's attention implementation (sdpa, eager, flash, flex) on those heads, full sequence
  out (B, S, H/N, D) --all-to-all--> (B, S/N, H, D)   back to this rank's tokens, every head

The all-to-all is an autograd function: its backward is the inverse all-to-all of the gradient,
so the backward issues the same collectives in reverse (on the SP group, in one order on every
rank: the graph is the same everywhere).

Key/value heads (GQA): with Hkv >= N each rank takes Hkv/N of them, exactly the ones its query
heads read; with Hkv < N (N a multiple of Hkv) each kv head is repeated N/Hkv times before the
all-to-all, so each rank receives the one kv head its H/N query heads share (the repeat's
backward sums the copies' gradients).

Registration: `register(group, inner)` adds "ulysses_<inner>" to transformers'
`AttentionInterface`; `SequenceParallel` sets a model's `config._attn_implementation` to it.
The name has no mask function registered, so the model passes no mask (its mask would be
built for the local shard length); the wrapper builds the full-sequence causal mask the inner
implementation expects with transformers' own `create_causal_mask`. Padding inside the
attention (a 2D mask with zeros), packed sequences and sliding windows are refused here;
sequence_shard.py turns right padding into ignored targets before it gets here.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

PREFIX = "ulysses_"


# ---- the all-to-all ---------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk j of `x` along scatter_dim goes to rank j; what rank i sent comes back as chunk i
    along gather_dim."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    if x.shape[scatter_dim] % n:
        raise ValueError(f"all-to-all over {n} ranks: dimension {scatter_dim} of shape {tuple(x.shape)} "
                         f"is not a multiple of {n}.")
    send = torch.stack(x.chunk(n, dim=scatter_dim))  # (n, ...): chunk j contiguous, for rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: forward scatters `scatter_dim` and gathers `gather_dim`; the
    backward is the inverse exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_to_heads(x_bhsd: torch.Tensor, group) -> torch.Tensor:
    """(B, H, S/N, D) sequence-sharded -> (B, H/N, S, D) head-sharded."""
    return AllToAll.apply(x_bhsd, group, 1, 2)


def heads_to_seq(x_bshd: torch.Tensor, group) -> torch.Tensor:
    """(B, S, H/N, D) head-sharded (attention functions' output layout) -> (B, S/N, H, D)."""
    return AllToAll.apply(x_bshd, group, 1, 2)


def kv_heads_for(kv_heads: int, heads: int, n: int) -> int:
    """How many kv heads go into the all-to-all (repeated when fewer than N); refuses head
    counts that cannot be split over N ranks."""
    if heads % n:
        raise ValueError(
            f"sequence parallelism over {n} ranks splits the {heads} attention heads: the head count must be a "
            f"multiple of `sequence_parallel_size` {n}. Choose a size that divides {heads}.")
    if kv_heads % n == 0:
        return kv_heads
    if n % kv_heads == 0:
        return n
    raise ValueError(
        f"sequence parallelism over {n} ranks with {kv_heads} key/value heads: {n} must divide the key/value "
        f"head count or be a multiple of it (each rank then receives one repeated kv head). Choose a "
        f"`sequence_parallel_size` that divides or is a multiple of {kv_heads}.")


# ---- the attention wrapper ---------------------------------------------------------------------


class _HeadsView:
    """The attention module as the inner implementation sees it: the same module, except for
    the number of query heads per kv head, which is the local one (eager and sdpa repeat the kv
    heads by `num_key_value_groups`)."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int):
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)


class _ConfigView:
    """The model config with `_attn_implementation` set to the inner implementation (for
    transformers' mask creation)."""

    def __init__(self, config, inner: str):
        self._config = config
        self._attn_implementation = inner

    def __getattr__(self, name: str):
        return getattr(self._config, name)


_REFUSED_KWARGS = {
    "cu_seq_lens_q": "packed sequences (cu_seq_lens_q)",
    "cu_seq_lens_k": "packed sequences (cu_seq_lens_k)",
    "seq_idx": "packed sequences (seq_idx)",
}


class UlyssesAttention:
    """An attention function for transformers' AttentionInterface: all-to-all in, the inner
    implementation on this rank's heads over the whole sequence, all-to-all out."""

    def __init__(self, group, inner: str):
        import torch.distributed as dist

        self.group, self.inner = group, inner
        self.size = dist.get_world_size(group)
        self._mask_key: Optional[tuple] = None
        self._mask = None

    def inner_function(self, module: torch.nn.Module) -> Callable:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.inner == "eager":  # each model's own, in its modeling module (not registered)
            fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if fn is None:
                raise ValueError(f"sequence parallelism with attn_implementation 'eager': "
                                 f"{type(module).__module__} has no eager_attention_forward. Use 'sdpa'.")
            return fn
        return ALL_ATTENTION_FUNCTIONS[self.inner]

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None:
            raise ValueError(
                f"sequence parallelism (attention {PREFIX}{self.inner}) was given an attention mask of shape "
                f"{tuple(attention_mask.shape)}: the shards hold parts of each sequence, so a mask built for "
                "them is wrong. Pass batches through `shard_batch` (right padding becomes ignored targets) "
                "and no 4D mask.")
        for name, what in _REFUSED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"sequence parallelism does not support {what}: pass unpacked sequences.")
        if kwargs.get("sliding_window") is not None:
            raise ValueError(f"sequence parallelism does not support sliding-window attention "
                             f"(sliding_window={kwargs['sliding_window']}) yet.")
        kwargs.pop("position_ids", None)  # the local shard's: not the full sequence's
        n = self.size
        heads, kv_heads = query.shape[1], key.shape[1]
        kv_sent = kv_heads_for(kv_heads, heads, n)
        if kv_sent != kv_heads:  # GQA with fewer kv heads than ranks: one (repeated) kv head per rank
            key = key.repeat_interleave(kv_sent // kv_heads, dim=1)
            value = value.repeat_interleave(kv_sent // kv_heads, dim=1)
        q = seq_to_heads(query, self.group)
        k = seq_to_heads(key, self.group)
        v = seq_to_heads(value, self.group)
        view = _HeadsView(module, q.shape[1] // k.shape[1])
        out, _ = self.inner_function(module)(view, q, k, v, self._full_mask(module, q), **kwargs)
        return heads_to_seq(out, self.group), None

    def _full_mask(self, module, q_bhsd: torch.Tensor):
        """The causal mask of the whole sequence in the inner implementation's form (None for
        sdpa / flash, which use is_causal); built once per shape."""
        from transformers.masking_utils import create_causal_mask

        batch, seq = q_bhsd.shape[0], q_bhsd.shape[2]
        key = (batch, seq, q_bhsd.dtype, q_bhsd.device)
        if key != self._mask_key:
            shape_only = torch.empty((batch, seq, 0), dtype=q_bhsd.dtype, device=q_bhsd.device)
            self._mask = create_causal_mask(_ConfigView(module.config, self.inner), shape_only,
                                            **_no_cache_kwargs(create_causal_mask, seq, q_bhsd.device))
            self._mask_key = key
        return self._mask


def _no_cache_kwargs(create_causal_mask, seq: int, device) -> dict:
    """No padding, no cache, in the signature of the installed transformers (5.24 names the
    cache `cache`; earlier 5.x `past_key_values`, with a `cache_position`)."""
    import inspect

    names = inspect.signature(create_causal_mask).parameters
    kwargs = {name: None for name in ("attention_mask", "cache", "past_key_values", "position_ids") if name in names}
    if "cache_position" in names:
        kwargs["cache_position"] = torch.arange(seq, device=device)
    return kwargs


def register(group, inner: str) -> str:
    """Register the Ulysses wrapper of attention implementation `inner` for `group`; returns
    its name. One SP group per process: registering again replaces the group."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if inner is None or inner.startswith(PREFIX):
        raise ValueError(f"sequence parallelism wraps a model's attention implementation; the model's is {inner!r}. "
                         "Build the model with attn_implementation='sdpa' (or 'eager', a flash one).")
    if inner != "eager" and inner not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {inner!r} is not registered in transformers' AttentionInterface; "
                         f"choose one of {sorted(n for n in ALL_ATTENTION_FUNCTIONS if not n.startswith(PREFIX))} "
                         "or 'eager'.")
    name = PREFIX + inner
    AttentionInterface.register(name, UlyssesAttention(group, inner))
    return name
