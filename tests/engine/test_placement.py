"""Host core placement per rank: pure choices, plus the sysfs readers on a fake tree."""

from __future__ import annotations

import pytest

from superoffload_hf.engine.placement import choose_cores, parse_cpulist, pci_numa_node, read_numa_nodes


def test_one_rank_keeps_every_core_but_one_for_the_training_thread():
    p = choose_cores(range(8))
    assert p.cores == tuple(range(8)) and p.threads == 7


@pytest.mark.parametrize("local_world", [2, 3, 4, 8])
def test_ranks_sharing_a_host_get_disjoint_shares_that_cover_it(local_world):
    shares = [choose_cores(range(16), local_rank=r, local_world=local_world).cores for r in range(local_world)]
    flat = [c for s in shares for c in s]
    assert sorted(flat) == list(range(16)) and len(set(flat)) == 16
    assert all(choose_cores(range(16), local_rank=r, local_world=local_world).threads == max(1, len(s) - 1)
               for r, s in enumerate(shares))


def test_more_ranks_than_cores_get_one_thread_each():
    p = choose_cores([0, 1], local_rank=3, local_world=4)
    assert p.threads == 1 and len(p.cores) == 1


def test_numa_node_of_the_gpu_is_preferred_and_shared_by_its_ranks():
    nodes = {0: list(range(0, 72)), 1: list(range(72, 144))}
    p = choose_cores(range(144), local_rank=1, local_world=2, numa_node=1, node_cpus=nodes, ranks_on_node=[1])
    assert p.cores == tuple(range(72, 144)) and p.threads == 71 and "NUMA node 1" in p.note
    shares = [choose_cores(range(144), local_rank=r, local_world=4, numa_node=0, node_cpus=nodes,
                           ranks_on_node=[0, 1]).cores for r in (0, 1)]
    assert shares == [tuple(range(0, 36)), tuple(range(36, 72))]


def test_explicit_cores_win_and_must_be_allowed():
    assert choose_cores(range(8), explicit=[2, 3]).cores == (2, 3)
    assert choose_cores(range(8), explicit=[2, 3]).threads == 2
    with pytest.raises(ValueError, match="may not run on"):
        choose_cores(range(4), explicit=[3, 9])


def test_sysfs_readers(tmp_path):
    (tmp_path / "devices/system/node/node0").mkdir(parents=True)
    (tmp_path / "devices/system/node/node0/cpulist").write_text("0-3,8\n")
    (tmp_path / "bus/pci/devices/0000:3b:00.0").mkdir(parents=True)
    (tmp_path / "bus/pci/devices/0000:3b:00.0/numa_node").write_text("0\n")
    assert read_numa_nodes(str(tmp_path)) == {0: [0, 1, 2, 3, 8]}
    assert pci_numa_node("0000:3B:00.0", str(tmp_path)) == 0
    assert pci_numa_node("0000:00:00.0", str(tmp_path)) is None
    assert parse_cpulist("0-1,4") == [0, 1, 4]


@pytest.mark.parametrize("bad", [[], [0, 0], [-1], ["0"], 3])
def test_host_cores_config_is_validated(bad):
    from superoffload_hf.config import ConfigError, SuperOffloadConfig

    with pytest.raises(ConfigError, match="host_cores"):
        SuperOffloadConfig(host_cores=bad)


def test_explicit_host_cores_bind_the_host_threads_and_the_summary_says_so():
    import os

    import torch

    from superoffload_hf import SuperOffloadAdamW

    before = os.sched_getaffinity(0)
    core = sorted(before)[0]
    model = torch.nn.Linear(4, 4)
    with SuperOffloadAdamW(model.parameters(), config={"device_dtype": "fp32", "host_cores": [core],
                                                        "host_kernel": "reference"}) as opt:
        assert opt.host_adam.threads == 1
        assert f"explicit cores {core}: 1 threads" in opt.describe()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert os.sched_getaffinity(0) == before  # the training thread is not left bound
