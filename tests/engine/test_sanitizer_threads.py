"""The CUDA stream sanitizer (torch.cuda._sanitizer) fed from two threads: the training thread and
the engine's host worker, which enters the sanitizer's dispatch mode (device/accelerator.py). Its
CUDA callbacks cannot run here, but its event handler is Python: these tests drive it as torch
does (the handler's kernel launch as its dispatch mode calls it, the gpu_trace callbacks as the
CUDA runtime fires them) on the CPU, with a schedule that interleaves the two threads."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import superoffload_hf.device.accelerator as accelerator

COMPUTE, H2D = 11, 22  # the training thread's stream and the worker's (stream ids)
READY = 33  # an event (id)
WRITTEN, STAGING = 1000, 2000  # data pointers


@pytest.fixture
def sanitizer(monkeypatch):
    """A fresh, enabled sanitizer as torch's `cuda_sanitizer`, its callbacks in gpu_trace
    registries that the test restores (its mode is not entered in this thread: no CUDA here)."""
    import torch.cuda._gpu_trace as gpu_trace
    from torch._utils import CallbackRegistry
    from torch.cuda import _sanitizer as csan

    for registry in vars(gpu_trace).values():
        if isinstance(registry, CallbackRegistry):
            monkeypatch.setattr(registry, "callback_list", [])
    fresh = csan.CUDASanitizer()
    fresh.enabled = True
    monkeypatch.setattr(csan, "cuda_sanitizer", fresh)
    yield fresh
    fresh.enabled = False  # (its __del__ would exit a mode never entered)


def _launch(handler, stream: int, reads=(), writes=()):
    """A kernel on `stream`, as the sanitizer's dispatch mode reports it: the races it finds."""
    ptrs = set(reads) | set(writes)
    return handler._handle_kernel_launch(stream, set(reads) - set(writes), set(writes), set(writes), "kernel",
                                         {p: [] for p in ptrs})


def _in_accelerator(thread: threading.Thread) -> bool:
    """Whether `thread` is executing device/accelerator.py (where a serialized entry waits)."""
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and frame.f_code.co_filename == accelerator.__file__


def test_two_threads_feeding_the_sanitizer_keep_one_state_and_a_synchronised_read_is_not_reported(sanitizer,
                                                                                                    monkeypatch):
    """The training thread writes a buffer on the compute stream and records an event; the worker,
    told through the host, waits for that event on its stream and reads the buffer: correct.
    Meanwhile the worker launched a copy of its own while the training thread's launch was
    inside the handler. Unserialized, the worker's launch lands between the handler's steps: the
    training thread's write is recorded with the worker's sequence number, later than what the
    event carries, and the synchronised read is reported as a race."""
    import torch.cuda._gpu_trace as gpu_trace

    handler = sanitizer.dispatch.event_handler
    ready, go, fed, recorded = (threading.Event() for _ in range(4))
    found: dict[str, list] = {}

    def worker():
        with accelerator._sanitizer_in_this_thread():  # as the engine's worker, in thread_device()
            ready.set()
            go.wait()
            found["worker copy"] = _launch(handler, H2D, writes=[STAGING])
            fed.set()
            recorded.wait()
            gpu_trace.EventWaitCallbacks.fire_callbacks(READY, H2D)
            found["worker read"] = _launch(handler, H2D, reads=[WRITTEN])

    thread = threading.Thread(target=worker)
    thread.start()
    ready.wait()
    for stream in (COMPUTE, H2D):
        gpu_trace.StreamCreationCallbacks.fire_callbacks(stream)
    gpu_trace.EventCreationCallbacks.fire_callbacks(READY)

    update_seq_num = handler.syncs.update_seq_num

    def paused_once(stream, seq_num):
        # the training thread's launch, inside the handler: the worker launches now; wait until it
        # has, or until it waits to enter the handler (serialized), whichever comes
        if threading.current_thread() is threading.main_thread() and not go.is_set():
            go.set()
            while thread.is_alive() and not fed.is_set() and not _in_accelerator(thread):
                time.sleep(0.001)
        return update_seq_num(stream, seq_num)

    monkeypatch.setattr(handler.syncs, "update_seq_num", paused_once)
    found["training write"] = _launch(handler, COMPUTE, writes=[WRITTEN])
    gpu_trace.EventRecordCallbacks.fire_callbacks(READY, COMPUTE)
    recorded.set()
    thread.join()

    assert found == {"training write": [], "worker copy": [], "worker read": []}, {
        k: [str(e) for e in v] for k, v in found.items()}
    write = handler.tensors_accessed.get_write(WRITTEN)
    assert write.stream == COMPUTE and write.seq_num == handler.syncs.current_sync_states[COMPUTE][COMPUTE]


def test_every_entry_into_the_handler_is_serialized_once_and_the_main_thread_enters_no_mode(sanitizer):
    import torch.cuda._gpu_trace as gpu_trace
    from torch._utils import CallbackRegistry

    handler = sanitizer.dispatch.event_handler
    assert isinstance(accelerator._sanitizer_in_this_thread(), type(accelerator.contextlib.nullcontext()))
    accelerator.serialize_sanitizer(sanitizer)  # a second time: nothing wrapped twice
    callbacks = [cb for r in vars(gpu_trace).values() if isinstance(r, CallbackRegistry) for cb in r.callback_list]
    assert len(callbacks) == 10
    for handle in callbacks + [handler._handle_kernel_launch]:
        assert handle.__code__.co_filename == accelerator.__file__, handle
        assert handle.__wrapped__.__self__ is handler and not hasattr(handle.__wrapped__, "__wrapped__")


def test_a_disabled_sanitizer_is_left_alone(sanitizer):
    sanitizer.enabled = False
    handler = sanitizer.dispatch.event_handler
    with accelerator._sanitizer_in_this_thread():
        pass
    assert "_handle_kernel_launch" not in vars(handler)
    import torch.cuda._gpu_trace as gpu_trace

    assert gpu_trace.EventRecordCallbacks.callback_list == [handler._handle_event_record]


def test_looking_for_the_sanitizer_leaves_it_unimported_so_torchs_gpu_trace_stays_off():
    """Importing torch.cuda._sanitizer turns on torch's gpu trace for the process (every CUDA
    allocation, free and event then calls into its Python handler): a worker entering the device
    without TORCH_CUDA_SANITIZER must not import it."""
    code = ("import sys, threading\n"
            "import superoffload_hf.device.accelerator as accelerator\n"
            "def worker():\n"
            "    with accelerator._sanitizer_in_this_thread():\n"
            "        pass\n"
            "thread = threading.Thread(target=worker)\n"
            "thread.start()\n"
            "thread.join()\n"
            "print('torch.cuda._sanitizer' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_SANITIZER"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
