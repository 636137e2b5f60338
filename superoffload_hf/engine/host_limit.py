"""Whether the host memory a plan needs fits the memory this process may use: checked before the
buffers are allocated, so that a plan too large for the host is refused with its table and the
fixes instead of the kernel's OOM killer ending the process without a message.

"The memory this process may use" is what the kernel would let it take before refusing or
killing it, left *now* (buffers already held, a re-plan's old arenas, are not counted twice):

* `host_memory_budget` when the config sets it: that budget less this process's resident memory
  (VmRSS). It replaces every figure below: the user knows the machine better.
* otherwise the smallest of
  - its cgroup's limit less the cgroup's usage (cgroup v2 `memory.max` / `memory.current`, v1
    `memory.limit_in_bytes` / `memory.usage_in_bytes`, the tightest on the path up to the root),
    where one is set: the kernel enforces it;
  - MemTotal less the resident memory of every process (/proc/*/statm; shared pages counted in
    each, so it errs low): page cache, free memory, and memory a VM's balloon has not handed
    over yet all count as usable. Not MemAvailable: on a VM whose memory grows as it is used,
    MemAvailable starts far below what the guest can take, and would refuse a plan that fits;
  - CommitLimit less Committed_AS, only under strict overcommit (vm.overcommit_memory = 2, where
    the kernel refuses allocations past it);
  - a simulated device's host budget (testing/host_memory.py).
The refusal names the figure that bound.

What a footprint needs of the host (`host_bytes`, `replan_transient`) is pure arithmetic in
plan/memory.py; this module measures what the host has left, refuses a plan that does not fit,
and decides the snapshot trade against that measurement (`engine_trade`, plan/snapshot_trade.py).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from superoffload_hf.plan.buckets import BucketPlan
from superoffload_hf.plan.memory import (BufferPolicy, FootprintRow, footprint, format_footprint, host_bytes,
                                         replan_transient)
from superoffload_hf.plan.snapshot_trade import SnapshotTrade, snapshot_trade

# where the limits are read (tests point them at files of their own)
MEMINFO, PROC, PROC_SELF_CGROUP, CGROUP_ROOT = "/proc/meminfo", "/proc", "/proc/self/cgroup", "/sys/fs/cgroup"
OVERCOMMIT = "/proc/sys/vm/overcommit_memory"


class HostMemoryError(MemoryError):
    """The host memory a plan needs does not fit the memory this process may use."""


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 "max": no limit


def cgroup_left(proc_self_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[tuple[int, str]]:
    """(bytes left, which file said so) under the tightest cgroup memory limit on this process's
    path, None where there is none (or cgroups are not readable)."""
    try:
        with open(proc_self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: Optional[tuple[int, str]] = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1
            base, files = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # this cgroup and every ancestor
            directory = os.path.join(base, *parts[:depth])
            limit, usage = _read_int(os.path.join(directory, files[0])), _read_int(os.path.join(directory, files[1]))
            if limit is None or limit >= 2**62:  # v1 reports "no limit" as a huge number
                continue
            left = max(0, limit - (usage or 0))
            if best is None or left < best[0]:
                best = (left, f"{os.path.join(directory, files[0])} ({limit / 2**30:.2f} GiB, "
                              f"{(usage or 0) / 2**30:.2f} GiB used)")
    return best


def _meminfo(meminfo: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo's fields in bytes ({} where it cannot be read)."""
    fields = {}
    try:
        with open(meminfo) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return fields


def _resident_bytes(statm: str) -> int:
    try:
        with open(statm) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0  # a process that ended while we read


def processes_resident(proc: str = "/proc") -> int:
    """The resident memory of every process we can see (/proc/<pid>/statm), in bytes."""
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return 0
    return sum(_resident_bytes(os.path.join(proc, pid, "statm")) for pid in pids)


def total_less_resident(meminfo: str = "/proc/meminfo", proc: str = "/proc") -> Optional[tuple[int, str]]:
    """MemTotal less the resident memory of every process, None where MemTotal is unknown."""
    total = _meminfo(meminfo).get("MemTotal")
    if total is None:
        return None
    resident = processes_resident(proc)
    return (max(0, total - resident), f"MemTotal in {meminfo} ({total / 2**30:.2f} GiB) less the resident memory "
                                      f"of every process ({resident / 2**30:.2f} GiB)")


def commit_left(meminfo: str = "/proc/meminfo",
                overcommit: str = "/proc/sys/vm/overcommit_memory") -> Optional[tuple[int, str]]:
    """CommitLimit less Committed_AS under strict overcommit (mode 2), None in the other modes."""
    if _read_int(overcommit) != 2:
        return None
    fields = _meminfo(meminfo)
    if "CommitLimit" not in fields or "Committed_AS" not in fields:
        return None
    limit, committed = fields["CommitLimit"], fields["Committed_AS"]
    return (max(0, limit - committed), f"CommitLimit in {meminfo} ({limit / 2**30:.2f} GiB) less Committed_AS "
                                       f"({committed / 2**30:.2f} GiB) under strict overcommit ({overcommit} = 2)")


def own_resident(status: str = "/proc/self/status") -> int:
    """This process's resident memory (VmRSS), 0 where it cannot be read."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_memory_left(runtime, budget_bytes: Optional[int] = None) -> Optional[tuple[int, str]]:
    """(bytes, where that figure came from): `budget_bytes` (config `host_memory_budget`) less this
    process's resident memory when given, else the smallest of the limits above; None if none
    is known."""
    if budget_bytes is not None:
        resident = own_resident()
        return (max(0, budget_bytes - resident), f"`host_memory_budget` ({budget_bytes / 2**30:.2f} GiB) less this "
                                                 f"process's resident memory ({resident / 2**30:.2f} GiB)")
    candidates = [c for c in (cgroup_left(PROC_SELF_CGROUP, CGROUP_ROOT), total_less_resident(MEMINFO, PROC),
                              commit_left(MEMINFO, OVERCOMMIT)) if c is not None]
    budget = getattr(runtime, "host_budget_left", None)
    left = budget() if budget is not None else None
    if left is not None:
        candidates.append((left, "the simulated device's host budget (SimRuntime(host_budget_bytes=...) or "
                                 "SUPEROFFLOAD_SIM_HOST_BUDGET)"))
    return min(candidates, key=lambda c: c[0]) if candidates else None


def check_plan_fits(rows: Sequence[FootprintRow], runtime, num_params: int,
                    held: Optional[Sequence[FootprintRow]] = None, budget_bytes: Optional[int] = None) -> None:
    """The engine's check before it allocates a plan's buffers (`rows`: its footprint): at
    construction with the re-plan after step 1 to come; before a re-plan (`held`: the footprint
    of the buffers held now, which the move frees). `budget_bytes`: config `host_memory_budget`."""
    if held is None:
        check_host_fits(rows, replan_transient(rows), runtime, num_params, budget_bytes=budget_bytes)
    else:
        check_host_fits(rows, replan_transient(rows), runtime, num_params, "re-planning the buckets",
                        held_bytes=host_bytes(held, runtime.host_is_device), budget_bytes=budget_bytes)


def check_host_fits(rows: Sequence[FootprintRow], transient_bytes: int, runtime, num_params: int,
                    what: str = "the optimizer's buffers", held_bytes: int = 0,
                    budget_bytes: Optional[int] = None) -> None:
    """Raise HostMemoryError if `rows` (the per-kind table of what is about to be allocated) plus
    `transient_bytes` (a re-plan's) less `held_bytes` (already allocated and about to be freed
    by the move) do not fit the host memory this process may use now."""
    need = host_bytes(rows, runtime.host_is_device) + transient_bytes - held_bytes
    left = host_memory_left(runtime, budget_bytes)
    if left is None or need <= left[0]:
        return
    available, source = left
    held = f", less {held_bytes / 1e9:.3f} GB already held" if held_bytes else ""
    raise HostMemoryError(
        f"SuperOffload: {what} need {need / 1e9:.3f} GB ({need} bytes) of host memory "
        f"({transient_bytes / 1e9:.3f} GB of it "
        f"while re-planning after step 1: the new arena of one kind before the old one is freed{held}), but "
        f"this process may use {available / 1e9:.3f} GB ({available} bytes) more, the figure used: {source}. Nothing {'new ' if held_bytes else ''}has been allocated.\n"
        f"{format_footprint(rows, num_params)}\n"
        "Fixes: keep more buckets' state on the device (`device_buckets`), use smaller buckets "
        "(`bucket_size_mb`: the re-plan transient is one kind's arena), spread the state over more data "
        "parallel ranks (each holds 1/N), move the cast to the device (`cast: device`: no low-precision "
        "host copy), give the process more memory (a larger cgroup limit / machine), or, if you know "
        "what this process may use better than that figure, say so with `host_memory_budget` (e.g. "
        "\"100GB\") or skip the check with `host_memory_check: false`.")


def engine_trade(plan: BucketPlan, policy: BufferPolicy, mode: str, runtime, *, check_memory: bool,
                 held_bytes: int = 0, host_budget: Optional[int] = None, host_bytes_per_second: Optional[float] = None,
                 backward_seconds: Optional[float] = None) -> SnapshotTrade:
    """The engine's decision for `plan` before it allocates it: the memory this process may use
    now (engine/host_limit.py; `host_budget`: config `host_memory_budget`) plus `held_bytes` (what the engine holds and a re-plan frees)
    against the plan's footprint without snapshots and its re-plan transient."""
    memory_left, other = None, 0
    if check_memory and policy.compact and mode == "auto":
        left = host_memory_left(runtime, host_budget)
        if left is not None:
            rows = footprint(plan, policy, frozenset())
            memory_left = left[0] + held_bytes
            other = host_bytes(rows, runtime.host_is_device) + replan_transient(rows)
    return snapshot_trade(plan, policy, mode, memory_left=memory_left, other_bytes=other,
                          host_bytes_per_second=host_bytes_per_second, backward_seconds=backward_seconds,
                          overlaps=not runtime.host_is_device)
