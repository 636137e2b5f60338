"""Moving bucket data between the device and the host, written once over the runtime seam.

Gradients go device->host on a side stream `d2h`, into host buffers (page-locked on an
accelerator); parameters come back host->device on a side stream `h2d`; each copy is marked by
an event. The host waits on one event (`wait_host`), the compute stream waits on one event
(`wait_device`); nothing here synchronizes the whole device. On the CPU runtime every stream and
event is a no-op and the copies run at once.

Device buffers, all sized by `reserve()` to the largest host bucket, allocated once (at first
use) and reused:
* the gradient ring: GRAD_RING_SLOTS flat buffers in the link dtype that backward writes a
  bucket's gradient round into (`grad_slot`) and d2h reads. Before backward writes a slot
  again, the compute stream waits (on the device) for the copy that last read it: the
  backpressure that bounds the gradient copies in flight, and their device memory, by the ring.
* the copy-back staging buffer, one per dtype: every copy-back goes through it, in h2d order.

Every synchronisation is named (`SYNCS`). `omitted` removes some of them: only the mutation
tests set it, to show that the simulated device catches the race each one prevents.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

SYNCS = (
    "d2h_waits_compute",   # the gradient copy starts after the kernels that produced it
    "grad_record_stream",  # a gradient ring slot freed (reserve, close) while d2h reads it is not reused
    "compute_waits_d2h_slot",  # backward writes a ring slot only after the d2h copy that last read it
    "d2h_event",           # the host knows when the gradient has landed
    "host_waits_d2h",      # the worker reads the landed gradient only after that event
    "host_waits_h2d",      # the worker writes master/lowp only after their last copy-back ran
    "fence",               # copy-backs wait for kernels queued before step() (they read old weights)
    "param_record_stream",  # a parameter freed or replaced while h2d writes it is not reused
    "h2d_event",           # the compute stream knows when a copy-back has landed
    "device_waits_h2d",    # a forward reads a bucket's parameters only after its copy-back
    "thread_device",       # the worker thread issues its copies on the parameters' device
)

# Weight-flow's (engine/flow.py): its fetches and releases of the units' device weights.
FLOW_SYNCS = (
    "device_waits_fetch",   # a unit's forward / backward reads its weights only after their fetch
    "fetch_waits_release",  # a fetch (reusing released memory) starts after the released weights' readers
    "host_waits_fetch",     # the worker writes master/lowp only after the last fetch that reads them
)

# Gradient rounds in flight at once: two for double buffering (backward fills one slot while d2h
# reads the other) and a third for a round held open across a backward (a tied or reused
# parameter's bucket) or a copy slower than one bucket's backward. Configuration-free: more slots
# cost device memory (each is a largest host bucket in the link dtype) and buy no overlap once
# the link keeps up; fewer would serialize backward with the copies.
GRAD_RING_SLOTS = 3


@dataclass(eq=False)
class _RingSlot:
    buf: torch.Tensor
    done: Any = None  # event recorded on d2h after the last copy that read `buf`
    held: bool = True  # a bucket's open round writes it


class Transfer:
    def __init__(self, runtime, pin_memory: bool, omitted: Sequence[str] = (), grad_slots: int = GRAD_RING_SLOTS):
        unknown = sorted(set(omitted) - set(SYNCS) - set(FLOW_SYNCS))
        if unknown:
            raise ValueError(f"Unknown synchronisation(s) {unknown}; the seam has {list(SYNCS + FLOW_SYNCS)}.")
        self.runtime = runtime
        self.pin_memory = pin_memory and runtime.is_async
        self.omitted = frozenset(omitted)
        self.d2h = runtime.new_stream()
        self.h2d = runtime.new_stream()
        self._fence = None  # see fence()
        self.slot_numel = 0  # the largest host bucket of the plan (reserve())
        self._staging: dict[torch.dtype, torch.Tensor] = {}  # copy-back staging, one per dtype, on h2d
        self.grad_slots = grad_slots
        self._ring: list[_RingSlot] = []
        self._free: deque[_RingSlot] = deque()  # released slots, least recently released first

    @property
    def is_async(self) -> bool:
        return self.runtime.is_async

    def _keeps(self, sync: str) -> bool:
        return sync not in self.omitted

    def reserve(self, slot_numel: int) -> None:
        """Between steps, for a new plan (no round open, nothing in flight that the caller has not
        waited for): `slot_numel` elements (the largest host bucket) size the gradient ring slots
        and the copy-back staging buffers, each allocated once, at its first use, and reused by
        every round and copy-back after. Dropping the old ones is safe: each staging buffer was
        allocated on h2d, which alone uses it, and each ring slot is recorded on d2h."""
        if slot_numel != self.slot_numel:
            self.slot_numel = slot_numel
            self._staging = {}
            self._ring, self._free = [], deque()

    @property
    def ring_slots(self) -> int:
        """Gradient ring slots allocated (GRAD_RING_SLOTS, more only while rounds held open
        exceeded it: every slot held, none to wait for; back to GRAD_RING_SLOTS as they close)."""
        return len(self._ring)

    def grad_slot(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Training thread, before backward writes a bucket's gradient round: a ring slot (its
        first `numel` elements), held until grad_to_host() or release_grad_slot()."""
        if numel > self.slot_numel:
            raise ValueError(f"A gradient round of {numel} elements does not fit the ring's slots of "
                             f"{self.slot_numel}: reserve() the largest host bucket first.")
        rt = self.runtime
        if len(self._ring) < self.grad_slots or not self._free:
            # Allocated on the compute stream, which writes it; every slot is held only when more
            # rounds are open than the ring has slots: then the ring grows (bounded by the buckets).
            slot = _RingSlot(rt.device_empty(self.slot_numel, dtype))
            if self._keeps("grad_record_stream"):  # d2h reads it: freeing it waits for d2h's work
                rt.record_stream(slot.buf, self.d2h)
            self._ring.append(slot)
            return slot.buf[:numel]
        slot = self._free.popleft()
        if slot.buf.dtype != dtype:
            raise ValueError(f"The gradient ring holds {slot.buf.dtype}, not {dtype}: reserve() between them.")
        if slot.done is not None and self._keeps("compute_waits_d2h_slot"):
            # Backpressure: backward's next writes into this slot wait (on the device, the host
            # goes on) for the d2h copy that last read it.
            rt.current_stream().wait_event(slot.done)
        slot.held = True
        return slot.buf[:numel]

    def release_grad_slot(self, grad_dev: torch.Tensor) -> None:
        """Training thread: a round dropped without a copy (zero_grad() before step())."""
        slot = self._slot_of(grad_dev)
        if slot is not None:
            self._release(slot)

    def _release(self, slot: _RingSlot) -> None:
        """A slot no round holds: back to the ring, or freed where the ring grew past its size
        (rounds held open beyond it), so that it shrinks back once they close. Freeing is safe:
        the slot is recorded on d2h, the one other stream that uses it."""
        slot.held = False
        if len(self._ring) > self.grad_slots:
            self._ring.remove(slot)
        else:
            self._free.append(slot)

    def _slot_of(self, grad_dev: torch.Tensor) -> Optional[_RingSlot]:
        ptr = grad_dev.untyped_storage().data_ptr()
        for slot in self._ring:
            if slot.held and slot.buf.untyped_storage().data_ptr() == ptr:
                return slot
        return None

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.runtime.host_empty(numel, dtype, pinned=self.pin_memory)

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.runtime.device_empty(numel, dtype)

    def grad_to_host(self, grad_dev: torch.Tensor, grad_host: torch.Tensor):
        """Training thread. Copies a gradient round (a ring slot from grad_slot(), released here)
        to the host; returns the event that marks `grad_host` as landed."""
        rt = self.runtime
        slot = self._slot_of(grad_dev)
        if self._keeps("d2h_waits_compute"):  # grad_dev is written by kernels queued on compute
            self.d2h.wait_stream(rt.current_stream())
        with rt.on_stream(self.d2h):
            rt.copy_(grad_host, grad_dev)
            done = rt.new_event()
            if self._keeps("d2h_event"):
                done.record(self.d2h)
            if slot is not None:  # the next round in this slot waits for this copy (grad_slot)
                slot.done = rt.new_event()
                slot.done.record(self.d2h)
        if slot is not None:
            self._release(slot)
        return done

    def params_to_device(self, src_host: torch.Tensor, params: Sequence[torch.Tensor],
                         offsets: Sequence[int]):
        """Worker thread. Copies `src_host[offset:offset+numel]` into each parameter (casting on
        the device); returns the event the next forward waits on. The host must not modify
        src_host before that event (`wait_host`): the copy reads it when it runs.

        Ordering: the worker calls this only after it waited for the bucket's gradients to land,
        and the gradient copy waited for the compute stream, so every kernel of this backward
        that reads these parameters has run; `fence` covers kernels queued since."""
        rt = self.runtime
        guard = rt.thread_device() if self._keeps("thread_device") else _no_guard()
        with torch.no_grad(), guard, rt.on_stream(self.h2d):
            if self._fence is not None and self._keeps("fence"):
                self.h2d.wait_event(self._fence)
            staged_dev = self._staging_on_h2d(src_host.numel(), src_host.dtype)
            # No wait before overwriting it: every copy-back runs on this one h2d stream, so this
            # copy starts only after the previous copy-back's reads of the buffer have run.
            rt.copy_(staged_dev, src_host)
            for p, offset in zip(params, offsets):
                # through .data: the engine's own write leaves p's version to step() (waits.py)
                rt.copy_(p.data, staged_dev[offset:offset + p.numel()].view(p.shape))  # casts
                if self._keeps("param_record_stream"):  # p may be freed or replaced (model.to())
                    rt.record_stream(p.detach(), self.h2d)  # before the next forward waits
            done = rt.new_event()
            if self._keeps("h2d_event"):
                done.record(self.h2d)
        return done

    def _staging_on_h2d(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The caller is on h2d: the staging buffer of `dtype` (allocated there, on first use)."""
        staged = self._staging.get(dtype)
        if staged is None or staged.numel() < numel:  # only a caller that did not reserve() grows it
            staged = self._staging[dtype] = self.runtime.device_empty(max(numel, self.slot_numel), dtype)
        return staged[:numel]

    def fence(self) -> None:
        """Training thread, at step(), before the step's host jobs are queued: their copy-backs
        run after every kernel queued so far on the compute stream. (The worker's wait on a
        bucket's d2h event covers only kernels queued before that bucket's gradients left; a
        forward run between backward and step() is queued later and reads the old weights.)"""
        if not self.is_async:
            return
        event = self.runtime.new_event()
        event.record(self.runtime.current_stream())
        self._fence = event  # read by the worker thread in params_to_device

    def wait_host(self, event) -> None:
        """Block the calling thread until `event` (None: nothing) has completed."""
        if event is not None and self._keeps("host_waits_d2h"):
            with self.runtime.thread_device():
                event.synchronize()

    def wait_host_before_write(self, event, sync: str = "host_waits_h2d") -> None:
        """Worker: the last copy-back of a bucket (`event`; weight-flow: its last fetch, sync
        "host_waits_fetch") reads master/lowp: wait before writing."""
        if event is not None and self._keeps(sync):
            with self.runtime.thread_device():
                event.synchronize()

    def wait_device(self, event) -> None:
        """The compute stream waits (queued, not blocking) for `event` (None: nothing)."""
        if event is not None and self._keeps("device_waits_h2d"):
            self.runtime.current_stream().wait_event(event)

    def measure_h2d_gbps(self, megabytes: float = 64, repeats: int = 3) -> float:
        """Host-to-device bandwidth from a page-locked buffer, in GB/s (a one-off measurement,
        between steps, on the h2d stream the copy-backs use). Timed by device events on an
        asynchronous device (the host clock would time the issue), by the host clock otherwise."""
        rt = self.runtime
        src = rt.host_empty(int(megabytes * 2**20), torch.uint8, pinned=True)
        with rt.on_stream(self.h2d):
            dst = rt.device_empty(src.numel(), torch.uint8)  # allocated on h2d: used only there
            rt.copy_(dst, src)  # warm-up
            start_event, end_event = rt.new_event(timing=True), rt.new_event(timing=True)
            start_event.record(self.h2d)
            start = time.perf_counter()
            for _ in range(repeats):
                rt.copy_(dst, src)
            end_event.record(self.h2d)
            self._drain(end_event)
        seconds = start_event.elapsed_time(end_event) / 1000.0 if self.is_async else time.perf_counter() - start
        gbps = src.numel() * repeats / max(seconds, 1e-9) / 1e9
        del src, dst
        rt.host_empty_cache()  # the host allocator would keep the probe's page-locked block forever
        return gbps

    def _drain(self, done) -> None:
        # Blocks the host: elapsed_time needs completed events (and the host clock, finished copies).
        done.synchronize()


class _no_guard:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> Optional[bool]:
        return None
