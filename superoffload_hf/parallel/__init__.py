"""Parallelism for long sequences (DESIGN.md section 12): Ulysses sequence parallelism.

ulysses (the all-to-all around the model's attention) · sequence_shard (one rank's part of a
batch, labels shifted before the split) · loss (token-weighted over the SP group) · groups
(world = DP x SP) · sequence_parallel (the plain-loop API: `SequenceParallel`, `shard_batch`).
"""

from superoffload_hf.parallel.groups import SequenceParallelGroups, sequence_parallel_groups
from superoffload_hf.parallel.loss import sequence_parallel_loss
from superoffload_hf.parallel.sequence_parallel import SequenceParallel, shard_batch

__all__ = ["SequenceParallel", "SequenceParallelGroups", "sequence_parallel_groups", "sequence_parallel_loss",
           "shard_batch"]
