"""The host worker: one Python thread that runs bucket jobs (the host Adam kernel releases the
GIL, so it overlaps the training thread's backward).

An exception in a job is captured; every later call from the training thread (`submit`,
`wait`, `raise_if_failed`) re-raises it, and the worker drops the remaining jobs, so a failure
surfaces as an exception in the training loop instead of a hang. The thread holds no reference
to the engine; `stop()` (called by close() and by a weakref.finalize) ends it.

`InlineWorker` is the host worker of the CPU device: there a host job could only compete for the
cores that backward itself uses (measured on 2 cores: a speculative step overlapped with backward
slowed it by twice the step's own time), so each job runs when it is submitted, on the calling
thread, with the same failure semantics.

The worker thread's torch ops run with one intra-op thread: each OS thread that issues an OpenMP
parallel region gets its own team of `torch.get_num_threads()` threads, so torch ops here (the
simulated device's copies, fills, `equal`) made a second team spinning beside the training
thread's and the kernel's own pool (measured: 242 parallel regions from this thread in 5 steps).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional

import torch

POLL_SECONDS = 0.05


class Pending:
    """Count of one bucket's queued jobs; `idle` is set when none is left."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = 0
        self.idle = threading.Event()
        self.idle.set()

    def add(self) -> None:
        with self._lock:
            self._count += 1
            self.idle.clear()

    def done(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0:
                self.idle.set()


class _Failure:
    error: Optional[BaseException] = None


def one_intra_op_thread() -> None:
    """Make torch's ops on the calling thread run without an OpenMP team of their own, leaving
    every other thread's count, and the default a new thread starts with, as they were."""
    default = torch.get_num_threads()  # this thread's lazy init first: it would undo what follows
    torch.set_num_threads(1)  # this thread's team size; as a side effect also the process default:
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="superoffload-threads")
    restore.start()  # restored from a thread of its own (the call sets its caller's count too)
    restore.join()


def _run(jobs: "queue.SimpleQueue", failure: _Failure) -> None:
    try:
        one_intra_op_thread()
    except BaseException as error:  # every job is then dropped and the training thread raises
        failure.error = error
    while True:
        item = jobs.get()
        if item is None:
            return
        fn, pending = item
        item = None
        try:
            if failure.error is None:
                fn()
        except BaseException as error:  # surfaced in the training thread
            failure.error = error
        finally:
            # before done(): a job's arguments (views of a bucket's host arenas) must not outlive
            # it while this thread waits for the next one, or a re-plan cannot free them
            fn = None
            pending.done()


class HostWorker:
    def __init__(self, name: str = "superoffload-host"):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._failure = _Failure()
        self._thread = threading.Thread(target=_run, args=(self._jobs, self._failure), name=name, daemon=True)
        self._thread.start()

    @property
    def failure(self) -> Optional[BaseException]:
        return self._failure.error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], None], pending: Pending) -> None:
        self.raise_if_failed()
        if not self.alive:
            raise RuntimeError("The SuperOffload host worker is stopped (the optimizer was closed); build a new optimizer.")
        pending.add()
        self._jobs.put((fn, pending))

    def wait(self, event: threading.Event) -> float:
        """Block until `event` is set (or the worker failed: raise). Returns seconds waited."""
        start = time.perf_counter()
        while not event.wait(POLL_SECONDS):
            self.raise_if_failed()
        self.raise_if_failed()
        return time.perf_counter() - start

    def raise_if_failed(self) -> None:
        error = self._failure.error
        if error is not None:
            raise RuntimeError(
                f"The SuperOffload host worker failed: {type(error).__name__}: {error}. The "
                "optimizer state may be inconsistent; build a new optimizer (e.g. from the last "
                "checkpoint)."
            ) from error

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            if threading.current_thread() is not self._thread:  # a finalizer may run on it
                self._thread.join(timeout)


class InlineWorker:
    """HostWorker's interface; `submit` runs the job at once (see the module docstring)."""

    def __init__(self):
        self._failure = _Failure()
        self.alive = True

    @property
    def failure(self) -> Optional[BaseException]:
        return self._failure.error

    def submit(self, fn: Callable[[], None], pending: Pending) -> None:
        self.raise_if_failed()
        if not self.alive:
            raise RuntimeError("The SuperOffload host worker is stopped (the optimizer was closed); build a new optimizer.")
        pending.add()
        try:
            fn()
        except BaseException as error:  # as in the thread: recorded, then raised here and later
            self._failure.error = error
            if isinstance(error, KeyboardInterrupt):
                raise  # Ctrl-C on the training thread: the caller reports it as such; the worker stays failed
        finally:
            pending.done()
        self.raise_if_failed()

    def wait(self, event: threading.Event) -> float:
        self.raise_if_failed()
        if not event.is_set():  # every job has run by the time submit() returned
            raise RuntimeError("SuperOffload waited for host work that was never submitted: a bug in "
                               "superoffload_hf; please report it with the traceback.")
        return 0.0

    raise_if_failed = HostWorker.raise_if_failed

    def stop(self, timeout: float = 30.0) -> None:
        self.alive = False
