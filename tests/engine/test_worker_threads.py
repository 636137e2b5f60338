"""The host worker thread runs torch ops without an OpenMP team of its own (issue 18: each OS
thread that issues a parallel region gets a team of `torch.get_num_threads()` threads, which
spin beside the training thread's team and the kernel's pool), and changes no other thread's
count nor the default that a new thread starts with."""

from __future__ import annotations

import threading

import pytest
import torch

from superoffload_hf.engine.step.worker import HostWorker, Pending


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # > 1 even on a 1-core runner, so that 1 is a change
    yield
    torch.set_num_threads(before)


def threads_seen_by_a_new_thread() -> int:
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


def test_host_worker_thread_runs_torch_ops_with_one_intra_op_thread(two_torch_threads):
    worker = HostWorker(name="test-host-worker")
    seen, pending = [], Pending()
    try:
        worker.submit(lambda: seen.append((torch.get_num_threads(), float(torch.ones(64).sum()))), pending)
        worker.wait(pending.idle)
    finally:
        worker.stop()
    assert seen == [(1, 64.0)]
    assert torch.get_num_threads() == 2  # the training thread keeps its team
    assert threads_seen_by_a_new_thread() == 2  # and so does the process default
