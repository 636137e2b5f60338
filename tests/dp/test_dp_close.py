"""A data-parallel optimizer frees everything at close() and when dropped, without the cyclic
garbage collector (engine/dp/route.py's DataParallel holds the parts it uses, never the engine), on two
gloo ranks whose simulated devices are the ranks' own: rank 1 trains on device 1, so every thread
the engine starts (the host worker, whose copy-backs are the all-gathers) must set its device."""

from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch

from _dist import run_ranks
from superoffload_hf.testing.engine_parts import parts

pytestmark = [pytest.mark.sim, pytest.mark.timeout(240)]

CONFIG = {"device_dtype": "fp32", "bucket_size_mb": 0.002, "host_threads": 1, "device_buckets": 1}


def _trained(steps: int = 2):
    from superoffload_hf import SuperOffloadAdamW

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, config=CONFIG)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _held(opt) -> list:
    """Weak references to the engine, its data-parallel part and every buffer they allocated."""
    engine = parts(opt)
    refs = [weakref.ref(engine), weakref.ref(engine.route)]
    refs += [weakref.ref(arena) for arena in engine.buckets.arenas.values()]
    refs += [weakref.ref(t) for pair in engine.route.gather._gather_pairs.values() for t in pair]
    refs += [weakref.ref(slot.buf) for slot in engine.transfer._ring]
    return refs


def _settled(read, seconds: float = 1.0) -> int:
    """`read()` once it is 0, or after `seconds`. A buffer is sometimes still held for a moment
    after close() returns (about 1 run in 20 on 2 cores, gone within 0.2 s: a thread of the engine
    or the simulator letting go of its last job; not yet found), which is not a leak."""
    deadline = time.monotonic() + seconds
    while (value := read()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


def _close_and_drop(rank: int, world: int) -> dict:
    from superoffload_hf.device import SIM_ENV_VAR
    from superoffload_hf.testing.sim import SimRuntime, on_device

    os.environ[SIM_ENV_VAR] = "1"
    SimRuntime.reset_shared(index=rank)  # this rank's device; new threads start on device 0
    sim = SimRuntime.shared()
    facts = {}
    with on_device(rank):  # as torch.cuda.set_device(local_rank) in the training script
        before = sim.buffer_bytes()
        _, opt = _trained()
        assert not parts(opt).route.alone and parts(opt).route.gather._gather_pairs
        ledger, refs = parts(opt).buckets.ledger, _held(opt)[2:]
        gc.collect()
        gc.disable()
        try:
            opt.close()
            facts["closed: ledger bytes"] = _settled(ledger.bytes)
            facts["closed: buffers alive"] = sum(r() is not None for r in refs)
            facts["closed: device bytes held"] = sim.buffer_bytes() - before
            coll = parts(opt).route.coll
            facts["closed: process groups held"] = [name for name, _ in coll.groups()]
            try:
                coll.barrier()  # with its groups gone, group=None would be the default group's
                facts["closed: a collective"] = "ran"
            except RuntimeError as error:
                facts["closed: a collective"] = str(error)
            del opt, coll
            _, opt = _trained()
            ledger, refs = parts(opt).buckets.ledger, _held(opt)
            del opt
            facts["dropped: ledger bytes"] = _settled(ledger.bytes)
            facts["dropped: engine, dp alive"] = [r() is not None for r in refs[:2]]
            facts["dropped: buffers alive"] = sum(r() is not None for r in refs[2:])
            facts["dropped: device bytes held"] = sim.buffer_bytes() - before
        finally:
            gc.enable()
    facts["device"] = sim.name
    facts["simulator errors"] = [str(e) for e in sim.errors]
    SimRuntime.reset_shared()
    return facts


@pytest.fixture(scope="module")
def ranks() -> list:
    return run_ranks(_close_and_drop, 2, deadline_s=200)


def test_a_rank_on_device_1_trains_with_every_engine_thread_on_its_device(ranks):
    assert [facts["device"] for facts in ranks] == ["sim:0", "sim:1"]
    assert [facts["simulator errors"] for facts in ranks] == [[], []]


def test_a_closed_data_parallel_optimizer_frees_its_buffers_without_the_cyclic_collector(ranks):
    for facts in ranks:
        assert facts["closed: ledger bytes"] == 0 and facts["closed: buffers alive"] == 0, facts
        assert facts["closed: device bytes held"] == 0, facts


def test_a_dropped_data_parallel_optimizer_frees_its_engine_and_buffers_without_the_cyclic_collector(ranks):
    for facts in ranks:
        assert facts["dropped: engine, dp alive"] == [False, False], facts
        assert facts["dropped: ledger bytes"] == 0 and facts["dropped: buffers alive"] == 0, facts
        assert facts["dropped: device bytes held"] == 0, facts


def test_a_closed_data_parallel_optimizer_drops_its_process_groups_and_refuses_collectives(ranks):
    """A gloo group's threads end with its last reference (tests/dp/test_process_group_exit.py)."""
    for facts in ranks:
        assert facts["closed: process groups held"] == [], facts
        assert "a collective of a closed optimizer" in facts["closed: a collective"], facts
