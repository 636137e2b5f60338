"""The CPU as the device: a synchronous runtime (see runtime.py for the interface).

Copies run at once on the calling thread; streams and events are no-ops. The engine's code
paths are otherwise the same as on an accelerator, which is how the CPU tests cover them.
"""

from __future__ import annotations

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
        return 0  # nothing is pinned, nothing cached

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
