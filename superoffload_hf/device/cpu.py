"""The CPU as the device: a synchronous runtime (see runtime.py for the interface).

Copies run at once on the calling thread; streams and events are no-ops. The engine's code
paths are otherwise the same as on an accelerator, which is how the CPU tests cover them.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from superoffload_hf.device.runtime import NullEvent, NullStream, nothing


class CpuRuntime:
    is_async = False
    pinned_rounds_to_power_of_two = False  # nothing is pinned
    host_is_device = True
    name = "cpu"

    def __init__(self):
        self.device = torch.device("cpu")
        self._stream = NullStream()

    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)  # nothing crosses a link: pinning has no meaning

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def host_empty_cache(self) -> int:
        """Nothing is pinned; what caches freed host memory here is the C allocator: give its
        free pages back to the system (see release_free_heap). Returns 0: it does not say how
        many bytes went."""
        release_free_heap()
        return 0

    def host_register(self, enabled: bool, threads: int = 1) -> bool:
        return False  # nothing is pinned

    def adopt(self, params) -> None:
        pass

    def disown(self, params) -> None:
        pass

    def adopt_activation(self, tensor: torch.Tensor) -> None:
        pass  # the device is the host: nothing to book

    def current_stream(self) -> NullStream:
        return self._stream

    def new_stream(self) -> NullStream:
        return self._stream

    def new_event(self, timing: bool = False) -> NullEvent:
        return NullEvent()

    def on_stream(self, stream):
        return nothing()

    def thread_device(self):
        return nothing()

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        pass

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        tensor.untyped_storage().resize_(nbytes)

    def max_memory_allocated(self):
        return None  # the device is this process's memory: the host ledger accounts for it

    def reset_peak_memory_stats(self) -> None:
        pass

    def allocator_slack(self) -> int:
        return 0  # no caching allocator of a device

    def memory_info(self) -> tuple[int, int]:
        pages, page = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * page, os.sysconf("SC_PHYS_PAGES") * page


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc; absent elsewhere (macOS, musl)
    except OSError:
        return None


def release_free_heap() -> None:
    """Return the free pages of glibc's heap to the system (`malloc_trim(0)`; nothing where the C
    library has none). glibc serves a block below its mmap threshold from the heap, and after a
    large block is freed it raises that threshold to the block's size (up to 32 MiB): a re-plan's
    old arenas and gradient ring then leave holes in the heap that stay resident, uncounted by
    the Ledger, for the life of the process (0.6-1.7 B/param with compact state on a 31.6M
    Llama). The engine calls this where it frees such buffers (runtime.host_empty_cache())."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
