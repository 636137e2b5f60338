"""Process groups of sequence parallelism: world = DP x SP, SP groups of consecutive ranks.

Ranks [k N, (k + 1) N) form SP group k and hold data-parallel replica k's batch, each rank
1/N of every sequence. The optimizer needs no group of its own for this: SuperOffloadAdamW
shards its host state over the whole world and averages gradients over every rank; the loss
(loss.py) scales each SP rank's gradient so that this average is the mean over DP replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from superoffload_hf.config import check_sequence_parallel_size
from superoffload_hf.device.collectives import destroy_process_groups_at_exit


@dataclass(frozen=True)
class SequenceParallelGroups:
    """Where this rank sits in the DP x SP grid, and its SP process group."""

    size: int  # ranks per SP group (sequence_parallel_size)
    rank: int  # this rank's index in its SP group: which part of each sequence it holds
    dp_size: int  # SP groups (data-parallel replicas)
    dp_rank: int  # this rank's SP group: which replica's batch it holds
    group: Any  # this rank's SP process group (torch.distributed)

    def sampler(self, dataset, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        """A DistributedSampler over the DP replicas: the ranks of one SP group draw the same
        samples (the group's batch, which each of them then shards along the sequence)."""
        from torch.utils.data import DistributedSampler

        return DistributedSampler(dataset, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=shuffle, seed=seed,
                                  drop_last=drop_last)

    def describe(self) -> str:
        return (f"sequence parallel: part {self.rank} of {self.size} of replica {self.dp_rank}'s sequences "
                f"(DP {self.dp_size} x SP {self.size})")


def sequence_parallel_groups(size: int, timeout=None) -> SequenceParallelGroups:
    """Create every SP group (a collective: every rank calls it at the same point) and return
    this rank's place. Needs torch.distributed initialised, unless `size` is 1 and it is not."""
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else 1
    check_sequence_parallel_size(size, world)
    if not initialised:
        raise ValueError("sequence parallelism needs torch.distributed: call "
                         "`torch.distributed.init_process_group` first (torchrun / accelerate launch do).")
    rank = dist.get_rank()
    destroy_process_groups_at_exit()
    kw = {} if timeout is None else {"timeout": timeout}
    mine = None
    for start in range(0, world, size):  # every rank creates every group, in one order
        group = dist.new_group(list(range(start, start + size)), **kw)
        if start <= rank < start + size:
            mine = group
    return SequenceParallelGroups(size=size, rank=rank % size, dp_size=world // size, dp_rank=rank // size,
                                  group=mine)
