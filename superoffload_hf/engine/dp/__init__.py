"""Data parallelism as the sharded route: reduce-scatter and global norm, the all-gathers, weight-flow's sharded fetches, and per-rank shard checkpoints."""
