"""Long sequences (DESIGN.md section 12): Ulysses sequence parallelism, activation offload, and
the sequence-tiled loss and MLP.

ulysses (the all-to-all around the model's attention) · sequence_shard (one rank's part of a
batch, labels shifted before the split) · loss (token-weighted over the SP group) · groups
(world = DP x SP) · sequence_parallel (the plain-loop API: `SequenceParallel`, `shard_batch`) ·
activation_offload (checkpointed block inputs to pinned host memory and back) · tiled_loss,
tiled_mlp (the head + cross-entropy and the MLP in sequence chunks) · tiling (the switches).
"""

from superoffload_hf.parallel.groups import SequenceParallelGroups, sequence_parallel_groups
from superoffload_hf.parallel.loss import sequence_parallel_loss
from superoffload_hf.parallel.sequence_parallel import SequenceParallel, shard_batch

__all__ = ["SequenceParallel", "SequenceParallelGroups", "sequence_parallel_groups", "sequence_parallel_loss",
           "shard_batch"]
