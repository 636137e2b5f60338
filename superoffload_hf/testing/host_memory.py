"""The simulated device's host memory: CUDA's pinned-host caching allocator and a host budget.

* Pinned blocks follow torch's CachingHostAllocator (ATen/core/CachingHostAllocator.h, torch
  2.11-2.13): a request is rounded up to the next power of two bytes (`PowerOf2Ceil`; the
  `pinned_max_round_threshold` / `pinned_max_cached_size` settings that switch it off default to
  SIZE_MAX), served from a cached free block of exactly that size when there is one, and a freed
  block goes back to the cache, never to the system, until the cache is emptied
  (`torch.accelerator.memory.empty_host_cache()`; the runtime seam's `host_empty_cache()`).
  `pinned_reserved` is what the process holds page-locked (in use + cached), `pinned_high_water`
  its peak: what a dry-run footprint's pinned figure must cover.
* A host budget (bytes; None: none): a new block (pinned, or a pageable host buffer) that would
  take the host memory held past it raises SimHostMemoryError, so an 8B-shaped plan can be
  exercised at scaled-down sizes. `left()` is what the engine's memory check reads.

Accounting only: the tensors are ordinary CPU tensors; the model is of which bytes are held.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Optional

from superoffload_hf.device.runtime import pinned_block_bytes  # noqa: F401 (the block of a request)

HOST_BUDGET_ENV_VAR = "SUPEROFFLOAD_SIM_HOST_BUDGET"  # bytes, for the shared simulated device


class SimHostMemoryError(MemoryError):
    """A host allocation of the simulated device over its host budget."""


def bytes_from_env(var: str, unset_means: str, environ=os.environ) -> Optional[int]:
    """A budget in bytes from environment variable `var` (None: unset, which means `unset_means`)."""
    value = environ.get(var, "").strip()
    if not value:
        return None
    try:
        budget = int(float(value))
    except ValueError:
        budget = -1
    if budget < 0:
        raise ValueError(f"{var}={value!r}; expected a number of bytes >= 0, e.g. {var}=2e9, or unset it "
                         f"for {unset_means}.")
    return budget


def budget_from_env(environ=os.environ) -> Optional[int]:
    return bytes_from_env(HOST_BUDGET_ENV_VAR, "no budget", environ)


class SimHostMemory:
    def __init__(self, budget_bytes: Optional[int] = None):
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"`host_budget_bytes` is {budget_bytes!r}; expected None or an int >= 0.")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self.pageable_live = 0
        self.pinned_in_use = 0
        self.pinned_reserved = 0  # in use + cached
        self.pinned_high_water = 0
        self._cached: Counter = Counter()  # block bytes -> free blocks of that size

    @property
    def held(self) -> int:
        return self.pageable_live + self.pinned_reserved

    def left(self) -> Optional[int]:
        """Bytes the budget still admits (None: no budget)."""
        return None if self.budget_bytes is None else max(0, self.budget_bytes - self.held)

    def allocate_pinned(self, nbytes: int) -> int:
        """A page-locked block for `nbytes`: its size (release it with free_pinned)."""
        block = pinned_block_bytes(nbytes)
        with self._lock:
            if self._cached[block]:
                self._cached[block] -= 1
            else:
                self._admit(block, f"a page-locked block of {block} bytes (a request of {nbytes}, "
                                   "rounded up to a power of two as CUDA's host caching allocator does)")
                self.pinned_reserved += block
                self.pinned_high_water = max(self.pinned_high_water, self.pinned_reserved)
            self.pinned_in_use += block
        return block

    def free_pinned(self, block: int) -> None:
        with self._lock:  # back to the cache, not to the system
            self.pinned_in_use -= block
            self._cached[block] += 1

    def allocate_pageable(self, nbytes: int) -> None:
        with self._lock:
            self._admit(nbytes, f"a pageable host buffer of {nbytes} bytes")
            self.pageable_live += nbytes

    def free_pageable(self, nbytes: int) -> None:
        with self._lock:
            self.pageable_live -= nbytes

    def reset_high_water(self) -> None:
        """Start the high-water mark again from what is held now (as torch's
        reset_peak_host_memory_stats)."""
        with self._lock:
            self.pinned_high_water = self.pinned_reserved

    def empty_cache(self) -> int:
        """Return every cached pinned block to the system; the bytes returned."""
        with self._lock:
            freed = self._cached_total()
            self._cached.clear()
            self.pinned_reserved -= freed
            return freed

    def cached_bytes(self) -> int:
        with self._lock:
            return self._cached_total()

    def _admit(self, nbytes: int, what: str) -> None:
        if self.budget_bytes is not None and self.held + nbytes > self.budget_bytes:
            raise SimHostMemoryError(
                f"The simulated host budget of {self.budget_bytes} bytes does not admit {what}: "
                f"{self.held} bytes are held ({self.pageable_live} pageable, {self.pinned_reserved} "
                f"page-locked of which {self._cached_total()} cached). Raise "
                f"`SimRuntime(host_budget_bytes=...)` / {HOST_BUDGET_ENV_VAR}, or shrink the plan.")

    def _cached_total(self) -> int:
        return sum(size * count for size, count in self._cached.items())
