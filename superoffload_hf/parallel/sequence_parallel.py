"""The plain-loop surface of sequence parallelism: a model wrapper and batch sharding.

    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from superoffload_hf import SuperOffloadAdamW
    from superoffload_hf.parallel import SequenceParallel, sequence_parallel_groups

    dist.init_process_group("nccl")                  # torchrun --nproc-per-node 4 ...
    groups = sequence_parallel_groups(2)             # DP 2 x SP 2
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-4, max_grad_norm=1.0)  # every rank: the whole world
    sp = SequenceParallel(model, groups.group, optimizer=opt)
    loader = DataLoader(dataset, batch_size=8, sampler=groups.sampler(dataset))  # one batch per SP group
    for batch in loader:
        loss = sp(**sp.shard_batch(batch))
        loss.backward()
        opt.step(); opt.zero_grad()

`sp(...)` returns the SP group's token-weighted mean loss (the same value on its ranks),
with the gradient that SuperOffloadAdamW's average over every rank needs (loss.py).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from superoffload_hf.parallel import ulysses
from superoffload_hf.parallel.loss import sequence_parallel_loss
from superoffload_hf.parallel.sequence_shard import IGNORE_INDEX, BatchChecks, shard_sequence


def shard_batch(batch: Mapping[str, torch.Tensor], group, pad_token_id: int = 0,
                ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """This rank's part of `batch` (sequence_shard.py: input_ids, position_ids, shift_labels),
    checked at once (a device batch: one synchronisation; SequenceParallel.shard_batch avoids it)."""
    import torch.distributed as dist

    return shard_sequence(batch, dist.get_rank(group), dist.get_world_size(group), pad_token_id, ignore_index)


class SequenceParallel:
    """A causal LM whose attention runs as Ulysses over `group` (ulysses.py). The model itself
    is changed in place (its config's attention implementation): train `model`'s parameters."""

    def __init__(self, model: torch.nn.Module, group, optimizer=None, ignore_index: int = IGNORE_INDEX,
                 pad_token_id: Optional[int] = None):
        import torch.distributed as dist

        # `optimizer` (SuperOffloadAdamW): its weight all-gathers, issued by its worker thread
        # after step(), must all be issued before this forward's all-to-alls (before_collective)
        self.model, self.group, self.optimizer, self.ignore_index = model, group, optimizer, ignore_index
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        config = model.config
        ulysses.kv_heads_for(getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                             config.num_attention_heads, self.size)
        self.inner = config._attn_implementation
        if self.inner is not None and self.inner.startswith(ulysses.PREFIX):  # wrapped before: same inner
            self.inner = self.inner[len(ulysses.PREFIX):]
        config._attn_implementation = ulysses.register(group, self.inner)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (getattr(config, "pad_token_id", None) or 0)
        self.checks = BatchChecks()  # a batch's checks read without synchronising the device

    def shard_batch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of `batch`; its position and padding checks are read a call late
        (sequence_shard.BatchChecks: the first batch's at once)."""
        return shard_sequence(batch, self.rank, self.size, self.pad_token_id, self.ignore_index, self.checks)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor,
                 **kwargs) -> torch.Tensor:
        """The SP group's loss on this rank's shard (from `shard_batch`)."""
        for key in ("attention_mask", "labels"):
            if key in kwargs:  # the model would drop the mask (no mask function for the wrapper) or shift again
                raise ValueError(f"SequenceParallel: `{key}` was passed to the model call; pass the batch through "
                                 "`shard_batch` first (it turns labels into shift_labels and right padding into "
                                 "ignored targets) and call with its output.")
        if input_ids.shape != position_ids.shape:
            raise ValueError(f"SequenceParallel: position_ids {tuple(position_ids.shape)} do not match input_ids "
                             f"{tuple(input_ids.shape)}; pass the output of `shard_batch` unchanged.")
        return sequence_parallel_loss(self.logits(input_ids, position_ids, **kwargs), shift_labels, self.group,
                                      self.ignore_index)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """The model's logits on this rank's shard (its attention over the SP group's whole sequences)."""
        if self.optimizer is not None:
            self.optimizer.before_collective()  # one order of collectives across threads on every rank
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).logits
