"""Which cores a rank's host Adam runs on, and how many threads it gets.

`choose_cores` is pure: from the cores this process may run on (sched_getaffinity), the ranks
that share this host, and, when known, the NUMA node nearest this rank's GPU and that node's
cores, it returns this rank's share. Ranks on one host never get overlapping shares (no
oversubscription); a rank's share lies on its GPU's NUMA node when the topology is known (on a
GH200 node, each GPU's own Grace). One core of the share is left to the rank's training thread
(the autograd engine feeding the device). An explicit list (config `host_cores`) wins.

`read_numa_nodes` and `pci_numa_node` read Linux sysfs; elsewhere they return nothing and the
share is taken from the affinity list alone.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence


@dataclass(frozen=True)
class Placement:
    cores: tuple[int, ...]  # the cores this rank's host threads may use
    threads: int  # host Adam threads (one core of the share left for the training thread)
    note: str  # what was chosen and why, for the summary

    def __str__(self) -> str:
        return self.note


def choose_cores(affinity: Sequence[int], *, local_rank: int = 0, local_world: int = 1,
                 numa_node: Optional[int] = None, node_cpus: Mapping[int, Sequence[int]] = (),
                 ranks_on_node: Optional[Sequence[int]] = None,
                 explicit: Optional[Sequence[int]] = None) -> Placement:
    """`ranks_on_node`: the local ranks whose GPU sits on `numa_node` (this one included); None:
    every local rank. `node_cpus`: NUMA node -> its cores."""
    allowed = sorted(set(int(c) for c in affinity))
    if explicit is not None:
        cores = tuple(int(c) for c in explicit)
        outside = sorted(set(cores) - set(allowed))
        if outside:
            raise ValueError(f"`host_cores` lists cores {outside} this process may not run on (allowed: "
                             f"{_ranges(allowed)}); pick cores from the allowed set.")
        return Placement(cores, len(cores), f"explicit cores {_ranges(cores)}: {len(cores)} threads")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"`local_rank` is {local_rank}; expected 0 <= local_rank < local_world ({local_world}).")
    pool, sharers, where = allowed, list(range(local_world)), "of the process's cores"
    node = set(node_cpus.get(numa_node, ())) if numa_node is not None else set()
    if node and node & set(allowed):
        pool = [c for c in allowed if c in node]
        sharers = sorted(ranks_on_node) if ranks_on_node is not None else sharers
        where = f"of NUMA node {numa_node} (nearest the GPU)"
    if local_rank not in sharers:
        raise ValueError(f"local rank {local_rank} is not among the ranks {sharers} said to share its NUMA node.")
    k, n = sharers.index(local_rank), len(sharers)
    share = pool[len(pool) * k // n: len(pool) * (k + 1) // n] or [pool[k % len(pool)]]  # more ranks than cores
    threads = max(1, len(share) - 1)
    shared = f"share {k + 1}/{n} " if n > 1 else ""
    return Placement(tuple(share), threads,
                     f"auto: cores {_ranges(share)} ({shared}{where} {_ranges(pool)}), {threads} threads, "
                     "one core left for the training thread")


def read_numa_nodes(sysfs: str = "/sys") -> dict[int, list[int]]:
    """NUMA node -> its cores, from /sys/devices/system/node/node*/cpulist ({} if unknown)."""
    nodes = {}
    for path in sorted(Path(sysfs, "devices/system/node").glob("node[0-9]*/cpulist")):
        try:
            nodes[int(path.parent.name[4:])] = parse_cpulist(path.read_text())
        except (OSError, ValueError):
            continue
    return nodes


def pci_numa_node(bus_id: str, sysfs: str = "/sys") -> Optional[int]:
    """The NUMA node of a PCI device ("0000:3b:00.0"), None when unknown (-1 in sysfs)."""
    try:
        node = int(Path(sysfs, "bus/pci/devices", bus_id.lower(), "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def parse_cpulist(text: str) -> list[int]:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]."""
    cores = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def bind_current_thread(cores: Sequence[int]) -> bool:
    """Pin the calling thread (Linux: sched_setaffinity on pid 0 is the calling thread) to
    `cores`; False where the platform cannot."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, set(cores))
    except OSError:
        return False
    return True


def _ranges(cores: Sequence[int]) -> str:
    cores = sorted(cores)
    runs: list[list[int]] = []
    for c in cores:
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "none"


def host_placement(explicit: Optional[Sequence[int]], collectives, numa_node: Optional[int]) -> Optional[Placement]:
    """This rank's host cores: explicit (config `host_cores`), or its share of this host under
    data parallelism (on its GPU's NUMA node when known); None: the single-process default
    (`host_threads`, every core but one)."""
    if explicit is None and collectives is None:
        return None
    t = collectives.topology if collectives is not None else None
    sharing = None
    if t is not None and numa_node is not None:  # the local ranks whose GPU sits on this node
        sharing = [r for r, n in enumerate(t.local_numa_nodes) if n == numa_node]
    return choose_cores(sorted(os.sched_getaffinity(0)), local_rank=t.local_rank if t else 0,
                        local_world=t.local_world if t else 1, numa_node=numa_node,
                        node_cpus=read_numa_nodes() if numa_node is not None else {},
                        ranks_on_node=sharing, explicit=explicit)


@contextlib.contextmanager
def bound_to(placement: Optional[Placement]) -> Iterator[None]:
    """The calling thread on `placement`'s cores for the duration: threads it creates (the host
    Adam kernel's pool, when it is built or resized here) inherit them; restored afterwards. The
    C++ pool has no affinity call of its own, so this is how its threads are placed."""
    if placement is None or not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    bound = bind_current_thread(placement.cores)
    try:
        yield
    finally:
        if bound:
            os.sched_setaffinity(0, before)
