"""What tests/engine/test_gpu.py checks about pinning, streams and copies, written against the runtime
seam so that the same logic also runs here, on the simulated device (tests/engine/test_gpu_checks.py).

Each check takes the predicates that differ between the two: on CUDA a tensor is host memory
when `t.device.type == "cpu"` and page-locked when `t.is_pinned()`; on the simulated device every
tensor is a CPU tensor, so `SeamRecorder` remembers which storages the runtime handed out as
device or pinned host memory.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

Predicate = Callable[[torch.Tensor], bool]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def expected_host_pinning(engine) -> dict[str, bool]:
    """kind -> page-locked, for every buffer a host bucket has under the engine's BufferPolicy
    (plan/memory.py): what the cast policy actually pins. Cast "device": master (and an fp32
    gradient); cast "host" with a low-precision model: the lowp copy and the landing buffer only."""
    return {kind: pinned for kind, (_, pinned) in engine.buckets.policy.host_kinds().items()}


def pinning_mismatches(engine, is_pinned: Predicate) -> list[str]:
    """Every host bucket buffer whose page-locking differs from the policy's, as sentences."""
    expected = expected_host_pinning(engine)
    problems = []
    for index, rt in enumerate(engine.runtimes):
        if rt.bucket.device_resident:
            continue
        for kind, pinned in expected.items():
            buf = getattr(rt.bufs, kind)
            if buf is None:
                if kind != "recv":  # the landing buffer is allocated at the first copy that needs it
                    problems.append(f"host bucket {index}: no {kind} buffer, but the policy gives it one")
                continue
            if is_pinned(buf) != pinned:
                want = "page-locked" if pinned else "pageable"
                problems.append(f"host bucket {index}: {kind} should be {want}, is not")
    return problems


def stream_key(stream) -> tuple:
    """A stream's identity: torch.Stream / torch.cuda.Stream by (device, stream_id), so that the
    two wrappers of one CUDA stream compare equal; a simulated stream by its number."""
    if hasattr(stream, "stream_id"):
        return (stream.device_type, stream.device_index, stream.stream_id)
    return ("sim", stream.number)


def copy_streams_problems(engine) -> list[str]:
    """d2h, h2d and the compute stream must be three different streams."""
    keys = {"compute": stream_key(engine.runtime.current_stream()),
            "d2h": stream_key(engine.transfer.d2h), "h2d": stream_key(engine.transfer.h2d)}
    names = list(keys)
    return [f"{a} and {b} are the same stream {keys[a]}" for i, a in enumerate(names)
            for b in names[i + 1:] if keys[a] == keys[b]]


class SeamRecorder:
    """Records, on one runtime object, every copy through `runtime.copy_` (the engine's only
    non-blocking copy) from any thread, and every storage `host_empty(pinned=True)` and
    `device_empty` handed out. Install before building the optimizer; `restore()` after."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pinned: set[int] = set()
        self.device: set[int] = set()
        self._lock = threading.Lock()
        self._originals = {name: getattr(runtime, name) for name in ("copy_", "host_empty", "device_empty")}
        runtime.copy_ = self._copy
        runtime.host_empty = self._host_empty
        runtime.device_empty = self._device_empty

    def _copy(self, dst, src):
        with self._lock:
            self.copies.append((dst, src))
        return self._originals["copy_"](dst, src)

    def _host_empty(self, numel, dtype, pinned=False):
        t = self._originals["host_empty"](numel, dtype, pinned=pinned)
        if pinned and numel:
            with self._lock:
                self.pinned.add(_storage(t))
        return t

    def _device_empty(self, numel, dtype):
        t = self._originals["device_empty"](numel, dtype)
        if numel:
            with self._lock:
                self.device.add(_storage(t))
        return t

    def restore(self) -> None:
        for name in self._originals:
            self.runtime.__dict__.pop(name, None)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return _storage(t) in self.pinned

    def is_host_given(self, params) -> Predicate:
        """On the simulated device: host memory is what is neither a device allocation nor a parameter."""
        device = self.device | {_storage(p) for p in params}
        return lambda t: _storage(t) not in device


def pageable_copies(copies, is_host: Predicate, is_pinned: Predicate) -> list[str]:
    """Copies between the host and the device whose host side is pageable. Such a non-blocking
    copy silently runs synchronously (torch stages it through a pinned bounce buffer and blocks
    the calling thread), and torch.cuda.set_sync_debug_mode does not report it."""
    problems = []
    for dst, src in copies:
        host = [(side, t) for side, t in (("dst", dst), ("src", src)) if is_host(t)]
        if len(host) != 1 or not dst.numel():
            continue  # device to device, or host to host (no link crossed)
        side, t = host[0]
        if not is_pinned(t):
            problems.append(f"{'device->host' if side == 'dst' else 'host->device'} copy of {t.numel()} "
                            f"{t.dtype} elements: the host {side} is pageable")
    return problems


def cuda_is_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def cuda_is_pinned(t: torch.Tensor) -> bool:
    return t.is_pinned()
