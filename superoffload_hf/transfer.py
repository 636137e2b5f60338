"""Moving bucket data between the device and the host: the only CUDA-specific module.

Two implementations of one small interface:

* `SyncTransfer` (device is the CPU): copies run at once on the calling thread; events are
  `None`; waits are no-ops. The engine's code paths are otherwise identical.
* `CudaTransfer`: gradients go device->host on a side stream `d2h`, parameters host->device on a
  side stream `h2d`, from page-locked buffers, each copy marked by a `torch.cuda.Event`. Nothing
  here ever calls a global `torch.cuda.synchronize()`: the host waits on one event
  (`wait_host`), the compute stream waits on one event (`wait_device`).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch


class SyncTransfer:
    """The device is the CPU: "host" and "device" buffers are separate CPU tensors."""

    is_async = False

    def __init__(self, device: torch.device):
        self.device = device
        self.pin_memory = False

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def grad_to_host(self, grad_dev: torch.Tensor, grad_host: torch.Tensor) -> None:
        grad_host.copy_(grad_dev)

    def params_to_device(self, src_host: torch.Tensor, params: Sequence[torch.Tensor],
                         offsets: Sequence[int]) -> None:
        with torch.no_grad():
            for p, offset in zip(params, offsets):
                p.detach().copy_(src_host[offset:offset + p.numel()].view(p.shape))

    def fence(self) -> None:
        pass  # copies run at once: nothing queued can be overtaken

    def wait_host(self, event: Optional[object]) -> None:
        pass

    def wait_device(self, event: Optional[object]) -> None:
        pass


class CudaTransfer:
    is_async = True

    def __init__(self, device: torch.device, pin_memory: bool):
        self.device = device
        self.pin_memory = pin_memory
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._fence: Optional[torch.cuda.Event] = None  # see fence()

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # Page-locked, so the copies below are truly asynchronous DMA transfers.
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory)

    def grad_to_host(self, grad_dev: torch.Tensor, grad_host: torch.Tensor) -> torch.cuda.Event:
        # grad_dev is produced by kernels queued on the compute stream: the side stream must
        # not start the copy before they ran.
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            grad_host.copy_(grad_dev, non_blocking=True)
            # The caller drops grad_dev now; keep its memory out of the allocator's reach
            # until the copy queued on d2h has read it.
            grad_dev.record_stream(self.d2h)
            done = torch.cuda.Event()
            done.record(self.d2h)
        return done

    def params_to_device(self, src_host: torch.Tensor, params: Sequence[torch.Tensor],
                         offsets: Sequence[int]) -> torch.cuda.Event:
        # Ordering: the engine calls this only after the gradients of `params` were copied to
        # the host (it waited on their d2h event), so every compute-stream kernel that reads
        # these parameters in this backward has already run. The next forward waits on the
        # returned event before it reads them (wait_device).
        # Runs in the worker thread, whose current device is cuda:0 by default: without the
        # device guard, leaving torch.cuda.stream() would cudaSetDevice(0) and create a stray
        # context on GPU 0 when the parameters live on another GPU (one process per GPU).
        with torch.no_grad(), torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
            if self._fence is not None:  # kernels queued before step() (e.g. an evaluation
                self.h2d.wait_event(self._fence)  # forward) still read the old weights
            staged_dev = torch.empty(src_host.numel(), dtype=src_host.dtype, device=self.device)
            staged_dev.copy_(src_host, non_blocking=True)  # reads src_host when it runs: the
            # host must not modify it before the event below (the engine waits via wait_host).
            for p, offset in zip(params, offsets):
                p.detach().copy_(staged_dev[offset:offset + p.numel()].view(p.shape))  # casts here
                # p's memory belongs to the compute stream's pool: if p is freed or replaced
                # (model.to(...)) before a wait on the event below, keep it from being reused
                # while this copy may still write it.
                p.detach().record_stream(self.h2d)
            done = torch.cuda.Event()
            done.record(self.h2d)
        return done

    def fence(self) -> None:
        """Called by the engine on the training thread at step(), before it queues the step's
        host jobs: their copy-backs run after every kernel queued so far on the current
        stream. (The worker's wait on a bucket's d2h event only covers kernels queued before
        that bucket's gradients were flushed; a forward run between backward and step() is
        queued later and must still read the weights of before the step.)"""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._fence = event  # read by the worker thread in params_to_device

    def wait_host(self, event: Optional[torch.cuda.Event]) -> None:
        if event is not None:
            with torch.cuda.device(self.device):  # the worker thread: no stray context on GPU 0
                event.synchronize()  # blocks only the calling thread, only until this copy ran

    def wait_device(self, event: Optional[torch.cuda.Event]) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)  # queued, not blocking


def make_transfer(device: torch.device, pin_memory) -> "SyncTransfer | CudaTransfer":
    if device.type == "cuda":
        return CudaTransfer(device, pin_memory is True or pin_memory == "auto")
    if device.type != "cpu":
        raise ValueError(
            f"Parameters are on {device}; SuperOffload supports CUDA devices and the CPU "
            "(the CPU runs the same code paths, for tests). Move the model to cuda or cpu."
        )
    return SyncTransfer(device)  # pin_memory has no meaning without a CUDA device


def measure_h2d_gbps(device: torch.device, megabytes: int = 64, repeats: int = 3) -> float:
    """Host-to-device bandwidth from a page-locked buffer, in GB/s (CUDA only)."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.current_stream(device).synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream(device).synchronize()  # a one-off measurement at construction
    return src.numel() * repeats / (time.perf_counter() - start) / 1e9
