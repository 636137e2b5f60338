"""device/collectives.py on gloo with 2 and 4 local processes."""

from __future__ import annotations

import pytest
import torch

from superoffload_hf.device.collectives import Collectives, Topology

from _dist import run_ranks

pytestmark = pytest.mark.timeout(180)


def _both(rank: int, world: int) -> list:
    return [_exercise(rank, world, False), _exercise(rank, world, True)]


def _exercise(rank: int, world: int, subgroups: bool) -> dict:
    import threading

    import torch.distributed as dist

    pg = None
    if subgroups:  # shard within pairs, replicate across them
        pg, _ = dist.new_subgroups(group_size=2)
    coll = Collectives.create(pg)
    t = coll.topology
    out = {"shard_rank": t.shard_rank, "shard_world": t.shard_world, "replicas": t.replicas}
    n = 3  # per shard
    flat = torch.arange(n * t.shard_world, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(n)
    coll.reduce_scatter_mean(flat.clone(), shard)
    out["shard"] = shard
    coll.has_reduce_scatter = False  # the gloo fallback: all-reduce + slice
    fallback = torch.empty(n)
    coll.reduce_scatter_mean(flat.clone(), fallback)
    out["fallback"] = fallback
    out["sum"] = coll.all_reduce_sum(float(rank) + 0.5)
    out["presence"] = coll.all_reduce_presence(torch.tensor([rank == 0, 0, 1], dtype=torch.int32))
    out["control"] = (dist.get_backend(coll.control_group), dist.get_world_size(coll.control_group),
                      coll.control_group not in (coll.grad_group, coll.world_group, coll.replica_group))
    # the worker thread's all-gather runs while the training thread issues its own collectives
    gathered = torch.empty(n * t.shard_world)
    worker = threading.Thread(target=coll.all_gather, args=(torch.full((n,), float(t.shard_rank)), gathered))
    worker.start()
    for _ in range(5):
        coll.all_reduce_sum(1.0)
    worker.join()
    out["gathered"] = gathered
    mean = torch.full((2,), float(rank))
    coll.all_reduce_mean(mean)
    out["mean"] = mean
    b = torch.full((2,), float(rank))
    coll.broadcast([b])
    out["broadcast"] = b
    return out


@pytest.fixture(scope="module")
def four_ranks():
    """Every rank's results, the whole world as one shard group and then pairs (one spawn)."""
    return run_ranks(_both, 4)


@pytest.mark.parametrize("subgroups", [False, True])
def test_collectives_average_gather_and_reduce(four_ranks, subgroups):
    world = 4
    results = [r[int(subgroups)] for r in four_ranks]
    mean_factor = sum(r + 1 for r in range(world)) / world  # flat is arange * (rank + 1)
    for rank, out in enumerate(results):
        shard_world = 2 if subgroups else world
        assert out["shard_world"] == shard_world and out["replicas"] == world // shard_world
        j = out["shard_rank"]
        want = torch.arange(3 * j, 3 * j + 3, dtype=torch.float32) * mean_factor
        torch.testing.assert_close(out["shard"], want)
        torch.testing.assert_close(out["fallback"], want)
        group_ranks = [r for r in range(world) if (r // 2 if subgroups else 0) == (rank // 2 if subgroups else 0)]
        assert out["sum"] == sum(r + 0.5 for r in group_ranks)
        assert out["presence"].tolist() == [True, False, True]
        assert out["control"] == ("gloo", world, True)  # presence: a host group of its own, every rank
        torch.testing.assert_close(out["gathered"], torch.arange(shard_world).repeat_interleave(3).float())
        torch.testing.assert_close(out["mean"], torch.full((2,), (world - 1) / 2))
        torch.testing.assert_close(out["broadcast"], torch.zeros(2))


def test_topology_refuses_overlapping_or_unequal_groups():
    with pytest.raises(ValueError, match="partition"):
        Topology.from_groups(4, 0, [(0, 1), (1, 2), (2, 3), (2, 3)])
    with pytest.raises(ValueError, match="differ in size"):
        Topology.from_groups(3, 0, [(0, 1), (0, 1), (2,)])
    t = Topology.from_groups(4, 3, [(0, 1), (0, 1), (2, 3), (2, 3)])
    assert (t.shard_world, t.shard_rank, t.replicas) == (2, 1, 2)
    assert t.replica_groups() == ((0, 2), (1, 3))


def test_single_process_has_no_collectives():
    assert Collectives.create() is None
