"""The device seam: the one small interface through which the engine uses a device runtime.

Three implementations, chosen by `superoffload_hf.device.make_runtime`:

* `cpu.CpuRuntime`: the device is the CPU. Streams and events are no-ops, copies run at once.
* `accelerator.AcceleratorRuntime`: CUDA, XPU or any backend of `torch.accelerator`, through the
  generic `torch.Stream` / `torch.Event` API. The only module of the package that names a
  device runtime.
* `superoffload_hf.testing.sim.SimRuntime`: the simulated asynchronous device (CPU tensors,
  lazily run streams, poisoned in-flight copies) that executes this path in CI.

A runtime offers (the `DeviceRuntime` protocol below states it as types; streams and events
follow `torch.Stream` / `torch.Event`, typed as `DeviceStream` / `DeviceEvent`):

    name: str                      "cpu", "cuda:0", "sim:0": what summaries print
    device: torch.device           where the parameters live
    is_async: bool                 False: every copy has finished when copy_() returns
    pinned_rounds_to_power_of_two  True: a pinned host_empty takes the next power of two bytes
    host_is_device: bool           the device's memory is this process's host memory, and copies
                                   are synchronous: a host buffer can be used as a device tensor
    host_empty(numel, dtype, pinned) -> Tensor      a host buffer (page-locked when pinned)
    device_empty(numel, dtype) -> Tensor            a device buffer, on the current stream
    host_empty_cache() -> int      give the page-locked blocks the host allocator caches after a
                                   free back to the system (bytes returned, 0 where unknown)
    host_register(enabled, threads) -> bool  page-lock the host blocks allocated from now on by
                                   cudaHostRegister of pageable memory that `threads` threads fault
                                   in (torch's `pinned_use_cuda_host_register`), else by
                                   cudaHostAlloc; False where the runtime has no such choice
    adopt(params)                  the parameters the engine manages live on this device
    disown(params)                 those parameters' storages are host memory now (weight-flow's
                                   close() of a model its device cannot hold): nothing on a real
                                   device (a CPU tensor is host memory); the simulated device
                                   stops counting them as device memory
    adopt_activation(tensor)       a tensor the compute stream's kernels produced (an activation
                                   its owner will copy on a side stream and free after an event
                                   wait, not record_stream): nothing on a real device (it is
                                   device memory already); the simulated device books it
    current_stream() -> Stream     this thread's current stream
    new_stream() -> Stream
    new_event(timing=False) -> Event  event.record(stream) / .synchronize() / .query() /
                                   .elapsed_time(end) in ms (0.0 where the runtime has no clock)
    on_stream(stream)              context: this thread's current stream, restored on exit
    thread_device()                context: this thread's current device is ours (worker threads)
    copy_(dst, src)                a non_blocking copy, queued on the current stream
    record_stream(tensor, stream)  tensor's memory is not reused until stream's queued work ran
    memory_info() -> (free, total) device memory in bytes
    resize_storage(tensor, nbytes) tensor.untyped_storage().resize_(nbytes) on the current stream:
                                   weight-flow's fetch (allocate) and release (0), as FSDP does
    max_memory_allocated() -> int | None  peak device bytes allocated since the start or
                                   reset_peak_memory_stats() (None: the CPU, not tracked)
    reset_peak_memory_stats()
    allocator_slack() -> int       device bytes the caching allocator holds beyond what it serves
                                   (reserved - allocated; 0 where there is none)

Streams: `wait_event(event)`, `wait_stream(stream)`. Nothing in the seam blocks the host except
`Event.synchronize()`: the engine never calls a device-wide synchronize.

Optional, looked up with getattr/hasattr where used: `pci_bus_id()` (accelerator: the NUMA node
of the device, engine/placement.py), `counts_params_at_adopt` and `host_budget_left()` (the
simulated device's memory model).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class DeviceEvent(Protocol):
    def record(self, stream=None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end) -> float: ...


@runtime_checkable
class DeviceStream(Protocol):
    def wait_event(self, event) -> None: ...
    def wait_stream(self, stream) -> None: ...


@runtime_checkable
class DeviceRuntime(Protocol):
    """The seam's members the engine uses (the module docstring says what each does). CpuRuntime,
    AcceleratorRuntime and testing.sim.SimRuntime implement it; tests/sim/test_device_seam.py checks
    their members and signatures against it."""

    name: str
    device: torch.device
    is_async: bool
    pinned_rounds_to_power_of_two: bool
    host_is_device: bool

    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor: ...
    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...
    def host_empty_cache(self) -> int: ...
    def host_register(self, enabled: bool, threads: int = 1) -> bool: ...
    def adopt(self, params) -> None: ...
    def disown(self, params) -> None: ...
    def adopt_activation(self, tensor: torch.Tensor) -> None: ...
    def current_stream(self) -> DeviceStream: ...
    def new_stream(self) -> DeviceStream: ...
    def new_event(self, timing: bool = False) -> DeviceEvent: ...
    def on_stream(self, stream) -> ContextManager[None]: ...
    def thread_device(self) -> ContextManager[None]: ...
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def record_stream(self, tensor: torch.Tensor, stream) -> None: ...
    def memory_info(self) -> tuple[int, int]: ...
    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None: ...
    def max_memory_allocated(self) -> Optional[int]: ...
    def reset_peak_memory_stats(self) -> None: ...
    def allocator_slack(self) -> int: ...


def pinned_block_bytes(nbytes: int, rounds: bool = True) -> int:
    """The host bytes a page-locked `host_empty` of `nbytes` takes where the runtime `rounds`
    (pinned_rounds_to_power_of_two: torch's caching host allocator takes the next power of two)."""
    if nbytes <= 0 or not rounds:
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


class NullEvent:
    """An event on a synchronous device: everything it could mark has already happened."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return 0.0


class NullStream:
    """A stream on a synchronous device: work issued on it has run when the call returns."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield
