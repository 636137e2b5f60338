"""Sharded optimizer state: pieces saved by N ranks read back under any layout (no process group)."""

from __future__ import annotations

import pytest
import torch

from superoffload_hf.engine.checkpoint import CorruptStateError
from superoffload_hf.plan.buckets import BucketPlan
from superoffload_hf.plan.shard import ShardPlan
from superoffload_hf.engine.dp.checkpoint import (
    KEYS,
    RangeSource,
    consolidate,
    export_consolidated,
    read_shards,
    shard_path,
    shard_state_dict,
)

SHAPES = [(8, 8), (8,), (3, 5), (1,), (7,), (4, 4)]
GROUPS = [{"lr": 1e-3, "params": list(range(len(SHAPES)))}]


def full_state(steps=None) -> dict:
    g = torch.Generator().manual_seed(0)
    steps = steps or [3] * len(SHAPES)
    state = {i: {"step": steps[i], **{k: torch.randn(s, generator=g) for k in KEYS}}
             for i, s in enumerate(SHAPES) if steps[i]}
    return {"state": state, "param_groups": GROUPS, "superoffload": {"format_version": 1, "loss_scale": {"scale": 1.0}}}


def save_shards(sd: dict, world: int, bucket_numel: int) -> list[dict]:
    """What N ranks write: each its pieces of a plan with `bucket_numel`."""
    plan = BucketPlan.build(SHAPES, [list(range(len(SHAPES)))], bucket_numel=bucket_numel)
    source = RangeSource.of(sd)
    shards = []
    for rank in range(world):
        pieces = []
        for shard in ShardPlan.build(plan, rank, world).shards:
            for p in shard.pieces:
                step = source.step(p.index)
                values = source.read(p.index, p.param_start, p.param_end) if step else {}
                pieces.append((p.index, p.param_start, p.param_end, SHAPES[p.index], step, values))
        shards.append(shard_state_dict(pieces, rank=rank, world=world, param_groups=GROUPS,
                                       extra=sd["superoffload"]))
    return shards


def assert_full_equal(got: dict, want: dict):
    assert sorted(got["state"]) == sorted(want["state"])
    for i, entry in want["state"].items():
        assert got["state"][i]["step"] == entry["step"]
        for k in KEYS:
            assert torch.equal(got["state"][i][k], entry[k]), (i, k)


@pytest.mark.parametrize("world, bucket_numel", [(1, 1000), (2, 40), (3, 64), (4, 10), (7, 17)])
def test_pieces_of_n_ranks_consolidate_to_the_original(world, bucket_numel):
    sd = full_state()
    shards = save_shards(sd, world, bucket_numel)
    assert_full_equal(consolidate(RangeSource.of(shards)), sd)


@pytest.mark.parametrize("saved, loaded", [((2, 40), (4, 10)), ((4, 10), (1, 1000)), ((1, 1000), (2, 64)),
                                           ((3, 17), (2, 40))])
def test_resharding_n_to_m_under_another_bucket_size_is_exact(saved, loaded):
    sd = full_state()
    first = save_shards(sd, *saved)
    second = save_shards(consolidate(RangeSource.of(first)), *loaded)  # N -> M, through ranges only
    assert_full_equal(consolidate(RangeSource.of(second)), sd)


def test_parameters_never_stepped_have_no_pieces():
    sd = full_state(steps=[3, 0, 3, 0, 3, 3])
    shards = save_shards(sd, 2, 40)
    assert all(1 not in s["pieces"] and 3 not in s["pieces"] for s in shards)
    assert_full_equal(consolidate(RangeSource.of(shards)), sd)


def test_a_missing_shard_file_is_refused():
    shards = save_shards(full_state(), 3, 64)
    with pytest.raises(ValueError, match="every rank's shard"):
        RangeSource.of(shards[:2])


def test_a_corrupt_piece_is_refused_when_read():
    shards = save_shards(full_state(), 2, 40)
    index = next(iter(shards[1]["pieces"]))
    shards[1]["pieces"][index]["exp_avg"][0] += 1.0
    source = RangeSource.of(shards)
    with pytest.raises(CorruptStateError, match=f"parameter {index}"):
        source.read(index, 0, source.numel(index))


def test_files_round_trip_with_mmap_and_consolidated_export(tmp_path):
    sd = full_state()
    for s in save_shards(sd, 2, 40):
        torch.save(s, shard_path(str(tmp_path), s["rank"], s["world"]))
    assert len(read_shards(str(tmp_path))) == 2
    exported = export_consolidated(str(tmp_path), str(tmp_path / "optimizer_full.pt"))
    assert_full_equal(exported, sd)
    assert_full_equal(torch.load(tmp_path / "optimizer_full.pt", weights_only=True), sd)
