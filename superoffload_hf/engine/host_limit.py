"""Whether the host memory a plan needs fits the memory this process may use: checked before the
buffers are allocated, so that a plan too large for the host is refused with its table and the
fixes instead of the kernel's OOM killer ending the process without a message.

The memory this process may use is the smallest of: its cgroup's limit less the cgroup's usage
(cgroup v2 `memory.max` / `memory.current`, v1 `memory.limit_in_bytes` / `memory.usage_in_bytes`,
the tightest on the path up to the root), the kernel's MemAvailable (/proc/meminfo), and a
simulated device's host budget (testing/host_memory.py). Each is what is left *now*, so buffers
already held (a re-plan's old arenas) are not counted twice.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from superoffload_hf.engine.memory import FootprintRow, format_footprint

HOST_PLACES = ("pinned", "host")


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


def mem_available(meminfo: str = "/proc/meminfo") -> Optional[tuple[int, str]]:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, f"MemAvailable in {meminfo}"
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_memory_left(runtime) -> Optional[tuple[int, str]]:
    """(bytes, where that figure came from): the smallest of the limits above, None if none is known."""
    candidates = [c for c in (cgroup_left(), mem_available()) if c is not None]
    budget = getattr(runtime, "host_budget_left", None)
    left = budget() if budget is not None else None
    if left is not None:
        candidates.append((left, "the simulated device's host budget (SimRuntime(host_budget_bytes=...) or "
                                 "SUPEROFFLOAD_SIM_HOST_BUDGET)"))
    return min(candidates, key=lambda c: c[0]) if candidates else None


SCRATCH_ROWS = ("grad staging", "grad landing", "grad landing (spare)")  # footprint rows of buckets.SCRATCH_KINDS
CALLERS_ROWS = ("device params",)  # allocated by the caller before the optimizer exists


def host_bytes(rows: Sequence[FootprintRow], host_is_device: bool) -> int:
    """Host bytes the engine allocates for a footprint: pinned and plain host rows, and the
    device's where the device is this host (the CPU runtime), but not the parameters."""
    places = HOST_PLACES + (("device",) if host_is_device else ())
    return sum(r.nbytes for r in rows if r.place in places and r.what not in CALLERS_ROWS)


def replan_transient(rows: Sequence[FootprintRow]) -> int:
    """What a re-plan holds on top of the state at rest (engine/buckets.py BucketSet.replan): it
    frees the gradient staging and landing arenas first, then allocates each kind's new arena
    before the old one goes: the largest state arena less the scratch arenas freed."""
    host = [r for r in rows if r.place in HOST_PLACES and not r.transient]
    largest = max((r.nbytes for r in host if r.what not in SCRATCH_ROWS), default=0)
    return max(0, largest - sum(r.nbytes for r in host if r.what in SCRATCH_ROWS))


def check_plan_fits(rows: Sequence[FootprintRow], runtime, num_params: int,
                    held: Optional[Sequence[FootprintRow]] = None) -> None:
    """The engine's check before it allocates a plan's buffers (`rows`: its footprint): at
    construction with the re-plan after step 1 to come; before a re-plan (`held`: the footprint
    of the buffers held now, which the move frees)."""
    if held is None:
        check_host_fits(rows, replan_transient(rows), runtime, num_params)
    else:
        check_host_fits(rows, replan_transient(rows), runtime, num_params, "re-planning the buckets",
                        held_bytes=host_bytes(held, runtime.host_is_device))


def check_host_fits(rows: Sequence[FootprintRow], transient_bytes: int, runtime, num_params: int,
                    what: str = "the optimizer's buffers", held_bytes: int = 0) -> None:
    """Raise HostMemoryError if `rows` (the per-kind table of what is about to be allocated) plus
    `transient_bytes` (a re-plan's) less `held_bytes` (already allocated and about to be freed
    by the move) do not fit the host memory this process may use now."""
    need = host_bytes(rows, runtime.host_is_device) + transient_bytes - held_bytes
    left = host_memory_left(runtime)
    if left is None or need <= left[0]:
        return
    available, source = left
    held = f", less {held_bytes / 1e9:.3f} GB already held" if held_bytes else ""
    raise HostMemoryError(
        f"SuperOffload: {what} need {need / 1e9:.3f} GB ({need} bytes) of host memory "
        f"({transient_bytes / 1e9:.3f} GB of it "
        f"while re-planning after step 1: the new arena of one kind before the old one is freed{held}), but "
        f"this process may use {available / 1e9:.3f} GB ({available} bytes) more: {source}. Nothing {'new ' if held_bytes else ''}has been allocated.\n"
        f"{format_footprint(rows, num_params)}\n"
        "Fixes: keep more buckets' state on the device (`device_buckets`), use smaller buckets "
        "(`bucket_size_mb`: the re-plan transient is one kind's arena), spread the state over more data "
        "parallel ranks (each holds 1/N), move the cast to the device (`cast: device`: no low-precision "
        "host copy), give the process more memory (a larger cgroup limit / machine), or, if you know "
        "better than this estimate, skip the check with `host_memory_check: false`.")
