"""The causal-LM loss under sequence parallelism: the token-weighted mean over the SP group.

Each rank holds 1/N of the tokens. The group's loss is

    L = sum over the group's targets of CE / (number of non-ignored targets in the group)

(the count all-reduced over the SP group), the same number on every rank of the group.

Its gradient: SuperOffloadAdamW averages gradients over every rank of the world (DP x SP: it
shards the host state over the whole world, engine/dp/route.py), so the gradient of an SP group is
the sum of its N ranks' gradients only if each rank's is N times its share. The differentiable
part is therefore N * (local CE sum) / count; the value is corrected to L without a gradient
(no collective in the backward). The world mean then equals the mean over DP replicas of each
replica's loss gradient, as DDP computes it: the numbers of one process on the DP replicas'
batches, each replica's loss its own token mean.
"""

from __future__ import annotations

import torch

from superoffload_hf.parallel.sequence_shard import IGNORE_INDEX


def local_sum_and_count(logits: torch.Tensor, shift_labels: torch.Tensor,
                        ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's cross-entropy sum (fp32, differentiable) and its non-ignored target count."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    targets = shift_labels.reshape(-1).to(flat.device)
    total = torch.nn.functional.cross_entropy(flat, targets, ignore_index=ignore_index, reduction="sum")
    return total, (targets != ignore_index).sum()


def sequence_parallel_loss(logits: torch.Tensor, shift_labels: torch.Tensor, group,
                           ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The group's token-weighted mean (its value on every rank), with the gradient of
    N * local sum / count (module docstring). `shift_labels`: pre-shifted (sequence_shard.py)."""
    import torch.distributed as dist

    local, count = local_sum_and_count(logits, shift_labels, ignore_index)
    n = dist.get_world_size(group)
    # one all-reduce for both: the group's target count and CE sum (values only, no gradient)
    totals = torch.stack([count.to(torch.float64), local.detach().to(torch.float64)])
    dist.all_reduce(totals, group=group)
    group_count, group_sum = totals[0].clamp_min(1), totals[1]
    scaled = local * n
    value = (group_sum - scaled.detach().to(torch.float64)).to(local.dtype)
    return (scaled + value) / group_count.to(local.dtype)


def sequence_parallel_window_loss(local_sum: torch.Tensor, group, denominator, world: int,
                                  dp_size: int) -> torch.Tensor:
    """The Trainer's form (integrations/trainer_sequence_parallel.py): `denominator` is the
    target count of the whole step (every gradient-accumulation micro-batch; over every DP
    replica, or `dp_size` times one replica's), as one process divides by it.

    Gradient: `world * local_sum / denominator` (the optimizer averages over the world, so the
    step's gradient is the sum of every shard's CE / denominator). Value: `dp_size * (SP group's
    CE sum) / denominator`, the same on the group's ranks; its mean over the world's ranks (what
    the Trainer logs) is the one-process loss of the micro-batch."""
    import torch.distributed as dist

    group_sum = local_sum.detach().to(torch.float64)
    dist.all_reduce(group_sum, group=group)
    denominator = torch.as_tensor(denominator, dtype=torch.float64, device=local_sum.device).clamp_min(1)
    scaled = local_sum * world / denominator.to(local_sum.dtype)
    value = (dp_size * group_sum / denominator).to(local_sum.dtype)
    return scaled + (value - scaled.detach())
