"""An accelerator (CUDA, XPU, ...) through `torch.accelerator`, `torch.Stream` and `torch.Event`:
the only module of the package that talks to a device runtime (interface: runtime.py).

Hazards of the generic API handled here, once:
* `with stream:` keeps its state on the stream object (re-entry and two threads entering one
  stream misbehave in some torch versions): `on_stream` sets and restores this thread's current
  stream per call instead.
* A new thread's current device is device 0: worker threads enter `thread_device()` so that
  their streams, events and allocations belong to the parameters' device.
* `Tensor.record_stream` exists only for some backends: where it is missing, the tensor is kept
  alive until an event recorded after its last use has completed.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Iterator, Optional

import torch


def _accelerator_api(name: str, *fallbacks: str):
    for candidate in (name, *fallbacks):
        fn = getattr(torch.accelerator, candidate, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"torch {torch.__version__} has no torch.accelerator.{name}; SuperOffload needs torch >= 2.6.")


def _sanitizer():
    """torch's CUDA stream sanitizer where TORCH_CUDA_SANITIZER (or enable_cuda_sanitizer())
    enabled it, else None. Hazard: importing torch.cuda._sanitizer turns on torch's gpu trace for
    the whole process (every allocation, free and event then calls into its Python handler), so
    it is only looked up where torch (or the user) already imported it."""
    module = sys.modules.get("torch.cuda._sanitizer")
    sanitizer = getattr(module, "cuda_sanitizer", None)
    return sanitizer if getattr(sanitizer, "enabled", False) else None


# Every entry into the sanitizer's event handler holds this lock (serialize_sanitizer).
_SANITIZER_LOCK = threading.RLock()


def _serialized(handle):
    @functools.wraps(handle)
    def serialized(*args, **kwargs):
        with _SANITIZER_LOCK:
            return handle(*args, **kwargs)
    return serialized


def serialize_sanitizer(sanitizer) -> None:
    """Make every entry into `sanitizer`'s event handler (torch.cuda._sanitizer: the dispatch
    mode's kernel launches, and the gpu_trace callbacks of event creation, record, wait and
    synchronisation, stream creation and synchronisation, allocation and free) hold one lock,
    once. Hazard: the handler keeps one state (a sequence number, each stream's and event's
    view of the others, each pointer's last write and reads since) that it updates in several
    steps without a lock; the gpu_trace callbacks fire in whichever thread issues the call, and
    the training thread, the host worker and autograd's device thread all issue: an update
    interleaved with another thread's goes astray (a false race, or a missed one). The lock
    covers the record, not the kernel's launch before it: held across a launch that blocks (a
    synchronous copy, a collective waiting for a peer), it would stall or deadlock the others."""
    import torch.cuda._gpu_trace as gpu_trace
    from torch._utils import CallbackRegistry

    handler = sanitizer.dispatch.event_handler
    with _SANITIZER_LOCK:
        if getattr(handler, "_superoffload_serialized", False):
            return
        registries = [r for r in vars(gpu_trace).values() if isinstance(r, CallbackRegistry)]
        if not registries or not all(isinstance(getattr(r, "callback_list", None), list) for r in registries):
            raise RuntimeError(
                f"torch {torch.__version__}'s CUDA stream sanitizer (torch.cuda._gpu_trace) has no callback lists "
                "this package can serialize, and its event handler is not thread-safe: the engine's host worker "
                "would feed it concurrently with the training thread. Unset TORCH_CUDA_SANITIZER, or use a torch "
                "whose gpu_trace registries keep a `callback_list` (as 2.13's do).")
        for registry in registries:
            registry.callback_list[:] = [
                _serialized(cb) if getattr(cb, "__self__", None) is handler else cb for cb in registry.callback_list]
        handler._handle_kernel_launch = _serialized(handler._handle_kernel_launch)
        handler._superoffload_serialized = True


def _sanitizer_in_this_thread():
    """TORCH_CUDA_SANITIZER=1 enables the CUDA stream sanitizer through a dispatch mode, which is
    thread-local: enter it in the worker thread too, so its copies and event waits are checked,
    with every entry into its handler serialized (serialize_sanitizer)."""
    sanitizer = _sanitizer()
    if sanitizer is None:
        return contextlib.nullcontext()
    serialize_sanitizer(sanitizer)
    if threading.current_thread() is threading.main_thread():
        return contextlib.nullcontext()
    return sanitizer.dispatch


# torch's allocator settings keys that choose how new host blocks are page-locked
PINNING_KEYS = ("pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_num_register_threads")
_WRITTEN: dict[str, str] = {}  # settings string host_register wrote -> the user's settings it kept


def allocator_setting_items(settings: str) -> list[tuple[str, str]]:
    """(key, value) of each `key:value` of an allocator settings string (commas inside brackets,
    as in `roundup_power2_divisions:[256:1,>:2]`, belong to the value)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(settings + ","):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            item = settings[start:i].strip()
            if item:
                key, _, value = item.partition(":")
                items.append((key.strip(), value.strip()))
            start = i + 1
    return items


def pinning_settings(user: str, enabled: bool, threads: int) -> Optional[str]:
    """The allocator settings string that pins new host blocks by cudaHostRegister (`enabled`,
    `threads` threads) or cudaHostAlloc while keeping every setting of `user` (the settings in
    force before the engine touched them): torch resets max_split_size_mb,
    roundup_power2_divisions and garbage_collection_threshold to their defaults at every parse,
    so the user's are written again. None where `user` names a pinning key: the user chose."""
    items = allocator_setting_items(user)
    if any(key in PINNING_KEYS for key, _ in items):
        return None
    ours = [("pinned_use_cuda_host_register", "True" if enabled else "False")]
    if enabled:
        ours.append(("pinned_num_register_threads", str(threads)))
    return ",".join(f"{key}:{value}" for key, value in items + ours)


class AcceleratorRuntime:
    is_async = True
    # torch's caching host allocator rounds every page-locked block up to a power of two
    pinned_rounds_to_power_of_two = True
    host_is_device = False

    def __init__(self, device: torch.device):
        if device.index is None:
            device = torch.device(device.type, _accelerator_api("current_device_index", "current_device_idx")())
        self.device = device
        self.name = str(device)
        self._keep_alive: list[tuple[torch.Event, torch.Tensor]] = []  # backends without record_stream
        self._keep_alive_lock = threading.Lock()

    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
        # Page-locked memory makes non_blocking copies true asynchronous DMA transfers.
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def host_empty_cache(self) -> int:
        """Return the page-locked blocks torch's host caching allocator keeps after they were freed
        (it never does on its own). Returns 0: torch does not say how many bytes went."""
        memory = getattr(torch.accelerator, "memory", None)
        empty = getattr(memory, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:  # torch >= 2.9: torch.accelerator.memory; earlier CUDA builds: the private one
            empty()
        return 0

    def host_register(self, enabled: bool, threads: int = 8) -> bool:
        """torch's caching host allocator pins its new blocks by cudaHostRegister (of malloc'ed
        memory, faulted in by `threads` threads) instead of cudaHostAlloc; either way it rounds
        and caches them alike. CUDA only. False, and nothing written, where the user's allocator
        settings name the pinning method: theirs stands (pinning_settings)."""
        getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if self.device.type != "cuda" or setter is None or getter is None:
            return False
        current = getter()
        user = _WRITTEN.get(current, current)  # a string this process wrote stands for the user's under it
        threads = 1 << (max(1, min(int(threads), 128)).bit_length() - 1)  # torch wants a power of two <= 128
        settings = pinning_settings(user, enabled, threads)
        if settings is None:
            return False
        if settings != current and (enabled or current != user):  # torch's default in force: nothing to write
            setter(settings)
            _WRITTEN[settings] = user
        return True

    def adopt(self, params) -> None:
        pass

    def disown(self, params) -> None:
        pass

    def adopt_activation(self, tensor: torch.Tensor) -> None:
        pass  # already device memory, freed by the caching allocator on its allocation stream

    def current_stream(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def new_stream(self) -> torch.Stream:
        return torch.Stream(device=self.device)

    def new_event(self, timing: bool = False) -> torch.Event:
        return torch.Event(device=self.device, enable_timing=timing)

    @contextlib.contextmanager
    def on_stream(self, stream: torch.Stream) -> Iterator[None]:
        previous = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    @contextlib.contextmanager
    def thread_device(self) -> Iterator[None]:
        get = _accelerator_api("current_device_index", "current_device_idx")
        set_ = _accelerator_api("set_device_index", "set_device_idx")
        previous = get()
        set_(self.device.index)
        try:
            with _sanitizer_in_this_thread():
                yield
        finally:
            set_(previous)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream: torch.Stream) -> None:
        try:
            tensor.record_stream(stream)
            return
        except (RuntimeError, NotImplementedError, TypeError):
            pass
        # No caching-allocator support on this backend: hold the tensor until the stream's work
        # queued so far has run.
        done = self.new_event()
        done.record(stream)
        with self._keep_alive_lock:
            self._keep_alive = [(e, t) for e, t in self._keep_alive if not e.query()]
            self._keep_alive.append((done, tensor))

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        tensor.untyped_storage().resize_(nbytes)  # the caching allocator, on the current stream

    def max_memory_allocated(self) -> int:
        return int(torch.accelerator.memory.max_memory_allocated(self.device))

    def reset_peak_memory_stats(self) -> None:
        torch.accelerator.memory.reset_peak_memory_stats(self.device)

    def allocator_slack(self) -> int:
        """Bytes the caching allocator's pools hold beyond what they serve (reserved - allocated)."""
        memory = torch.accelerator.memory
        return max(0, int(memory.memory_reserved(self.device)) - int(memory.memory_allocated(self.device)))

    def memory_info(self) -> tuple[int, int]:
        info = getattr(torch.accelerator, "get_memory_info", None)
        if info is not None:
            free, total = info(self.device)
        else:
            free, total = torch.get_device_module(self.device).mem_get_info(self.device)
        return int(free), int(total)

    def pci_bus_id(self) -> Optional[str]:
        """"dddd:bb:dd.0" of this device (to find its NUMA node), None where the backend does
        not say."""
        try:
            props = torch.get_device_module(self.device).get_device_properties(self.device)
            return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        except (AttributeError, RuntimeError, TypeError):
            return None
