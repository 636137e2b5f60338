"""A simulated asynchronous device behind the runtime seam (superoffload_hf/device/runtime.py).

Tensors stay on the CPU; what is simulated is the ordering model of CUDA, scheduled so that a
missing synchronisation fails every time (DESIGN.md section 7):

* The compute stream runs eagerly. Side streams are queues that run lazily: only when something
  waits for them (Event.synchronize, a wait of the compute stream, a synchronous copy,
  synchronize_all). `Event.query()` never runs work.
* A non-blocking copy on a side stream poisons its destination (NaN, or 0xA5 bytes) when issued
  and snapshots its source; when it runs, a source that changed meanwhile raises SimRaceError.
  A copy whose host side is pageable is synchronous.
* Events are the only happens-before edges. Kernels on the compute stream are not queued, so
  hazards against them are tracked with a logical compute clock: device buffers written on
  compute (seen through `Tensor._version`) must not be read by a side stream that has not waited
  for a later compute event (RAW); adopted parameters read by a module forward must not be
  overwritten by a side stream that has not waited for a later compute event (WAR).
* `record_stream` is emulated, more strictly than CUDA: a device tensor used on a stream other
  than its allocation stream needs `record_stream(tensor, stream)` by the time the use runs
  (CUDA only needs it before the tensor is freed; a synchronous copy needs none), and a device
  buffer freed while another stream has unrun work on it without one is an error.
  An activation booked by `adopt_activation` (a tensor the compute stream produced, whose owner
  frees it after an event wait instead) needs no record_stream at its use; its free is checked.
* A side-stream copy into an adopted parameter that the compute stream has not waited for (it
  has not run) makes any op of the main thread that reads or writes that parameter's storage an
  error naming the op (a dispatch mode, pushed on the main thread only while such copies are
  pending): functional reads, `p.data` writes, `load_state_dict`, compiled graphs. Modes are per
  thread: the ops of a backward, on the autograd device thread, are checked by its own mode.
* Current stream and current device are per thread, and a new thread's current device is
  device 0, as on CUDA (`current_device()` / `set_device(index)`, the simulated
  `torch.cuda.set_device`). A runtime is device `index` (`SimRuntime(index=1)`: a rank's
  device); a stream, event, copy or allocation issued for it from a thread whose current device
  is another one is an error. `thread_device()` makes its device current in the calling thread.
* Autograd's device thread: while parameters are adopted, `backward()` of any graph runs on a
  per-runtime "autograd device thread" (as CUDA's autograd runs device work, and the hooks, on
  its per-device thread), with the device current there and the caller's current stream; the
  caller blocks until it finishes and gets its exception.
* A virtual device clock, separate from the host's: each stream has a device time in ms that a
  module forward, an op of a backward (on the autograd device thread) and a copy advance by a
  modelled cost, and a stream wait moves to the waited event's time. An event takes its stream's
  time when recorded; `elapsed_time` returns the difference and raises, as CUDA does, unless
  both events were created with `timing=True`, recorded, and have completed.
* Side streams come from a small pool, round robin (CUDA's pool has 32 per priority): two
  `new_stream()` calls may return the same stream.
* Host-blocking waits (event or stream synchronize, synchronize_all, a synchronous copy) are
  counted per thread: `blocking_waits()`; reads of device data on the host (`.item()`,
  `.tolist()`, `bool()`, `.nonzero()`, ...: each a device synchronisation on a GPU) are counted
  inside `count_host_reads()`.

Every violation is appended to `runtime.errors` and raised as SimRaceError in the calling thread.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import weakref
from collections import Counter
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from superoffload_hf.testing.device_memory import SimDeviceMemory, device_budget_from_env
from superoffload_hf.testing.host_memory import SimHostMemory, budget_from_env

_POISON_BYTE = 0xA5
SIDE_STREAMS = 3  # the side-stream pool (CUDA: 32 per priority, round robin)
# The virtual clock's costs (an H100-like device, orders of magnitude only):
LINK_BYTES_PER_MS = 25e6     # a copy of either direction: 25 GB/s
COMPUTE_BYTES_PER_MS = 1e9   # a module forward reads its parameters, a backward op writes its outputs: 1 TB/s
KERNEL_MS = 0.005            # every forward or backward kernel costs at least this much


class SimRaceError(RuntimeError):
    """A synchronisation the simulated device found missing."""


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.storage_offset() * t.element_size()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, start + extent * t.element_size()


def _storage_alias(t: torch.Tensor) -> torch.Tensor:
    # A fresh tensor on t's storage: not a view, so it keeps the memory alive but not t's Python
    # object (the free check relies on that); its version counter is its own.
    alias = torch.empty(0, dtype=t.dtype)
    alias.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    return alias


def _covers(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether writing `dst` (contiguous) writes every byte that reading `src` reads."""
    (d0, d1), (s0, s1) = _byte_span(dst), _byte_span(src)
    return dst.is_contiguous() and _storage_key(dst) == _storage_key(src) and d0 <= s0 and s1 <= d1


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    else:
        pattern = torch.full((t.numel() * t.element_size(),), _POISON_BYTE, dtype=torch.uint8)
        t.copy_(pattern.view(t.dtype).view(t.shape))


def _describe(t: torch.Tensor, where: str) -> str:
    return f"{where} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


class _DeviceBuffer:
    """Bookkeeping of one device tensor: a runtime allocation or an adopted parameter."""

    def __init__(self, tensor: torch.Tensor, alloc_stream: "SimStream"):
        self.ref = weakref.ref(tensor)
        self.alloc_stream = alloc_stream
        self.recorded: set = set()  # (storage key, stream) pairs passed to record_stream
        self.seen_version = tensor._version
        self.last_write = 0  # compute clock of the last write seen on the compute stream


class _Allocation(_DeviceBuffer):
    records_at_use = True  # a use on another stream needs record_stream by the time it runs

    def __init__(self, tensor: torch.Tensor, alloc_stream: "SimStream"):
        super().__init__(tensor, alloc_stream)
        self.key = _storage_key(tensor)
        self.nbytes = tensor.numel() * tensor.element_size()
        self.label = _describe(tensor, "device buffer")


class _Activation(_Allocation):
    """A tensor the compute stream produced (adopt_activation): its owner frees it after the
    compute stream waited for the side stream's use, so a use needs no record_stream; a free
    while that use has not run is still an error (_settle)."""

    records_at_use = False

    def __init__(self, tensor: torch.Tensor, alloc_stream: "SimStream"):
        super().__init__(tensor, alloc_stream)
        self.label = _describe(tensor, "activation (device)")


class _Param(_DeviceBuffer):
    def __init__(self, param: torch.Tensor, compute: "SimStream"):
        super().__init__(param, compute)
        self.last_read = 0  # compute clock of the last module forward that read it


class _Pinned:
    def __init__(self, key: int, block: int, registered: bool):
        self.key = key
        self.block = block  # bytes of the host allocator's block (testing/host_memory.py)
        self.registered = registered  # pinned by cudaHostRegister (host_register on) or cudaHostAlloc


class _Copy:
    def __init__(self, seq, stream, dst, src, dst_buf, src_buf, sync, label, src_label):
        self.seq, self.stream, self.sync, self.label, self.src_label = seq, stream, sync, label, src_label
        self.dst, self.src = _storage_alias(dst), _storage_alias(src)
        self.dst_key, self.src_key = _storage_key(dst), _storage_key(src)
        self.src_host = src_buf is None
        self.uses = [(buf, key) for buf, key in ((dst_buf, self.dst_key), (src_buf, self.src_key)) if buf is not None]
        self.snapshot = self.src.clone()
        self.use_snapshot = False  # the source is rewritten by work ordered after this copy
        self.position = 0
        self.param_key: Optional[int] = None  # set when it writes an adopted parameter

    def release(self) -> None:
        self.dst = self.src = self.snapshot = None
        self.uses = []


class _WaitFor:
    """A side stream's wait on another side stream's event: runs `target` up to `until`."""

    def __init__(self, target: "SimStream", until: int):
        self.target, self.until = target, until
        self.position = 0


class SimEvent:
    def __init__(self, sim: "SimRuntime", timing: bool = False):
        self._sim = sim
        self.timing = timing
        self.stream: Optional[SimStream] = None  # None: never recorded
        self.position = 0
        self.seen_compute = 0
        self.device_ms = 0.0  # the virtual clock of its stream when recorded

    def record(self, stream: Optional["SimStream"] = None) -> None:
        self._sim._record(self, stream)

    def synchronize(self) -> None:
        self._sim._event_synchronize(self)

    def query(self) -> bool:
        return self._sim._event_query(self)

    def elapsed_time(self, end: "SimEvent") -> float:
        """Device milliseconds from this event to `end` on the virtual clock (CUDA's rules)."""
        return self._sim._elapsed_time(self, end)


class SimStream:
    def __init__(self, sim: "SimRuntime", number: int):
        self._sim = sim
        self.number = number
        self.ops: list = []
        self.trimmed = 0  # ops already run and dropped from the front of `ops`
        self.done = 0     # absolute index of the next op to run
        self.seen_compute = 0
        self.waited: dict = {}  # other side stream -> position this stream is ordered after
        self.device_ms = 0.0  # virtual device clock: when the work issued so far will have run

    @property
    def is_compute(self) -> bool:
        return self.number == 0

    @property
    def label(self) -> str:
        return "the compute stream" if self.is_compute else f"side stream {self.number}"

    @property
    def issued(self) -> int:
        return self.trimmed + len(self.ops)

    def pending(self) -> list:
        return self.ops[self.done - self.trimmed:]

    def wait_event(self, event: SimEvent) -> None:
        self._sim._wait_event(self, event)

    def wait_stream(self, stream: "SimStream") -> None:
        self._sim._wait_stream(self, stream)

    def synchronize(self) -> None:
        self._sim._stream_synchronize(self)

    def query(self) -> bool:
        with self._sim._lock:
            return self.done == self.issued

    def __repr__(self) -> str:
        return f"<SimStream {self.label}>"


class _ThreadState(threading.local):
    def __init__(self):
        self.stream: Optional[SimStream] = None
        self.seen_compute = 0
        self.autograd_device_thread = False


class _CurrentDevice(threading.local):
    index = 0  # every thread starts on device 0, as CUDA's do


_current_device = _CurrentDevice()  # one per process, as CUDA's current device


def current_device() -> int:
    """The calling thread's current simulated device index (0 in a new thread)."""
    return _current_device.index


def set_device(index: int) -> None:
    """Make simulated device `index` current in the calling thread only (torch.cuda.set_device)."""
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"set_device({index!r}): expected a device index >= 0.")
    _current_device.index = index


@contextlib.contextmanager
def on_device(index: int) -> Iterator[None]:
    """Simulated device `index` current in the calling thread inside (torch.cuda.device(index))."""
    previous = current_device()
    set_device(index)
    try:
        yield
    finally:
        set_device(previous)


def _forward_hook(runtime_ref, module, args, output):
    if torch.compiler.is_compiling():  # a compiled region: its eager wrapper notes the reads
        return None
    runtime = runtime_ref()
    if runtime is not None and runtime._params:
        runtime._note_forward(module)
    return None


# Ops that make a view or read metadata only: no memory access, no race.
_NO_ACCESS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.lift_fresh.default,
              torch.ops.aten.empty_like.default, torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default,
              torch.ops.aten.full_like.default)


def _check_param_access(sim: "SimRuntime", func, args, kwargs, where: str) -> None:
    """An op touching a parameter's storage while a side-stream copy into it is pending."""
    pending = sim._param_writes  # (read without the lock: a dict lookup, under the GIL)
    if pending and not func.is_view and func not in _NO_ACCESS:
        for t in tree_leaves((args, kwargs)):
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.numel():  # (not a storage-less subclass)
                label = pending.get(_storage_key(t))
                if label is not None:
                    sim._fail(
                        f"{func} {where} reads or writes {label} while a side-stream copy into it is pending: "
                        "the compute stream has not waited for the copy's event (a parameter read outside "
                        "its module's forward, a `p.data` write, a load, a backward reading a weight a "
                        "copy-back is overwriting: wait first, e.g. optimizer.synchronize())")


class _ParamAccessCheck(TorchDispatchMode):
    """Main thread, outside backward: the parameter access check (_check_param_access)."""

    def __init__(self, sim: "SimRuntime"):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check_param_access(self.sim, func, args, kwargs, "on the main thread")
        return func(*args, **kwargs)


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


# the Tensor methods and torch functions whose result on the host needs a device tensor's values
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu",
              "masked_select", "unique", "equal", "allclose")


@contextlib.contextmanager
def _patched_host_reads(sim: "SimRuntime") -> Iterator[Counter]:
    """SimRuntime.count_host_reads. The Tensor methods and torch functions are replaced for the
    duration (every thread's calls count, a custom Function's backward included, which no
    torch-function mode sees), and put back after."""
    reads: Counter = Counter()
    originals = []

    def counting(name, original):
        @functools.wraps(original)
        def read(*args, **kwargs):
            if any(isinstance(a, torch.Tensor) and not sim._is_pinned_host(a) for a in args[:2]):
                reads[name] += 1
            return original(*args, **kwargs)
        return read

    for owner in (torch.Tensor, torch):
        for name in HOST_READS:
            original = getattr(owner, name, None)
            if callable(original):
                originals.append((owner, name, original, name in vars(owner)))
                setattr(owner, name, counting(name, original))
    try:
        yield reads
    finally:
        for owner, name, original, own in reversed(originals):
            if own:
                setattr(owner, name, original)
            else:  # inherited (torch.Tensor from its C base): inherited again
                delattr(owner, name)


class _BackwardClock(TorchDispatchMode):
    """On the autograd device thread, during a backward: every op is checked for parameter
    access (as the main thread's ops are: dispatch modes are per thread, so that mode never sees
    these) and advances the compute stream's device time by its modelled cost."""

    def __init__(self, sim: "SimRuntime"):
        super().__init__()
        self._sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _check_param_access(self._sim, func, args, kwargs or {}, "in a backward on the autograd device thread")
        out = func(*args, **(kwargs or {}))
        self._sim._advance_compute(KERNEL_MS + _tensor_bytes(out) / COMPUTE_BYTES_PER_MS)
        return out


class _AutogradDeviceThread:
    """The thread that runs a runtime's backward passes, as CUDA's autograd engine runs device
    work (and the engine's gradient hooks) on a per-device thread, not the caller's."""

    def __init__(self, sim: "SimRuntime"):
        self._sim_ref = weakref.ref(sim)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=f"autograd device thread ({sim.name})",
                                       daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()
            # Hold nothing while waiting: a job left bound here kept its backward's loss and graph
            # alive until the next job, and that next job (stop()'s None at exit) then freed them
            # on this daemon thread during interpreter shutdown, where taking the GIL ends the
            # thread inside a C++ destructor: std::terminate, the process aborted after its tests.
            del job

    def run(self, fn):
        """Run `fn()` there with the caller's current stream; block; return or raise its outcome."""
        sim = self._sim_ref()
        stream, seen = sim.current_stream(), sim._threads.seen_compute
        outcome, done, work = [], threading.Event(), [fn]
        del fn

        def job():
            state = sim._threads
            state.autograd_device_thread = True
            state.seen_compute = max(state.seen_compute, seen)
            backward = work.pop()
            try:
                with sim.thread_device(), sim.on_stream(stream), _BackwardClock(sim):
                    outcome.append((True, backward()))
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller
                outcome.append((False, error))
            finally:
                del backward  # (its tensors: freed by the caller's thread, not this one; see _serve)
                outcome.append(state.seen_compute)
                done.set()

        self._jobs.put(job)
        done.wait()
        (ok, value), seen_there = outcome
        sim._merge_into_thread(seen_there)  # the caller knows what the backward's thread knew
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._jobs.put(None)


_original_backward = None
_backward_runtimes: "weakref.WeakSet[SimRuntime]" = weakref.WeakSet()
_backward_patch_lock = threading.Lock()


def _backward_on_device_thread(*args, **kwargs):
    runtime = next((r for r in list(_backward_runtimes) if r._params), None)
    if runtime is None or runtime._threads.autograd_device_thread:  # reentrant (checkpointing): in place
        return _original_backward(*args, **kwargs)
    return runtime._autograd_thread().run(lambda: _original_backward(*args, **kwargs))


def _install_backward(runtime: "SimRuntime") -> None:
    global _original_backward
    with _backward_patch_lock:
        _backward_runtimes.add(runtime)
        if _original_backward is None:
            # torch.Tensor.backward calls torch.autograd.backward through the module attribute
            _original_backward = torch.autograd.backward
            torch.autograd.backward = _backward_on_device_thread


def _uninstall_backward(runtime: "SimRuntime") -> None:
    global _original_backward
    with _backward_patch_lock:
        _backward_runtimes.discard(runtime)
        if _original_backward is not None and not len(_backward_runtimes):
            torch.autograd.backward, _original_backward = _original_backward, None


class SimRuntime:
    is_async = True
    counts_params_at_adopt = True  # device memory counts a parameter from adopt() on (device_memory.py)
    pinned_rounds_to_power_of_two = True  # as CUDA's host caching allocator (testing/host_memory.py)
    host_is_device = False  # CPU tensors, but device memory in the model it simulates

    _shared: Optional["SimRuntime"] = None
    _shared_options: dict = {}
    _shared_lock = threading.Lock()

    def __init__(self, main_thread: Optional[threading.Thread] = None, host_budget_bytes: Optional[int] = None,
                 strict_pinned: bool = False, side_streams: int = SIDE_STREAMS, index: int = 0,
                 device_budget_bytes: Optional[int] = None):
        if side_streams < 1:
            raise ValueError(f"side_streams={side_streams}: the simulated device needs at least 1 side stream.")
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"index={index!r}: the simulated device's index must be an int >= 0 (a rank's device).")
        self.side_streams = side_streams
        self.index = index  # the threads that issue work for it must have it current (set_device)
        self.name = f"sim:{index}"
        self.device = torch.device("cpu")
        self.errors: list[SimRaceError] = []
        self.host_memory = SimHostMemory(host_budget_bytes)  # pinned allocator, host budget
        self.device_memory = SimDeviceMemory(device_budget_bytes)  # device budget, allocated, peak
        # a non_blocking copy whose host side is pageable is an error (set it after step 1)
        self.strict_pinned = strict_pinned
        self.host_registered = False  # host_register(): the pinning method the GPU would use
        self.compute_clock = 1
        self._lock = threading.RLock()
        self._main_ident = (main_thread or threading.current_thread()).ident
        self._threads = _ThreadState()
        self.compute = SimStream(self, 0)
        self._streams = [self.compute]
        self._seq = 0
        self._allocations: dict[int, _Allocation] = {}
        self._params: dict[int, _Param] = {}  # id(param) -> record (checked against the weakref)
        self._pinned: dict[int, _Pinned] = {}
        self._freed: list = []  # appended by finalizers only; handled at the next call (_settle)
        self._live_bytes = 0  # the runtime's allocations (device_empty)
        self._param_bytes = 0  # adopted parameters' storages not among them (_count_params)
        self._hook = None
        self._param_writes: dict[int, str] = {}  # storage key -> label: pending copies into parameters
        self._pending_param_copies: dict[int, int] = {}  # storage key -> how many
        self._check: Optional[_ParamAccessCheck] = None  # pushed on the main thread while any are pending
        self._backward_thread: Optional[_AutogradDeviceThread] = None
        self._blocking_waits: Counter = Counter()  # thread ident -> host-blocking waits

    @classmethod
    def shared(cls) -> "SimRuntime":
        """The process-wide simulated device (its main thread is the interpreter's)."""
        with cls._shared_lock:
            if cls._shared is None:
                options = {"host_budget_bytes": budget_from_env(), "device_budget_bytes": device_budget_from_env(),
                           **cls._shared_options}
                cls._shared = cls(main_thread=threading.main_thread(), **options)
            return cls._shared

    @classmethod
    def reset_shared(cls, **options) -> None:
        """Drop the shared device; the next `shared()` is built with `options` (e.g. side_streams)."""
        with cls._shared_lock:
            old, cls._shared = cls._shared, None
            cls._shared_options = dict(options)
        if old is not None:
            old.close()

    def close(self) -> None:
        """Remove the global forward hook and the backward patch (they also go when the runtime
        is collected), and stop the autograd device thread."""
        _uninstall_backward(self)
        if self._backward_thread is not None:
            self._backward_thread.stop()
            self._backward_thread = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._param_writes.clear()
        self._pending_param_copies.clear()
        self._arm_check()

    def _autograd_thread(self) -> _AutogradDeviceThread:
        with self._lock:
            if self._backward_thread is None:
                self._backward_thread = _AutogradDeviceThread(self)
            return self._backward_thread

    # ----------------------------------------------------------------- the seam
    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if not (pinned and numel):
            self.host_memory.allocate_pageable(nbytes)
            t = torch.empty(numel, dtype=dtype)
            weakref.finalize(t, self.host_memory.free_pageable, nbytes)
            return t
        with self._lock:
            self._settle()
            block = self.host_memory.allocate_pinned(nbytes)
            t = torch.empty(numel, dtype=dtype)
            record = _Pinned(_storage_key(t), block, self.host_registered)
            self._pinned[record.key] = record
        weakref.finalize(t, self._freed.append, record)
        return t

    def host_empty_cache(self) -> int:
        """Return the pinned blocks cached by the host allocator to the system; bytes returned."""
        with self._lock:
            self._settle()
            return self.host_memory.empty_cache()

    def pin_method_of(self, t: torch.Tensor) -> Optional[str]:
        """How the page-locked block of `t` was pinned ("cudaHostRegister" / "cudaHostAlloc"), as
        host_register said when it was allocated; None: `t` is not a page-locked allocation."""
        with self._lock:
            record = self._pinned.get(_storage_key(t))
        return None if record is None else "cudaHostRegister" if record.registered else "cudaHostAlloc"

    def host_register(self, enabled: bool, threads: int = 8) -> bool:
        """The switch of CUDA's pinning method (cudaHostRegister vs cudaHostAlloc), recorded only:
        torch's host allocator rounds and caches the blocks alike, and page-locking costs
        nothing here."""
        self.host_registered = bool(enabled)
        return True

    def host_budget_left(self) -> Optional[int]:
        """Bytes the host budget still admits (None: no budget)."""
        with self._lock:
            self._settle()
            return self.host_memory.left()

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self._check_thread_device("an allocation")  # (torch.empty(device="cuda") takes the current one)
        if not numel:
            return torch.empty(numel, dtype=dtype)
        with self._lock:
            self._settle()
            self.device_memory.admit(numel * dtype.itemsize, f"a device buffer of {numel} {dtype}")
            t = torch.empty(numel, dtype=dtype)
            _poison(t)  # reading memory nobody wrote fails visibly
            record = _Allocation(t, self.current_stream())
            self._allocations[record.key] = record
            self._live_bytes += record.nbytes
            self._count()
        weakref.finalize(t, self._freed.append, record)
        return t

    def adopt(self, params) -> None:
        with self._lock:
            self._settle()
            for p in params:
                known = self._params.get(id(p))
                if known is None or known.ref() is not p:
                    self._params[id(p)] = _Param(p, self.compute)
            self._count_params(admit=True)
            if self._hook is None:
                # After the forward, not before: forward pre-hooks (the engine's per-module wait)
                # may still queue work the forward's kernels are ordered after.
                register = torch.nn.modules.module.register_module_forward_hook
                self._hook = register(functools.partial(_forward_hook, weakref.ref(self)))
                weakref.finalize(self, self._hook.remove)
                _install_backward(self)

    def disown(self, params) -> None:
        with self._lock:
            self._settle()
            for p in params:
                known = self._params.get(id(p))
                if known is not None and known.ref() is p:
                    del self._params[id(p)]
            self._count_params()

    def adopt_activation(self, tensor: torch.Tensor) -> None:
        """`tensor`, which the compute stream's kernels just wrote (an activation of the model's
        forward), is device memory from now until its Python object goes: counted in device
        memory, written at this point of the compute clock (a side stream reading it must have
        waited for a later compute event), and checked when freed like any device buffer. Its
        owner orders the free by an event wait rather than record_stream (activation_offload.py),
        so a side-stream use needs no record_stream. Booking a storage twice does nothing."""
        with self._lock:
            self._settle()
            key = _storage_key(tensor)
            if not tensor.numel() or key in self._allocations:
                return
            record = _Activation(tensor, self.compute)
            record.last_write = self.compute_clock
            self.device_memory.admit(record.nbytes, record.label)
            self._allocations[key] = record
            self._live_bytes += record.nbytes
            self._count()
        weakref.finalize(tensor, self._freed.append, record)

    def current_stream(self) -> SimStream:
        return self._threads.stream or self.compute

    def new_stream(self) -> SimStream:
        """The next side stream of the pool, round robin: it may be one already handed out."""
        with self._lock:
            self._check_thread_device("a new stream")
            if len(self._streams) <= self.side_streams:
                stream = SimStream(self, len(self._streams))
                self._streams.append(stream)
                return stream
            self._next_side = getattr(self, "_next_side", 0) % self.side_streams + 1
            return self._streams[self._next_side]

    def new_event(self, timing: bool = False) -> SimEvent:
        return SimEvent(self, timing)

    def blocking_waits(self, thread: Optional[threading.Thread] = None) -> int:
        """Host-blocking waits issued by `thread` (default: the calling thread) so far."""
        with self._lock:
            return self._blocking_waits[(thread or threading.current_thread()).ident]

    def _count_blocking_wait(self) -> None:
        self._blocking_waits[threading.get_ident()] += 1

    @contextlib.contextmanager
    def count_host_reads(self) -> Iterator[Counter]:
        """Count, by operation, the reads of a device tensor's values on the host, in any thread
        (`.item()`, `.tolist()`, `bool()`, `int()`, `.nonzero()`, ...: HOST_READS): on a GPU
        each synchronises the host with the device. Every tensor counts as device memory except
        the runtime's page-locked host buffers (host_empty pinned)."""
        with _patched_host_reads(self) as reads:
            yield reads

    def _is_pinned_host(self, t: torch.Tensor) -> bool:
        with self._lock:
            return _storage_key(t) in self._pinned

    @contextlib.contextmanager
    def on_stream(self, stream: SimStream) -> Iterator[None]:
        if stream._sim is not self:
            raise ValueError(f"{stream!r} belongs to another simulated device")
        previous = self._threads.stream
        self._threads.stream = stream
        try:
            yield
        finally:
            self._threads.stream = previous

    @contextlib.contextmanager
    def thread_device(self) -> Iterator[None]:
        with on_device(self.index):
            yield

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._lock:
            self._settle()
            self._check_thread_device("a copy")
            stream = self.current_stream()
            if dst.numel() == 0:
                return
            dst_buf, src_buf = self._owner(dst), self._owner(src)
            kind = f"{'host' if src_buf is None else 'device'}->{'host' if dst_buf is None else 'device'} copy"
            host_sides = [t for t, buf in ((dst, dst_buf), (src, src_buf)) if buf is None]
            nbytes = dst.numel() * dst.element_size()
            stream.device_ms += KERNEL_MS + nbytes / (LINK_BYTES_PER_MS if host_sides else COMPUTE_BYTES_PER_MS)
            if stream.is_compute:
                uses = [(buf, _storage_key(t)) for t, buf in ((dst, dst_buf), (src, src_buf)) if buf is not None]
                self._fail(*self._missing_records(uses, stream, f"{kind} on {stream.label}"))
                if len(host_sides) == 1 and _storage_key(host_sides[0]) not in self._pinned:
                    self._count_blocking_wait()  # pageable host memory: CUDA's copy blocks the caller
                dst.copy_(src)  # on the user's tensor: a compute write bumps its version, as a kernel's would
                return
            self._merge_thread_into(stream)
            if src_buf is not None:
                self._check_raw(src, src_buf, stream, kind)
            if dst_buf is not None:
                self._check_war(dst, stream, kind)
            pageable = [t for t in host_sides if _storage_key(t) not in self._pinned]
            if self.strict_pinned and pageable and len(host_sides) == 1:
                self._fail(f"strict pinned mode: the {kind} on {stream.label} has a pageable host side, "
                           f"{_describe(pageable[0], 'pageable host buffer')}: a non_blocking copy from or to "
                           "pageable memory is synchronous on CUDA (allocate it page-locked)")
            sync = bool(pageable) or len(host_sides) == 2
            self._seq += 1
            op = _Copy(self._seq, stream, dst, src, dst_buf, src_buf, sync, f"{kind} on {stream.label}",
                       self._label(src, src_buf))
            self._order_pending_readers(op)
            if sync:  # pageable host memory: the stream's work first, then the copy, blocking the caller
                self._count_blocking_wait()
                self._run_until(stream, stream.issued)
                self._append(stream, op)
                self._run_until(stream, stream.issued)
                self._merge_into_thread(stream.seen_compute)
            else:
                _poison(op.dst)
                self._append(stream, op)
                if isinstance(dst_buf, _Param):
                    op.param_key = op.dst_key
                    self._pending_param_copies[op.dst_key] = self._pending_param_copies.get(op.dst_key, 0) + 1
                    self._param_writes[op.dst_key] = self._label(dst, dst_buf)
                    self._arm_check()

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        with self._lock:
            self._settle()
            buf = self._owner(tensor)
            if buf is not None:
                buf.recorded.add((_storage_key(tensor), stream))

    def memory_info(self) -> tuple[int, int]:
        with self._lock:
            self._settle()
            self._count_params()
            total = self.device_memory.total
            return max(0, total - self.device_memory.allocated), total

    def allocator_slack(self) -> int:
        """0: the simulated device has no caching allocator (every byte allocated is counted)."""
        return 0

    def resize_storage(self, tensor: torch.Tensor, nbytes: int) -> None:
        """`tensor.untyped_storage().resize_(nbytes)` on the device (weight-flow's fetch and
        release, as FSDP allocates and frees a parameter): a grown storage is admitted by the
        budget and poisoned (memory nobody wrote); a storage shrunk while a side-stream copy on
        it is pending is an error unless that stream was recorded on it (then, as CUDA's caching
        allocator defers the reuse, the copy runs first)."""
        with self._lock:
            self._settle()
            self._check_thread_device("a storage resize")
            storage = tensor.untyped_storage()
            old, key = storage.nbytes(), _storage_key(tensor)
            self._count_params()  # (what is allocated now, before admitting more)
            if nbytes > old:
                self.device_memory.admit(nbytes - old, f"growing {_describe(tensor, 'a device storage')} to {nbytes} bytes")
            elif nbytes < old:
                self._drain_before_free(tensor, key)
            storage.resize_(nbytes)
            allocation = self._allocations.pop(key, None)
            if allocation is not None:  # rekeyed: the storage's memory moved
                self._live_bytes += nbytes - allocation.nbytes
                allocation.key, allocation.nbytes = _storage_key(tensor), nbytes
                self._allocations[allocation.key] = allocation
            if nbytes > old:
                _poison(_storage_alias(tensor))  # (a fresh alias: the tensor's version is not bumped)
            self._count_params()

    def _drain_before_free(self, tensor: torch.Tensor, key: int) -> None:
        for stream in self._streams[1:]:
            touching = [op for op in stream.pending() if isinstance(op, _Copy) and key in (op.src_key, op.dst_key)]
            if not touching:
                continue
            owner = self._owner(tensor)
            if owner is None or (key, stream) not in owner.recorded:
                self._fail(f"{self._label(tensor, owner)} released (storage resized to 0) while {stream.label} "
                           f"still has a {touching[-1].label} on it and no record_stream(tensor, {stream.label}) "
                           "was called: wait for the copy's event before releasing")
            self._run_until(stream, touching[-1].position + 1)

    # ---------------------------------------------------------------- device memory
    def memory_allocated(self) -> int:
        """Device bytes allocated now: the runtime's buffers and the adopted parameters' storages."""
        with self._lock:
            self._settle()
            self._count_params()
            return self.device_memory.allocated

    def buffer_bytes(self) -> int:
        """Device bytes of the runtime's own allocations (device_empty) only: what an engine holds,
        without the adopted parameters, which belong to the model."""
        with self._lock:
            self._settle()
            return self._live_bytes

    def max_memory_allocated(self) -> int:
        """The peak of memory_allocated() since the start or reset_peak_memory_stats()."""
        with self._lock:
            self._settle()
            self._count_params()
            return self.device_memory.peak

    def reset_peak_memory_stats(self) -> None:
        with self._lock:
            self._settle()
            self._count_params()
            self.device_memory.reset_peak()

    def _count_params(self, admit: bool = False) -> None:
        """Recount the adopted parameters' storages (each once, at its current size; none that
        is a runtime allocation). `admit`: raise torch.OutOfMemoryError if they do not fit."""
        seen, total = set(self._allocations), 0
        for param_buf in list(self._params.values()):
            p = param_buf.ref()
            if p is None:
                continue
            key = _storage_key(p)
            if key and key not in seen:
                seen.add(key)
                total += p.untyped_storage().nbytes()
        if admit and total > self._param_bytes:
            self.device_memory.admit(total - self._param_bytes, "the adopted parameters' storage")
        self._param_bytes = total
        self._count()

    def _count(self) -> None:
        self.device_memory.set_allocated(self._live_bytes + self._param_bytes)

    # ------------------------------------------------------------ test helpers
    def synchronize_all(self) -> None:
        """Run every queue to its end; the calling thread then knows all of it completed."""
        with self._lock:
            self._settle()
            self._count_blocking_wait()
            for stream in list(self._streams[1:]):
                self._run_until(stream, stream.issued)
                self._merge_into_thread(stream.seen_compute)
            everything = SimEvent(self)
            self._record(everything, self.compute, check_device=False)
            self._merge_into_thread(everything.seen_compute)
            self._arm_check()

    def pending_ops(self) -> int:
        with self._lock:
            self._settle()
            return sum(s.issued - s.done for s in self._streams)

    # ------------------------------------------------------ streams and events
    def _record(self, event: SimEvent, stream: Optional[SimStream], check_device: bool = True) -> None:
        with self._lock:
            self._settle()
            if check_device:
                self._check_thread_device("an event record")
            stream = stream or self.current_stream()
            event.stream = stream
            event.device_ms = stream.device_ms
            if stream.is_compute:
                for buf in [*self._allocations.values(), *self._params.values()]:
                    self._scan_writes(buf)
                event.position = 0
                event.seen_compute = self.compute_clock
                self.compute_clock += 1
            else:
                self._merge_thread_into(stream)
                event.position = stream.issued
                event.seen_compute = stream.seen_compute

    def _event_query(self, event: SimEvent) -> bool:
        with self._lock:
            self._settle()
            return event.stream is None or event.stream.done >= event.position

    def _event_synchronize(self, event: SimEvent) -> None:
        with self._lock:
            self._settle()
            if event.stream is None:
                return
            self._count_blocking_wait()
            self._run_until(event.stream, event.position)
            self._merge_into_thread(event.seen_compute)
            self._arm_check()

    def _elapsed_time(self, start: SimEvent, end: SimEvent) -> float:
        if not (start.timing and end.timing):
            raise RuntimeError("elapsed_time: both events must be created with timing=True (CUDA: "
                               "enable_timing=True); create them with runtime.new_event(timing=True).")
        if start.stream is None or end.stream is None:
            raise RuntimeError("elapsed_time: both events must be recorded before calculating elapsed time.")
        if not (self._event_query(start) and self._event_query(end)):
            raise RuntimeError("elapsed_time: both events must be completed before calculating elapsed time "
                               "(synchronize the later one, or wait until query() is True).")
        return end.device_ms - start.device_ms

    def _advance_compute(self, ms: float) -> None:
        with self._lock:
            self.compute.device_ms += ms

    def _stream_synchronize(self, stream: SimStream) -> None:
        with self._lock:
            self._settle()
            self._count_blocking_wait()
            self._run_until(stream, stream.issued)
            self._merge_into_thread(stream.seen_compute)
            self._arm_check()

    def _wait_event(self, waiter: SimStream, event: SimEvent) -> None:
        with self._lock:
            self._settle()
            self._check_thread_device("a stream wait")
            if event.stream is None:
                return
            waiter.device_ms = max(waiter.device_ms, event.device_ms)
            if waiter.is_compute:  # compute is eager: waiting means the producer runs now
                self._run_until(event.stream, event.position)
                self._arm_check()
                return
            self._merge_thread_into(waiter)
            waiter.seen_compute = max(waiter.seen_compute, event.seen_compute)
            other = event.stream
            if not other.is_compute and other is not waiter:
                self._append(waiter, _WaitFor(other, event.position))
                waiter.waited[other] = max(waiter.waited.get(other, 0), event.position)

    def _wait_stream(self, waiter: SimStream, stream: SimStream) -> None:
        with self._lock:
            marker = SimEvent(self)
            self._record(marker, stream)
            self._wait_event(waiter, marker)

    def _append(self, stream: SimStream, op) -> None:
        op.position = stream.issued
        stream.ops.append(op)

    def _run_until(self, stream: SimStream, position: int) -> None:
        while stream.done < position:
            op = stream.ops[stream.done - stream.trimmed]
            stream.done += 1  # first: a wait marker may run a stream that waits back on this one
            if isinstance(op, _WaitFor):
                self._run_until(op.target, op.until)
            else:
                self._run_copy(op)
        if stream.done - stream.trimmed > 256:
            drop = stream.done - stream.trimmed
            del stream.ops[:drop]
            stream.trimmed += drop

    def _run_copy(self, op: _Copy) -> None:
        if op.param_key is not None:
            left = self._pending_param_copies.pop(op.param_key, 1) - 1
            if left:
                self._pending_param_copies[op.param_key] = left
            else:
                self._param_writes.pop(op.param_key, None)
        problems = []
        if not op.sync:  # a synchronous copy has finished before anyone could free its tensors
            problems += self._missing_records(op.uses, op.stream, op.label)
        if not op.use_snapshot and not _same_bytes(op.snapshot, op.src):
            culprit = ("the host wrote it before synchronizing the copy's event" if op.src_host else
                       "the compute stream wrote it without waiting for the copy's event")
            problems.append(f"the source of a {op.label}, {op.src_label}, was written while the copy was "
                            f"in flight: {culprit} (missing synchronisation before the write)")
        op.dst.copy_(op.snapshot if op.use_snapshot else op.src)
        for later in self._pending_copies():
            if later.src_key == op.dst_key and later.seq > op.seq and (
                    not later.use_snapshot or _covers(op.dst, later.src)):
                # It was issued to read what this copy writes. (One whose source is rewritten by
                # work ordered after it, a reused staging buffer, keeps that value: it is all
                # written here, and the rewrite has not run yet.)
                later.snapshot = later.src.clone()
        op.release()
        self._fail(*problems)

    def _order_pending_readers(self, op: _Copy) -> None:
        # A pending copy that reads what `op` will poison keeps its snapshot when it is ordered
        # before `op` (same stream, or op's stream waited past it); otherwise the poison is a race.
        for reader in self._pending_copies():
            if reader.src_key != op.dst_key:
                continue
            if reader.stream is op.stream or op.stream.waited.get(reader.stream, 0) > reader.position:
                reader.use_snapshot = True

    def _pending_copies(self) -> Iterator[_Copy]:
        for stream in self._streams[1:]:
            for op in stream.pending():
                if isinstance(op, _Copy):
                    yield op

    # ------------------------------------------------------------- the checks
    def _check_thread_device(self, what: str) -> None:
        if current_device() != self.index:
            self._fail(f"thread {threading.current_thread().name!r} issues {what} on {self.name} but its "
                       f"current device is sim:{current_device()} (a new thread's current device is device 0, "
                       "as on CUDA; enter the device guard: runtime.thread_device(), or set_device() as "
                       "torch.cuda.set_device)")

    def _check_raw(self, src: torch.Tensor, buf: _DeviceBuffer, stream: SimStream, kind: str) -> None:
        self._scan_writes(buf)
        if buf.last_write > stream.seen_compute:
            self._fail(f"{kind} on {stream.label} reads {self._label(src, buf)} written on the compute stream "
                       "after the last event it waited for (missing wait_stream/wait_event on the compute "
                       "stream)")

    def _check_war(self, dst: torch.Tensor, stream: SimStream, kind: str) -> None:
        key, (start, end) = _storage_key(dst), _byte_span(dst)
        for param_buf in list(self._params.values()):
            p = param_buf.ref()
            if p is None or not p.numel() or _storage_key(p) != key:
                continue
            p_start, p_end = _byte_span(p)
            if p_start < end and start < p_end and param_buf.last_read > stream.seen_compute:
                self._fail(f"{kind} on {stream.label} writes {self._label(p, param_buf)} which a module forward "
                           "read on the compute stream after the last event this stream waited for: a compute "
                           "kernel queued before may still read it: missing fence (wait_event on an event "
                           "recorded on the compute stream after that forward)")

    def _missing_records(self, uses, stream: SimStream, label: str) -> list[str]:
        problems = []
        for buf, key in uses:
            if buf.alloc_stream is not stream and (key, stream) not in buf.recorded and getattr(
                    buf, "records_at_use", True):
                t = buf.ref()
                name = self._label(t, buf) if t is not None else getattr(buf, "label", "a device tensor")
                problems.append(f"{name} used on {stream.label} ({label}) without record_stream: if it were "
                                f"freed or replaced before {stream.label} ran, its memory could be reused")
        return problems

    def _scan_writes(self, buf: _DeviceBuffer) -> None:
        t = buf.ref()
        if t is not None and t._version != buf.seen_version:
            buf.seen_version = t._version
            buf.last_write = self.compute_clock

    def _note_forward(self, module: torch.nn.Module) -> None:
        with self._lock:
            self._arm_check()
            touched = 0
            compiled = isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
            for p in (module.parameters() if compiled else module._parameters.values()):
                buf = self._params.get(id(p)) if p is not None else None
                if buf is not None and buf.ref() is p:
                    buf.last_read = self.compute_clock
                    touched += p.numel() * p.element_size()
            if touched:
                self.compute_clock += 1
                self.compute.device_ms += KERNEL_MS + touched / COMPUTE_BYTES_PER_MS

    def _settle(self) -> None:
        """Handle buffers freed since the last call (finalizers only queue them)."""
        problems = []
        while self._freed:
            record = self._freed.pop(0)
            if isinstance(record, _Pinned):
                if self._pinned.get(record.key) is record:
                    del self._pinned[record.key]
                self.host_memory.free_pinned(record.block)
                continue
            if self._allocations.get(record.key) is record:
                del self._allocations[record.key]
                self._live_bytes -= record.nbytes
                self._count()
            for stream in self._streams:
                if stream is record.alloc_stream or (record.key, stream) in record.recorded:
                    continue
                if any(isinstance(op, _Copy) and record.key in (op.src_key, op.dst_key) for op in stream.pending()):
                    problems.append(f"{record.label} freed while {stream.label} still has work on it and no "
                                    f"record_stream(tensor, {stream.label}) was called")
        self._arm_check()
        self._fail(*problems)

    def _arm_check(self) -> None:
        """On the main thread, outside backward: push the parameter access check while copies
        into parameters are pending, pop it when none are (if it is the innermost mode; else at
        a later call). Autograd restores the mode stack when a backward ends, so the check is
        looked for on the stack, not remembered."""
        if threading.get_ident() != self._main_ident or torch._C._current_graph_task_id() != -1:
            return
        depth = torch._C._len_torch_dispatch_stack()
        on = self._check is not None and any(torch._C._get_dispatch_stack_at(i) is self._check for i in range(depth))
        if self._param_writes and not on:
            self._check = _ParamAccessCheck(self)
            self._check.__enter__()
        elif not self._param_writes and on and torch._C._get_dispatch_stack_at(depth - 1) is self._check:
            self._check.__exit__(None, None, None)
            self._check = None

    # ----------------------------------------------------------------- helpers
    def _owner(self, t: torch.Tensor) -> Optional[_DeviceBuffer]:
        if not t.numel():
            return None
        key = _storage_key(t)
        allocation = self._allocations.get(key)
        if allocation is not None:
            return allocation
        for param_buf in list(self._params.values()):
            p = param_buf.ref()
            if p is not None and p.numel() and _storage_key(p) == key:
                return param_buf
        return None

    def _label(self, t: torch.Tensor, buf: Optional[_DeviceBuffer]) -> str:
        if isinstance(buf, _Param):
            return _describe(t, "parameter (device)")
        if buf is not None:
            return _describe(t, "device tensor")
        return _describe(t, "pinned host buffer" if _storage_key(t) in self._pinned else "pageable host buffer")

    def _merge_thread_into(self, stream: SimStream) -> None:
        stream.seen_compute = max(stream.seen_compute, self._threads.seen_compute)

    def _merge_into_thread(self, seen_compute: int) -> None:
        self._threads.seen_compute = max(self._threads.seen_compute, seen_compute)

    def _fail(self, *messages: str) -> None:
        """Record and raise the first of `messages` (none: nothing to report)."""
        if not messages:
            return
        errors = [SimRaceError(m) for m in messages]
        self.errors.extend(errors)
        raise errors[0]
