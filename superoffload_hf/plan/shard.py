"""ShardPlan: which part of each bucket's host state a rank owns under data parallelism.

Pure data, like BucketPlan: no tensors, no devices, no process groups.

A bucket's flat buffer (`bucket.numel` elements, parameters laid out by its slots) is padded to a
multiple of the shard world size N and cut into N contiguous shards of `shard_numel` elements;
rank r owns `[r * shard_numel, (r + 1) * shard_numel)`. The padding (at most N - 1 elements, at the
end) is zero and belongs to no parameter; the last shards of a tiny bucket may hold only padding.
With `align` > 1 (compact host state: the group of host/compact.py, as the plan's slots) the
shard size is rounded up to a multiple of it, so every shard, and every piece in it, starts at a
multiple of the group of its parameter's elements: a shard's groups are its parameters' groups,
the same under any world size (up to N x (align - 1) more padding per bucket).

A shard cuts parameters wherever its boundaries fall. Each covered part of a parameter is a
`Piece`: the parameter, the element range `[param_start, param_end)` of its flattened values, and
where that range sits in the shard. `Shard.local_bucket()` turns the pieces into a `Bucket` whose
slots are the pieces (each a 1-d "parameter" of the piece's length, index = the parameter's index),
so the rank's host buffers, the stepper's runs (per-parameter step counts) and the kernel calls
work on the shard exactly as on a whole bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

from superoffload_hf.plan.buckets import Bucket, BucketPlan, ParamSlot


@dataclass(frozen=True)
class Piece:
    slot: int  # position of the parameter in bucket.slots
    index: int  # the parameter's index in the optimizer
    param_start: int  # first element of the parameter's flattened values in this piece
    param_end: int
    offset: int  # first element of the piece in the shard

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class Shard:
    bucket: Bucket
    rank: int
    world: int
    start: int  # first element of the shard in the bucket's padded flat buffer
    numel: int  # every shard of a bucket has this many elements (padding included)
    pieces: tuple[Piece, ...]

    @property
    def padded_numel(self) -> int:
        return self.numel * self.world

    @property
    def end(self) -> int:
        return self.start + self.numel

    @property
    def used_numel(self) -> int:
        """Elements that belong to parameters (the rest is padding)."""
        return sum(p.numel for p in self.pieces)

    def local_bucket(self) -> Bucket:
        """The shard as a bucket of its own: slot j is piece j, at the piece's shard offset."""
        slots = tuple(ParamSlot(index=p.index, offset=p.offset, numel=p.numel, shape=(p.numel,))
                      for p in self.pieces)
        return Bucket(index=self.bucket.index, group=self.bucket.group, slots=slots, numel=self.numel,
                      device_resident=self.bucket.device_resident, speculative=self.bucket.speculative)


def shard_numel(numel: int, world: int, align: int = 1) -> int:
    """Elements per shard of a bucket of `numel` elements over `world` ranks (ceil, rounded up
    to a multiple of `align`)."""
    _check_world(world)
    n = -(-numel // world)
    return -(-n // align) * align


def shard_of(bucket: Bucket, rank: int, world: int, align: int = 1) -> Shard:
    """Rank `rank`'s shard of `bucket` among `world` ranks (`align`: see the module docstring)."""
    _check_world(world)
    if not 0 <= rank < world:
        raise ValueError(f"`rank` is {rank}; expected 0 <= rank < world ({world}).")
    n = shard_numel(bucket.numel, world, align)
    start, end = rank * n, (rank + 1) * n
    pieces = []
    for k, slot in enumerate(bucket.slots):
        lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
        if lo < hi:
            pieces.append(Piece(slot=k, index=slot.index, param_start=lo - slot.offset,
                                param_end=hi - slot.offset, offset=lo - start))
    return Shard(bucket=bucket, rank=rank, world=world, start=start, numel=n, pieces=tuple(pieces))


@dataclass(frozen=True)
class ShardPlan:
    """Every bucket's shard for one rank."""

    plan: BucketPlan
    rank: int
    world: int
    shards: tuple[Shard, ...]

    @classmethod
    def build(cls, plan: BucketPlan, rank: int, world: int) -> "ShardPlan":
        return cls(plan, rank, world, tuple(shard_of(b, rank, world, plan.align) for b in plan.buckets))

    @property
    def host_numel(self) -> int:
        """Elements of host state this rank holds (padding included)."""
        return sum(s.numel for s in self.shards if not s.bucket.device_resident)

    def pieces_of(self, index: int) -> list[tuple[Shard, Piece]]:
        """This rank's pieces of parameter `index` (none, one, or, never, more than one)."""
        return [(s, p) for s in self.shards for p in s.pieces if p.index == index]

    def __str__(self) -> str:
        lines = [f"ShardPlan: rank {self.rank} of {self.world}; {self.host_numel} host elements "
                 f"of {self.plan.total_numel}"]
        for s in self.shards:
            covered = ", ".join(f"{p.index}[{p.param_start}:{p.param_end}]" for p in s.pieces) or "padding only"
            lines.append(f"  bucket {s.bucket.index}: [{s.start}:{s.end}) of {s.padded_numel}: {covered}")
        return "\n".join(lines)


def _check_world(world: int) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"`world` is {world!r}; expected an integer >= 1 (ranks sharing the state).")
