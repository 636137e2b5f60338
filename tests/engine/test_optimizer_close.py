"""close() and dropping the optimizer free everything at once, without the cyclic garbage
collector: the engine's parts hold the collaborators they use, never the engine (a part holding
the engine is a reference cycle that keeps a dropped optimizer's arenas alive until gc runs)."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.device import make_runtime

from _models import one_torch_thread  # noqa: F401
from superoffload_hf.testing.engine_parts import parts, engine_ref

pytestmark = [pytest.mark.usefixtures("device_mode", "one_torch_thread"), pytest.mark.timeout(300)]

CONFIG = {"device_dtype": "fp32", "bucket_size_mb": 0.002, "host_threads": 1, "device_buckets": 1}


@contextlib.contextmanager
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def mlp(seed: int = 0) -> torch.nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                   torch.nn.GELU(), torch.nn.Linear(32, 8))


def loss_of(model, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def trained(config=CONFIG, steps: int = 2):
    model = mlp()
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0, config=config)
    for step in range(steps):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def buffer_refs(opt) -> list:
    """Weak references to every buffer the optimizer allocated: arenas, device buffers, ring."""
    engine = parts(opt)
    refs = [weakref.ref(arena) for arena in engine.buckets.arenas.values()]
    for rt in engine.buckets.runtimes:
        refs += [weakref.ref(t) for t in (rt.bufs.master, rt.bufs.exp_avg, rt.bufs.exp_avg_sq) if t is not None]
    refs += [weakref.ref(slot.buf) for slot in engine.transfer._ring]
    return refs


def device_live_bytes() -> int:
    """The simulated device's buffers (not the model's parameters, which it counts as well)."""
    return make_runtime(torch.device("cpu")).buffer_bytes()


def test_close_frees_every_buffer_while_the_optimizer_is_still_held():
    model, opt = trained()
    ledger, refs = parts(opt).buckets.ledger, buffer_refs(opt)
    assert ledger.bytes() > 0 and len(refs) > 3
    with no_cyclic_gc():
        opt.close()
        assert ledger.bytes() == 0, dict(ledger.live)
        assert [r for r in refs if r() is not None] == []
        assert parts(opt).transfer.ring_slots == 0


def test_a_dropped_optimizer_frees_its_buffers_without_the_cyclic_collector(device_mode):
    before = device_live_bytes() if device_mode == "sim" else 0
    model, opt = trained()
    ledger, refs, engine = parts(opt).buckets.ledger, buffer_refs(opt), engine_ref(opt)
    with no_cyclic_gc():
        del opt
        assert engine() is None
        assert ledger.bytes() == 0, dict(ledger.live)
        assert [r for r in refs if r() is not None] == []
        if device_mode == "sim":  # the simulated device's own count: the ring and staging too
            assert device_live_bytes() == before


def test_the_model_keeps_its_trained_weights_after_close(device_mode):
    """close() right after step() (copy-backs in flight on an asynchronous device): the removed
    hooks no longer order the next use of the weights after them, so close() does."""
    config = dict(CONFIG, device_buckets=0)
    want_model, want_opt = trained(config, steps=3)
    want_opt.synchronize()
    want = [p.detach().clone() for p in want_model.parameters()]
    want_opt.close()
    model, opt = trained(config, steps=3)
    opt.close()
    out = model(torch.ones(2, 16))  # a forward on the compute stream, nothing waits for the buckets
    assert torch.isfinite(out).all()
    for got, expected in zip(model.parameters(), want):
        torch.testing.assert_close(got.detach(), expected, rtol=0, atol=0)


def test_stepping_a_closed_optimizer_raises_naming_the_fix():
    model, opt = trained()
    opt.close()
    loss_of(model, 3).backward()
    with pytest.raises(RuntimeError, match="was closed .* Build a new optimizer"):
        opt.step()
    with pytest.raises(RuntimeError, match="was closed"):
        opt.state_dict()


def test_close_from_another_thread_or_a_finalizer_holds_the_device(device_mode):
    """close() runs wherever the last reference goes (a finalizer, a closer thread), and that
    thread starts on device 0 (on the simulated device the parameters are on device 1): close()
    sets the device itself before it waits for the copy-backs in flight."""
    model, opt = trained(dict(CONFIG, device_buckets=0))
    errors = []

    def close():
        try:
            opt.close()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    closer = threading.Thread(target=close, name="closer")
    closer.start()
    closer.join(60)
    assert not closer.is_alive() and errors == []
    assert all(torch.isfinite(p).all() for p in model.parameters())
