"""The simulated asynchronous device (superoffload_hf.testing.sim): each rule of its CUDA model
fails when the synchronisation it stands for is missing, and passes when it is present."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from superoffload_hf.device.transfer import SYNCS, Transfer
from superoffload_hf.testing import SimRaceError, SimRuntime
from superoffload_hf.testing.sim import current_device, on_device, set_device

pytestmark = pytest.mark.sim


@pytest.fixture
def rt():
    runtime = SimRuntime()
    yield runtime
    runtime.close()


def filled(rt, values, pinned=True):
    host = rt.host_empty(len(values), torch.float32, pinned=pinned)
    host.copy_(torch.tensor(values, dtype=torch.float32))
    return host


def device_on(rt, stream, numel, dtype=torch.float32):
    """A device buffer allocated on `stream` (used there, it needs no record_stream)."""
    with rt.on_stream(stream):
        return rt.device_empty(numel, dtype)


def in_thread(fn):
    """Run fn in a new thread; re-raise what it raised."""
    caught = []

    def body():
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            caught.append(error)

    worker = threading.Thread(target=body, name="sim-test-worker")
    worker.start()
    worker.join()
    if caught:
        raise caught[0]


def test_side_stream_copy_poisons_destination_until_event_synchronize(rt):
    h2d, done = rt.new_stream(), rt.new_event()
    src, dst = filled(rt, [1.0, 2.0, 3.0]), device_on(rt, h2d, 3)
    with rt.on_stream(h2d):
        rt.copy_(dst, src)
        done.record()
    assert torch.isnan(dst).all()
    assert rt.pending_ops() == 1
    done.synchronize()
    assert dst.tolist() == [1.0, 2.0, 3.0]
    assert rt.pending_ops() == 0


def test_compute_wait_event_runs_the_producer(rt):
    h2d, done = rt.new_stream(), rt.new_event()
    src, dst = filled(rt, [4.0, 5.0]), device_on(rt, h2d, 2)
    with rt.on_stream(h2d):
        rt.copy_(dst, src)
    done.record(h2d)
    assert torch.isnan(dst * 2).all()  # a kernel that did not wait reads the poison
    rt.current_stream().wait_event(done)
    assert (dst * 2).tolist() == [8.0, 10.0]


def test_integer_destination_gets_poison_bytes(rt):
    src = rt.host_empty(4, torch.int32, pinned=True)
    src.copy_(torch.arange(4, dtype=torch.int32))
    stream = rt.new_stream()
    dst = device_on(rt, stream, 4, torch.int32)
    with rt.on_stream(stream):
        rt.copy_(dst, src)
    assert (dst.view(torch.uint8) == 0xA5).all()
    rt.synchronize_all()
    assert dst.tolist() == [0, 1, 2, 3]


def test_event_query_does_not_run_work(rt):
    stream, done = rt.new_stream(), rt.new_event()
    dst = device_on(rt, stream, 2)
    with rt.on_stream(stream):
        rt.copy_(dst, filled(rt, [1.0, 1.0]))
        done.record()
    assert done.query() is False
    assert done.query() is False and torch.isnan(dst).all()
    assert stream.query() is False
    done.synchronize()
    assert done.query() is True and stream.query() is True


def test_unrecorded_event_is_complete(rt):
    event = rt.new_event()
    assert event.query() is True
    event.synchronize()
    rt.current_stream().wait_event(event)
    rt.new_stream().wait_event(event)
    assert rt.pending_ops() == 0


def test_recording_again_moves_the_event(rt):
    stream, event = rt.new_stream(), rt.new_event()
    first, second = device_on(rt, stream, 1), device_on(rt, stream, 1)
    with rt.on_stream(stream):
        rt.copy_(first, filled(rt, [1.0]))
        event.record()
        rt.copy_(second, filled(rt, [2.0]))
    event.synchronize()
    assert first.item() == 1.0 and torch.isnan(second).all()
    event.record(stream)
    assert event.query() is False
    event.synchronize()
    assert second.item() == 2.0


def test_side_stream_waiting_on_another_side_streams_event(rt):
    a, b = rt.new_stream(), rt.new_stream()
    staged, host_out = device_on(rt, a, 2), rt.host_empty(2, torch.float32, pinned=True)
    produced, consumed = rt.new_event(), rt.new_event()
    with rt.on_stream(a):
        rt.copy_(staged, filled(rt, [6.0, 7.0]))
        produced.record()
    b.wait_event(produced)
    rt.record_stream(staged, b)
    with rt.on_stream(b):
        rt.copy_(host_out, staged)
        consumed.record()
    assert produced.query() is False  # the wait is queued on b, not run
    consumed.synchronize()  # runs b, whose wait marker runs a first
    assert host_out.tolist() == [6.0, 7.0]
    assert produced.query() is True


def test_side_stream_not_waiting_reads_poison(rt):
    a, b = rt.new_stream(), rt.new_stream()
    staged, host_out = device_on(rt, a, 2), rt.host_empty(2, torch.float32, pinned=True)
    with rt.on_stream(a):
        rt.copy_(staged, filled(rt, [6.0, 7.0]))
    rt.record_stream(staged, b)
    consumed = rt.new_event()
    with rt.on_stream(b):
        rt.copy_(host_out, staged)
        consumed.record()
    consumed.synchronize()
    assert torch.isnan(host_out).all()


def test_pageable_host_side_makes_the_copy_synchronous(rt):
    stream = rt.new_stream()
    earlier, dst = device_on(rt, stream, 1), device_on(rt, stream, 2)
    with rt.on_stream(stream):
        rt.copy_(earlier, filled(rt, [9.0]))  # pinned: queued
        assert rt.pending_ops() == 1
        rt.copy_(dst, filled(rt, [1.0, 2.0], pinned=False))
    assert rt.pending_ops() == 0
    assert earlier.item() == 9.0 and dst.tolist() == [1.0, 2.0]


def test_host_source_written_while_copy_in_flight(rt):
    master = filled(rt, [1.0, 2.0, 3.0, 4.0])
    stream, done = rt.new_stream(), rt.new_event()
    dst = device_on(rt, stream, 4)
    with rt.on_stream(stream):
        rt.copy_(dst, master)
        done.record()
    master.add_(1.0)  # the optimizer writes the master copy before the copy-back ran
    with pytest.raises(SimRaceError) as raised:
        done.synchronize()
    message = str(raised.value)
    assert "pinned host buffer (4,) float32" in message and "side stream 1" in message
    assert "synchronizing the copy's event" in message
    assert rt.errors == [raised.value]


def test_host_source_written_after_event_synchronize_is_fine(rt):
    master = filled(rt, [1.0, 2.0])
    stream, done = rt.new_stream(), rt.new_event()
    dst = device_on(rt, stream, 2)
    with rt.on_stream(stream):
        rt.copy_(dst, master)
        done.record()
    done.synchronize()
    master.add_(1.0)
    assert dst.tolist() == [1.0, 2.0] and not rt.errors


def test_later_copy_reading_an_earlier_copys_destination(rt):
    stream = rt.new_stream()
    staged, out = device_on(rt, stream, 3), rt.host_empty(3, torch.float32, pinned=True)
    with rt.on_stream(stream):
        rt.copy_(staged, filled(rt, [1.0, 2.0, 3.0]))
        rt.copy_(out, staged)
    rt.synchronize_all()
    assert out.tolist() == [1.0, 2.0, 3.0] and not rt.errors


@pytest.mark.parametrize("waits", [True, False])
def test_raw_side_stream_reads_a_compute_write(rt, waits):
    grad = rt.device_empty(3, torch.float32)
    grad.copy_(torch.tensor([1.0, 2.0, 3.0]))  # a kernel on the compute stream
    d2h, host = rt.new_stream(), rt.host_empty(3, torch.float32, pinned=True)
    rt.record_stream(grad, d2h)
    if waits:
        d2h.wait_stream(rt.current_stream())
    with rt.on_stream(d2h):
        if not waits:
            with pytest.raises(SimRaceError, match="missing wait_stream/wait_event on the compute stream"):
                rt.copy_(host, grad)
            return
        rt.copy_(host, grad)
    rt.synchronize_all()
    assert host.tolist() == [1.0, 2.0, 3.0]


def test_raw_write_after_the_wait_is_caught(rt):
    grad = rt.device_empty(2, torch.float32)
    grad.zero_()
    d2h = rt.new_stream()
    d2h.wait_stream(rt.current_stream())
    grad.add_(1.0)  # written after the event the stream waited for
    with rt.on_stream(d2h), pytest.raises(SimRaceError, match="written on the compute stream"):
        rt.copy_(rt.host_empty(2, torch.float32, pinned=True), grad)


def test_compute_write_while_device_source_in_flight(rt):
    grad = rt.device_empty(2, torch.float32)
    grad.zero_()
    d2h, done = rt.new_stream(), rt.new_event()
    d2h.wait_stream(rt.current_stream())
    rt.record_stream(grad, d2h)
    with rt.on_stream(d2h):
        rt.copy_(rt.host_empty(2, torch.float32, pinned=True), grad)
        done.record()
    grad.fill_(5.0)  # the next backward reuses the buffer before the copy ran
    with pytest.raises(SimRaceError, match="compute stream wrote it without waiting"):
        done.synchronize()


def _forward_then_h2d(rt, fence_kind):
    model = torch.nn.Linear(2, 2)
    rt.adopt(model.parameters())
    weight = model.weight
    model(torch.ones(1, 2))  # reads weight on the compute stream
    h2d = rt.new_stream()
    if fence_kind == "fence":
        fence = rt.new_event()
        fence.record(rt.current_stream())
        h2d.wait_event(fence)
    elif fence_kind == "transitive":  # the host learned of it through a d2h stream's event
        d2h, landed = rt.new_stream(), rt.new_event()
        d2h.wait_stream(rt.current_stream())
        landed.record(d2h)
        landed.synchronize()
    rt.record_stream(weight.detach(), h2d)
    with rt.on_stream(h2d):
        rt.copy_(weight.detach(), filled(rt, [1.0, 2.0, 3.0, 4.0]).view(2, 2))
    rt.synchronize_all()
    return weight


@pytest.mark.parametrize("fence_kind", ["fence", "transitive"])
def test_war_write_after_a_fence_passes(rt, fence_kind):
    weight = _forward_then_h2d(rt, fence_kind)
    assert weight.detach().flatten().tolist() == [1.0, 2.0, 3.0, 4.0]


def test_war_write_without_fence_fails(rt):
    with pytest.raises(SimRaceError, match="missing fence") as raised:
        _forward_then_h2d(rt, None)
    assert "parameter (device) (2, 2) float32" in str(raised.value)


def test_war_event_recorded_before_the_forward_is_not_a_fence(rt):
    model = torch.nn.Linear(2, 2)
    rt.adopt(model.parameters())
    early = rt.new_event()
    early.record(rt.current_stream())
    model(torch.ones(1, 2))
    h2d = rt.new_stream()
    h2d.wait_event(early)
    with rt.on_stream(h2d), pytest.raises(SimRaceError, match="missing fence"):
        rt.copy_(model.bias.detach(), filled(rt, [1.0, 2.0]))


@pytest.mark.parametrize("recorded", [True, False])
def test_record_stream_for_cross_stream_use(rt, recorded):
    grad = rt.device_empty(2, torch.float32)  # allocated on the compute stream
    grad.fill_(3.0)
    d2h, done = rt.new_stream(), rt.new_event()
    d2h.wait_stream(rt.current_stream())
    host = rt.host_empty(2, torch.float32, pinned=True)
    with rt.on_stream(d2h):
        rt.copy_(host, grad)
        if recorded:
            rt.record_stream(grad, d2h)
        done.record()
    if recorded:
        done.synchronize()
        assert host.tolist() == [3.0, 3.0]
    else:
        with pytest.raises(SimRaceError, match="without record_stream"):
            done.synchronize()


def test_use_on_the_allocation_stream_needs_no_record_stream(rt):
    h2d = rt.new_stream()
    with rt.on_stream(h2d):
        staged = rt.device_empty(2, torch.float32)  # allocated on h2d
        rt.copy_(staged, filled(rt, [1.0, 2.0]))
        del staged  # freed with work pending on its own stream: the allocator handles that
        gc.collect()
    rt.synchronize_all()
    assert not rt.errors


@pytest.mark.parametrize("recorded", [True, False])
def test_freeing_a_buffer_with_pending_cross_stream_work(rt, recorded):
    grad = rt.device_empty(2, torch.float32)
    grad.fill_(1.0)
    d2h = rt.new_stream()
    d2h.wait_stream(rt.current_stream())
    host = rt.host_empty(2, torch.float32, pinned=True)
    with rt.on_stream(d2h):
        rt.copy_(host, grad)
    if recorded:
        rt.record_stream(grad, d2h)
    del grad
    gc.collect()
    if recorded:
        rt.synchronize_all()
        assert host.tolist() == [1.0, 1.0]
    else:
        with pytest.raises(SimRaceError, match="freed while side stream 1 still has work on it"):
            rt.memory_info()  # the next call of any kind reports it


def test_current_stream_is_per_thread(rt):
    side = rt.new_stream()
    seen = {}
    with rt.on_stream(side):
        in_thread(lambda: seen.update(worker=rt.current_stream()))
        assert rt.current_stream() is side
    assert seen["worker"] is rt.compute and rt.current_stream() is rt.compute

    def worker_sets_its_own():
        with rt.on_stream(side):
            seen["inside"] = rt.current_stream()
        seen["after"] = rt.current_stream()

    in_thread(worker_sets_its_own)
    assert seen["inside"] is side and seen["after"] is rt.compute
    assert rt.current_stream() is rt.compute


@pytest.fixture
def rank_rt():
    """A rank's device that is not device 0, current in the test's (main) thread as
    torch.cuda.set_device(local_rank) makes it."""
    runtime = SimRuntime(index=1)
    with on_device(1):
        yield runtime
    runtime.close()


@pytest.mark.parametrize("guarded", [True, False])
def test_worker_thread_needs_the_device_guard(rank_rt, guarded):
    rt = rank_rt
    stream = rt.new_stream()
    dst = device_on(rt, stream, 1)
    src = filled(rt, [1.0])

    def work():
        with rt.thread_device() if guarded else _nothing(), rt.on_stream(stream):
            rt.copy_(dst, src)

    if guarded:
        in_thread(work)
        rt.synchronize_all()
        assert dst.item() == 1.0
    else:
        with pytest.raises(SimRaceError, match="issues a copy on sim:1 but its current device is sim:0"):
            in_thread(work)


def test_a_new_thread_starts_on_device_0_whatever_its_creator_had_current():
    seen = []
    with on_device(3):
        assert current_device() == 3
        in_thread(lambda: seen.append(current_device()))
    assert seen == [0] and current_device() == 0


@pytest.mark.parametrize("what", ["allocation", "new stream", "event record", "stream wait", "copy"])
def test_work_for_a_device_issued_from_a_thread_on_another_device_fails_naming_both(rank_rt, what):
    rt = rank_rt
    stream, event = rt.new_stream(), rt.new_event()
    dst, src = device_on(rt, stream, 1), filled(rt, [1.0])

    def copy():
        with rt.on_stream(stream):
            rt.copy_(dst, src)

    issue = {"allocation": lambda: rt.device_empty(4, torch.float32), "new stream": rt.new_stream,
             "event record": lambda: event.record(stream), "stream wait": lambda: stream.wait_event(event),
             "copy": copy}[what]
    with pytest.raises(SimRaceError, match=f"issues an? {what} on sim:1 but its current device is sim:0"):
        in_thread(issue)
    errors = len(rt.errors)  # the same call from a thread holding the device: fine

    def guarded():
        with rt.thread_device():
            issue()

    in_thread(guarded)
    assert len(rt.errors) == errors


def test_on_device_0_a_new_thread_needs_no_guard_as_on_cuda(rt):
    stream = rt.new_stream()
    dst, src = device_on(rt, stream, 1), filled(rt, [2.0])

    def work():
        with rt.on_stream(stream):
            rt.copy_(dst, src)

    in_thread(work)
    rt.synchronize_all()
    assert dst.item() == 2.0 and not rt.errors


def test_the_device_index_is_checked():
    with pytest.raises(ValueError, match="index=-1"):
        SimRuntime(index=-1)
    assert SimRuntime(index=2).name == "sim:2"


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_shared_is_one_instance_per_process():
    SimRuntime.reset_shared()
    try:
        first = SimRuntime.shared()
        assert SimRuntime.shared() is first
        got = []
        in_thread(lambda: got.append(SimRuntime.shared()))
        assert got == [first] and first._main_ident == threading.main_thread().ident
        SimRuntime.reset_shared()
        assert SimRuntime.shared() is not first
    finally:
        SimRuntime.reset_shared()


def test_memory_info_counts_live_device_buffers(rt):
    free, total = rt.memory_info()
    assert free == total == 80 * 2**30
    a = rt.device_empty(1024, torch.float32)
    b = rt.device_empty(10, torch.bfloat16)
    rt.host_empty(4096, torch.float32, pinned=True)  # host memory is not the device's
    assert rt.memory_info() == (total - 4096 - 20, total)
    del a
    gc.collect()
    assert rt.memory_info() == (total - 20, total)
    del b


def _copy_into_weight_after_the_forward(rt):
    """A forward reads the weight; a fenced side-stream copy into the weight is then issued and
    not waited for: anything the compute stream runs next that touches the weight races it."""
    model = torch.nn.Linear(3, 2)
    rt.adopt(list(model.parameters()))
    out = model(torch.ones(1, 3, requires_grad=True))  # its backward reads the weight (input's grad)
    h2d, fence = rt.new_stream(), rt.new_event()
    fence.record()
    h2d.wait_event(fence)  # ordered after the forward's reads (no WAR against the forward)
    with rt.on_stream(h2d):
        rt.copy_(model.weight.detach(), filled(rt, [0.5] * 6).view(2, 3))
        rt.record_stream(model.weight.detach(), h2d)
    return model, out


def test_a_backward_reading_a_parameter_while_a_copy_into_it_is_pending_is_an_error_naming_the_op(rt):
    """The backward runs on the autograd device thread, where the main thread's dispatch-mode
    check is not on the stack (modes are per thread): the backward's own mode checks it."""
    model, out = _copy_into_weight_after_the_forward(rt)
    with pytest.raises(SimRaceError, match=r"aten\.\w+\.default in a backward on the autograd device thread "
                                           r"reads or writes parameter \(device\) \(2, 3\)"):
        out.sum().backward()


def test_a_backward_after_the_compute_stream_waited_for_the_copy_is_fine(rt):
    model, out = _copy_into_weight_after_the_forward(rt)
    rt.synchronize_all()
    out.sum().backward()
    assert model.weight.grad is not None and not rt.errors


def test_interface_basics(rt):
    assert rt.name == "sim:0" and rt.device == torch.device("cpu") and rt.is_async
    assert rt.new_stream() is not rt.new_stream()
    assert torch.isnan(rt.device_empty(3, torch.float32)).all()  # never-written memory is poison


# ---------------------------------------------------------------- Transfer over the simulator

def _transfer_round(omitted=(), optimizer_first=False, reuse_slot=False):
    """One bucket through Transfer as the engine drives it: backward writes the gradient into a
    ring slot on the compute stream, d2h to the host, a forward before step(), fence, the
    worker's copy-back, the compute stream waits for it and reads the parameters, the worker's
    next optimizer write (`optimizer_first`: that write comes before the compute stream waits).
    `reuse_slot`: backward writes the next round into the same slot (a ring of one) before the
    worker has waited for the first copy.
    Returns (the landed gradient, the parameters the compute stream reads). The device is a
    rank's device 1 (current in this thread; the worker threads start on device 0)."""
    rt = SimRuntime(index=1)
    previous = current_device()
    set_device(1)
    try:
        model = torch.nn.Linear(3, 2)
        params = list(model.parameters())
        rt.adopt(params)
        tr = Transfer(rt, pin_memory=True, omitted=omitted, grad_slots=1)
        numel = sum(p.numel() for p in params)
        tr.reserve(numel)
        offsets = [0, params[0].numel()]
        grad_dev = tr.grad_slot(numel, torch.float32)
        grad_dev.copy_(torch.arange(numel, dtype=torch.float32))  # backward
        grad_host = tr.host_empty(numel, torch.float32)
        landed = tr.grad_to_host(grad_dev, grad_host)
        del grad_dev  # the engine drops its view of the slot here
        if reuse_slot:
            tr.grad_slot(numel, torch.float32).fill_(-1.0)  # the next round's backward
        model(torch.ones(1, 3))  # between backward and step(): reads the old weights
        tr.fence()
        master = tr.host_empty(numel, torch.float32)
        master.fill_(1.0)
        out = {}

        def optimizer_step():
            tr.wait_host(landed)
            out["grad"] = grad_host.clone()
            master.sub_(0.5 * grad_host)
            out["event"] = tr.params_to_device(master, params, offsets)

        def next_optimizer_write():
            tr.wait_host_before_write(out["event"])
            master.fill_(-1.0)

        in_thread(optimizer_step)
        if optimizer_first:
            in_thread(next_optimizer_write)
        tr.wait_device(out["event"])
        read = torch.cat([p.detach().reshape(-1) for p in params]).clone()  # the next forward
        if not optimizer_first:
            in_thread(next_optimizer_write)
        return out["grad"], read
    finally:
        set_device(previous)
        rt.close()


SCHEDULES = [dict(optimizer_first=False), dict(optimizer_first=True), dict(reuse_slot=True)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=["forward_first", "optimizer_first", "reuse_slot"])
def test_transfer_in_the_engine_order_gives_exact_values(schedule):
    grad, params = _transfer_round(**schedule)
    expected_grad = torch.arange(grad.numel(), dtype=torch.float32)
    assert torch.equal(grad, expected_grad)
    assert torch.equal(params, 1.0 - 0.5 * expected_grad)


def test_copy_backs_issued_back_to_back_share_one_staging_buffer(rt):
    """The second copy-back overwrites the staging buffer before the first one has run (the
    simulator runs h2d lazily): the h2d stream orders them, so each parameter still gets its own
    source, and the buffer is allocated once."""
    model_a, model_b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    params_a, params_b = list(model_a.parameters()), list(model_b.parameters())
    rt.adopt(params_a + params_b)
    tr = Transfer(rt, pin_memory=True)
    tr.reserve(8)
    allocations, device_empty = [], rt.device_empty
    rt.device_empty = lambda numel, dtype: allocations.append(numel) or device_empty(numel, dtype)
    src_a, src_b = filled(rt, [float(i) for i in range(8)]), filled(rt, [-float(i) for i in range(8)])
    events = []

    def copy_backs():
        events.append(tr.params_to_device(src_a, params_a, [0, 6]))
        events.append(tr.params_to_device(src_b, params_b, [0, 6]))

    in_thread(copy_backs)
    assert rt.pending_ops() > 0  # nothing has run yet
    for event in events:
        tr.wait_device(event)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params_a]), src_a)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in params_b]), src_b)
    assert allocations == [8] and not rt.errors


# What catches each omitted synchronisation: a SimRaceError saying this, or NaN poison read.
CAUGHT_BY = {
    "d2h_waits_compute": "missing wait_stream/wait_event on the compute stream",
    "grad_record_stream": "without record_stream",
    "compute_waits_d2h_slot": "the compute stream wrote it without waiting for the copy's event",
    "d2h_event": "nan",
    "host_waits_d2h": "nan",
    "host_waits_h2d": "written while the copy was in flight",
    "fence": "missing fence",
    "param_record_stream": "without record_stream",
    "h2d_event": "while a side-stream copy into it is pending",
    "device_waits_h2d": "nan",
    "thread_device": "enter the device guard",
}


def _caught(sync, schedule):
    """'nan', the SimRaceError's message, or None when the round gave exact values."""
    try:
        grad, params = _transfer_round(omitted=(sync,), **schedule)
    except SimRaceError as error:
        return str(error)
    return "nan" if torch.isnan(grad).any() or torch.isnan(params).any() else None


@pytest.mark.parametrize("sync", SYNCS)
def test_each_omitted_transfer_sync_is_caught(sync):
    expected = CAUGHT_BY.get(sync, "")
    outcomes = [_caught(sync, schedule) for schedule in SCHEDULES]
    assert any(o is not None and expected in o for o in outcomes), f"omitting {sync}: {outcomes}"


def test_count_host_reads_counts_each_read_of_device_data_a_backward_included_and_not_pinned_host_buffers():
    sim = SimRuntime()

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            grad.tolist()  # a read no torch-function mode sees (autograd runs backward without them)
            return grad * 2

    t = torch.tensor([0.0, 1.0, 2.0])
    pinned = sim.host_empty(3, torch.float32, pinned=True).fill_(1.0)
    try:
        with sim.count_host_reads() as reads:
            bool(t[1]), t[2].item(), t.tolist(), t.nonzero(), torch.nonzero(t), int(t[1])
            pinned.tolist(), bool(pinned[0])  # host memory: no synchronisation
            x = torch.ones(2, requires_grad=True)
            ReadsInBackward.apply(x).sum().backward()
        assert reads == {"__bool__": 1, "item": 1, "tolist": 2, "nonzero": 2, "__int__": 1}, reads
        t.tolist()
        assert reads["tolist"] == 2 and "tolist" not in vars(torch.Tensor)  # put back: inherited again
    finally:
        sim.close()
