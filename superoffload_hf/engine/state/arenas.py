"""The host arenas and the engine's accounting of what it allocates: `Ledger` counts every buffer
from its allocation until the engine drops it, `HostArena` is one kind's buffer for every host
bucket of a plan, laid out by plan/memory.py `arena_layout` (the same arithmetic `footprint`
estimates with)."""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Optional, Sequence

import torch

from superoffload_hf.plan.memory import arena_layout


class Ledger:
    """The engine's own accounting of the buffers it holds: live and peak bytes per
    (kind, place). A buffer counts from its allocation until the engine drops it."""

    def __init__(self):
        self.live: dict[tuple[str, str], int] = defaultdict(int)
        self.peak_total = 0
        self.peak: dict[str, int] = defaultdict(int)  # per place
        self.pin_seconds = 0.0  # spent allocating page-locked buffers (the driver pins every page)

    def allocate(self, runtime, kind: str, place: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = time.perf_counter()
        try:
            if place == "device":
                t = runtime.device_empty(numel, dtype)
            else:
                t = runtime.host_empty(numel, dtype, pinned=place == "pinned")
        except (MemoryError, torch.OutOfMemoryError) as e:
            raise type(e)(f"{e}\nAllocating {kind} ({place}, {numel} x {dtype}) on top of what the engine "
                          f"holds now:\n{self.table()}") from e
        if place == "pinned":
            self.pin_seconds += time.perf_counter() - start
        nbytes = numel * t.element_size()
        self._add(kind, place, nbytes)
        weakref.finalize(t, self._add, kind, place, -nbytes)
        return t

    def _add(self, kind: str, place: str, nbytes: int) -> None:
        self.live[(kind, place)] += nbytes
        self.peak[place] = max(self.peak[place], self.bytes(place))
        self.peak_total = max(self.peak_total, self.bytes())

    def bytes(self, place: Optional[str] = None, kind: Optional[str] = None) -> int:
        return sum(b for (k, p), b in self.live.items()
                   if (place is None or p == place) and (kind is None or k == kind))

    def table(self) -> str:
        """What the engine holds, per (kind, place), in GB."""
        lines = [f"  {'buffer':<26}{'place':<8}{'GB':>10}"]
        for (kind, place), nbytes in sorted(self.live.items()):
            if nbytes:
                lines.append(f"  {kind:<26}{place:<8}{nbytes / 1e9:>10.3f}")
        lines.append(f"  {'total':<34}{self.bytes() / 1e9:>10.3f}")
        return "\n".join(lines)

    def reset_peak(self) -> None:
        self.peak = defaultdict(int, {p: self.bytes(p) for _, p in self.live})
        self.peak_total = self.bytes()


class HostArena:
    """One kind's host buffer for every host bucket of a plan; `view(k)` is host bucket k's."""

    def __init__(self, kind: str, numels: Sequence[int], dtype: torch.dtype, pinned: bool,
                 power_of_two: bool, runtime, ledger: Ledger):
        self.kind = kind
        self.numels = list(numels)
        segments, self.places = arena_layout(self.numels, power_of_two and pinned)
        place = "pinned" if pinned else "host"
        self.segments = [ledger.allocate(runtime, kind, place, n, dtype) for n in segments]

    def view(self, k: int) -> torch.Tensor:
        segment, offset = self.places[k]
        return self.segments[segment][offset:offset + self.numels[k]]
