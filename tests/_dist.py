"""Run a function on N local processes (gloo over a FileStore), with a deadline: a hang fails the
test instead of blocking the suite. Each rank's return value comes back (pickled); an exception on
any rank fails the test with that rank's traceback. Each rank records the collectives it issues
(superoffload_hf.testing.collective_order) and the ranks' records are compared: one communicator's
collectives in one sequence, and two communicators' interleaved in one order, on every rank (NCCL
hangs otherwise; gloo does not, so this is how a CPU test sees it)."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

DEFAULT_DEADLINE_S = 90.0


# What the fork server imports once, for every rank of every multi-rank file of the run: without it
# each rank imported torch (~1.5 s on 2 cores), superoffload_hf (~0.5 s) and, for the
# sequence-parallel ranks' Llama, transformers (~5 s). Modules only: none reads the environment
# at import, starts a thread or loads the C++ kernel (each rank loads it: its thread pool is the
# rank's own). (Python 3.11's fork server does not take the caller's sys.path: the tests' own
# modules, tests/_*.py, are not importable there; each rank imports them.)
PRELOAD = ["torch", "torch.distributed", "superoffload_hf.optimizer", "superoffload_hf.engine.dp.route",
           "superoffload_hf.engine.dp.checkpoint", "superoffload_hf.parallel",
           "superoffload_hf.device.collectives", "superoffload_hf.testing.collective_order",
           "transformers.models.llama.modeling_llama"]


def _rank_context():
    """Ranks are forked from one fork server per test run, started by the first call with PRELOAD
    imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank: int, world: int, store: str, out_dir: str, fn: Callable, args: tuple, env: dict,
           record: bool) -> None:
    # The caller's environment as it is now (the fork server's is from when it started); torch
    # was imported before it, so a variable torch reads at import is the fork server's.
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    from superoffload_hf.testing import collective_order

    torch.set_num_threads(1)
    result: Any
    recorder = collective_order.install() if record else None
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        try:
            result = ("ok", fn(rank, world, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    if recorder is not None:
        recorder.uninstall()
        result = (*result, list(recorder.events))
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn: Callable, world: int, *args, deadline_s: float = DEFAULT_DEADLINE_S,
              env: dict | None = None, check_order: bool = True) -> list:
    """fn(rank, world, *args) on `world` processes forked from the fork server; the list of their
    return values. `check_order`: fail when the ranks' collectives differ in order (module docstring)."""
    ctx = _rank_context()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
        procs = [ctx.Process(target=_entry, args=(r, world, store, tmp, fn, args, env, check_order), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        end = time.monotonic() + deadline_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results = []
        for r in range(world):
            path = Path(tmp, f"rank{r}.pkl")
            results.append(pickle.loads(path.read_bytes()) if path.exists() else ("missing", None))
    errors = [f"rank {r}:\n{value}" for r, (kind, value, *_) in enumerate(results) if kind == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    if hung:
        raise AssertionError(f"ranks {hung} of {world} did not finish within {deadline_s:.0f}s (a hang)")
    missing = [r for r, (kind, *_) in enumerate(results) if kind != "ok"]
    if missing:
        raise AssertionError(f"ranks {missing} exited without a result (exit codes "
                             f"{[p.exitcode for p in procs]})")
    if check_order:
        from superoffload_hf.testing.collective_order import compare

        problem = compare([events for _, _, events in results])
        if problem:
            raise AssertionError(f"the ranks' collectives: {problem}")
    return [value for _, value, *_ in results]


def free_port() -> int:
    """A port no one listens on now (pid-derived ports collided between concurrent test runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
