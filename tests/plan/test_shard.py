"""ShardPlan: pure data, no tensors, no process groups."""

from __future__ import annotations

import pytest

from superoffload_hf.plan.buckets import BucketPlan
from superoffload_hf.plan.shard import ShardPlan, shard_numel, shard_of

SHAPES = [(8, 8), (8,), (3, 5), (1,), (7,)]  # 64 + 8 + 15 + 1 + 7 = 95 elements


def one_bucket(shapes=SHAPES):
    return BucketPlan.build(shapes, [list(range(len(shapes)))], bucket_numel=10**6).buckets[0]


def covered(bucket, world):
    """(param index, element) -> rank, from every rank's pieces; asserts no element twice."""
    owner = {}
    for rank in range(world):
        shard = shard_of(bucket, rank, world)
        for piece in shard.pieces:
            slot = bucket.slots[piece.slot]
            assert slot.index == piece.index
            assert 0 <= piece.offset and piece.offset + piece.numel <= shard.numel
            # the piece sits where the bucket's flat layout puts it
            assert shard.start + piece.offset == slot.offset + piece.param_start
            for e in range(piece.param_start, piece.param_end):
                assert (piece.index, e) not in owner, f"element {e} of param {piece.index} in two shards"
                owner[(piece.index, e)] = rank
    return owner


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 95, 96, 200])
def test_every_element_is_owned_by_exactly_one_rank(world):
    bucket = one_bucket()
    owner = covered(bucket, world)
    assert len(owner) == bucket.numel
    n = shard_numel(bucket.numel, world)
    assert n * world >= bucket.numel > (n - 1) * world  # padding < world elements


def test_sizes_not_divisible_by_world_pad_the_last_shard():
    bucket = one_bucket()  # 95 elements
    shards = [shard_of(bucket, r, 4) for r in range(4)]
    assert [s.numel for s in shards] == [24] * 4
    assert [s.used_numel for s in shards] == [24, 24, 24, 23]
    assert shards[-1].padded_numel == 96


def test_a_parameter_cut_across_shards_has_one_piece_per_shard():
    bucket = one_bucket()
    shards = [shard_of(bucket, r, 4) for r in range(4)]
    pieces_of_first = [(p.param_start, p.param_end) for s in shards for p in s.pieces if p.index == 4]
    # the bucket is laid out in ready order (reverse): param 4 (7 elements) first
    assert bucket.slots[0].index == 4
    pieces_of_matrix = [(p.param_start, p.param_end) for s in shards for p in s.pieces if p.index == 0]
    assert pieces_of_first == [(0, 7)]
    assert pieces_of_matrix == [(0, 17), (17, 41), (41, 64)]  # offset 31: shards 1, 2, 3


def test_tiny_bucket_leaves_empty_shards():
    bucket = one_bucket([(1,), (2,)])
    shards = [shard_of(bucket, r, 4) for r in range(4)]
    assert [s.numel for s in shards] == [1] * 4
    assert [len(s.pieces) for s in shards] == [1, 1, 1, 0]
    assert shards[3].local_bucket().slots == ()
    assert shards[3].local_bucket().numel == 1


def test_local_bucket_slots_are_the_pieces():
    bucket = one_bucket()
    shard = shard_of(bucket, 1, 3)
    local = shard.local_bucket()
    assert local.numel == shard.numel and local.index == bucket.index and local.group == bucket.group
    assert [(s.index, s.offset, s.numel) for s in local.slots] == [(p.index, p.offset, p.numel) for p in shard.pieces]


def test_world_one_is_the_whole_bucket():
    bucket = one_bucket()
    shard = shard_of(bucket, 0, 1)
    assert shard.numel == bucket.numel
    assert [(p.index, p.param_start, p.param_end, p.offset) for p in shard.pieces] == [
        (s.index, 0, s.numel, s.offset) for s in bucket.slots]


def test_shard_plan_lists_every_bucket_and_prints():
    plan = BucketPlan.build([(8, 8), (8,)] * 4, [list(range(8))], bucket_numel=72, device_buckets=1)
    sp = ShardPlan.build(plan, 1, 2)
    assert len(sp.shards) == len(plan.buckets)
    assert sp.host_numel == sum(shard_numel(b.numel, 2) for b in plan.buckets if not b.device_resident)
    assert sp.pieces_of(0) and all(p.index == 0 for _, p in sp.pieces_of(0))
    assert "rank 1 of 2" in str(sp)


@pytest.mark.parametrize("rank, world", [(2, 2), (-1, 2), (0, 0)])
def test_bad_rank_or_world_raises(rank, world):
    with pytest.raises(ValueError):
        shard_of(one_bucket(), rank, world)


def test_aligned_shards_start_every_piece_at_a_group_boundary_of_its_parameter():
    """Compact state (align 32): a shard's groups are its parameters' groups under any world size."""
    plan = BucketPlan.build([(40,), (7,), (100,)], [[0, 1, 2]], bucket_numel=10_000, align=32)
    (bucket,) = plan.buckets
    for world in (2, 3, 4):
        shards = [shard_of(bucket, r, world, align=32) for r in range(world)]
        assert all(s.numel % 32 == 0 and s.start % 32 == 0 for s in shards)
        covered = {}
        for s in shards:
            for p in s.pieces:
                assert p.param_start % 32 == 0 and p.offset % 32 == 0, (world, p)
                covered[p.index] = covered.get(p.index, 0) + p.numel
        assert covered == {0: 40, 1: 7, 2: 100}
    assert shard_numel(bucket.numel, 3, align=32) == 96 and shard_numel(bucket.numel, 3) == -(-bucket.numel // 3)
