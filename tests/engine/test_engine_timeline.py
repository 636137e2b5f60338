"""The engine's step timeline and its honest device-idle metric.

The timeline: a run with `timeline_dir` writes a Chrome trace holding, for the chosen steps, one
track each for device compute, device-to-host copies, host Adam, host-to-device copies and
validation, an event per bucket, and rollbacks / replays marked; and a PNG.
Device idle: measured with timing events around each per-bucket wait of a forward, read later
without blocking; on the CPU device (where the training thread is the device) every blocking
wait is device idle.
"""

from __future__ import annotations

import json

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW
from superoffload_hf.engine.observe import StepObserver
from superoffload_hf.metrics import OffloadCounters

from _models import RelativeMaxNorm, engine_config, micro_batches, tiny_llama

pytestmark = [pytest.mark.usefixtures("device_mode"), pytest.mark.timeout(120)]


def _train(tmp_path, steps=4, **config):
    config.setdefault("device_dtype", "bf16")  # fp32 on the CPU: parameters are the masters, no copy-backs
    model, ref = tiny_llama(num_layers=2), tiny_llama(num_layers=2)
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-2, config=engine_config(
        speculation="on", timeline_dir=str(tmp_path / "tl"), timeline_steps=[2, 3], **config))
    with opt:
        for step in range(steps):
            (batch,) = micro_batches(step)
            ref.zero_grad()
            ref(**batch).loss.backward()
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
            opt.max_grad_norm = RelativeMaxNorm(0.9).resolve(norm) if step == 2 else None  # step 3 clips
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                ref.load_state_dict(model.state_dict())
    return opt, tmp_path / "tl"


def test_a_timeline_run_writes_every_track_per_bucket_with_rollbacks_marked(tmp_path):
    opt, directory = _train(tmp_path)
    trace = json.loads((directory / "trace.json").read_text())
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert {"device compute", "device-to-host", "host Adam", "host-to-device", "validation"} <= names
    tid_of = {e["args"]["name"]: e["tid"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    steps = {e["name"] for e in spans if e["tid"] == tid_of["step"]}
    assert steps == {"step 2", "step 3"}
    buckets = {b.index for b in opt.plan.buckets if not b.device_resident}
    host_adam = [e for e in spans if e["tid"] == tid_of["host Adam"]]
    assert {e["args"]["bucket"] for e in host_adam} == buckets  # an event per bucket
    assert {e["args"]["bucket"] for e in spans if e["tid"] == tid_of["device-to-host"]} == buckets
    assert {e["args"]["bucket"] for e in spans if e["tid"] == tid_of["host-to-device"]} == buckets
    assert any(e["name"].startswith("speculative step") for e in host_adam)
    instants = {e["name"] for e in events if e.get("ph") == "i"}
    assert {"rollback", "replay", "commit"} <= instants  # step 3 was clipped: rolled back, replayed
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    png = directory / "timeline.png"
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_without_a_timeline_dir_nothing_is_written(tmp_path):
    model = tiny_llama(num_layers=2)
    with SuperOffloadAdamW(model.parameters(), lr=1e-2, config=engine_config()) as opt:
        model(**micro_batches(0)[0]).loss.backward()
        opt.step()
        assert opt.write_timeline() == {}
    assert not any(tmp_path.iterdir())


class _TimedEvent:
    def __init__(self, log):
        self.log, self.done = log, False

    def record(self, stream=None):
        self.log.append(self)

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return 5.0 if end.done else float("nan")


class _AsyncRuntime:
    is_async = True
    host_is_device = False

    def __init__(self):
        self.recorded = []

    def current_stream(self):
        return None

    def new_event(self, timing=False):
        assert timing
        return _TimedEvent(self.recorded)


class _Decision:
    kind, grad_norm, clip_coef = "commit", 1.0, 1.0


class _Flags:
    rolled_back = replayed = False


def test_device_idle_is_read_from_events_around_each_wait_once_they_completed():
    runtime, counters = _AsyncRuntime(), OffloadCounters()
    observer = StepObserver(runtime, counters)
    waited = []
    observer.around_device_wait(lambda: waited.append(len(runtime.recorded)))
    assert waited == [1] and len(runtime.recorded) == 2  # before the wait, the wait, after it
    observer.thread_waited("norm", 0.0, 0.25)  # a blocking wait of the training thread:
    assert counters.thread_wait_seconds == 0.25 and counters.device_wait_seconds == 0.0  # not device idle
    started = observer.step_begins()
    observer.step_ends(started, _Decision(), _Flags())
    assert counters.device_wait_seconds == 0.0  # not complete yet: carried over, never waited for
    for event in runtime.recorded:
        event.done = True
    started = observer.step_begins()
    observer.step_ends(started, _Decision(), _Flags())
    assert counters.device_wait_seconds == pytest.approx(0.005)


def test_on_the_cpu_device_every_blocking_wait_is_device_idle(device_mode):
    model = tiny_llama(num_layers=2)
    with SuperOffloadAdamW(model.parameters(), lr=1e-2, config=engine_config(speculation="off")) as opt:
        for step in range(3):
            model(**micro_batches(step)[0]).loss.backward()
            opt.step()
            opt.zero_grad()
        c = opt.counters
        if device_mode == "cpu":
            assert c.device_wait_seconds == c.thread_wait_seconds
        else:  # the simulated device's virtual clock: the compute stream's modelled stall, not host time
            assert 0.0 < c.device_wait_seconds < 0.001


# ---- the cost model in the engine ---------------------------------------------------------------


def test_after_the_first_step_the_predicted_step_time_is_reported_beside_the_measured_one():
    model = tiny_llama(num_layers=2)
    with SuperOffloadAdamW(model.parameters(), lr=1e-2, config=engine_config()) as opt:
        for step in range(3):
            model(**micro_batches(step)[0]).loss.backward()
            opt.step()
            opt.zero_grad()
        c = opt.counters
        assert c.predicted_step_seconds > 0 and c.step_seconds > 0


def test_the_workload_is_read_from_the_first_steps_gradient_hooks():
    from superoffload_hf.engine.learn import measured_workload
    from superoffload_hf.engine.measure import FireLog

    log = FireLog(3)
    log.order, log.counts = [2, 1, 0], [1, 1, 1]
    log.first_fired = {2: 10.0, 1: 10.5, 0: 11.0}
    log.first_time, log.last_time = 10.0, 11.0
    work = measured_workload(log, numels=[100, 300, 600], step_seconds=3.0, rollback_rate=0.1)
    assert (work.num_params, work.backward_s, work.forward_s) == (1000, 1.0, 2.0)
    assert work.ready_profile == ((0.6, 0.0), (0.9, 0.5), (1.0, 1.0))


def test_the_cost_models_choice_sets_the_auto_layout_within_the_device_memory_of_the_real_buckets():
    from types import SimpleNamespace

    from superoffload_hf import SuperOffloadConfig
    from superoffload_hf.engine.measure import FireLog
    from superoffload_hf.plan.layout import MachineFacts, decide_layout, device_bucket_bytes

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4000, 1000, 1000, 1000, 1000)]
    config = SuperOffloadConfig(bucket_size_mb="auto")
    layout = decide_layout(params, [{"params": params, "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                     "weight_decay": 0.0}], config, MachineFacts(host_is_device=False))
    log = FireLog(5)
    for index in (4, 3, 2, 1, 0):  # backward order: the big first parameter arrives last
        log.record(index)
    choice = SimpleNamespace(bucket_numel=1000, device_buckets=2)
    plan = layout.learned(config, log, choice, free_device_bytes=4 * 10**9).bucket_plan
    assert plan.bucket_numel == 1000 and plan.num_device_buckets == 2
    assert plan.buckets[-1].numel == 4000  # the last bucket in gradient order holds the big one
    budget = device_bucket_bytes(4000) + device_bucket_bytes(1000) // 2  # room for the big one only
    plan = layout.learned(config, log, choice, free_device_bytes=4 * budget).bucket_plan
    assert plan.num_device_buckets == 1
    assert layout.learned(config, log, None, free_device_bytes=4 * 10**9).bucket_plan.num_device_buckets == 0


def test_on_the_cpu_device_the_timeline_says_why_the_copy_tracks_stay_empty(tmp_path):
    from superoffload_hf.device.cpu import CpuRuntime
    from superoffload_hf.perf.timeline import CPU_EMPTY_NOTES, D2H, H2D

    cpu = StepObserver(CpuRuntime(), OffloadCounters(), tmp_path / "cpu")
    assert cpu.timeline.empty_notes == CPU_EMPTY_NOTES and set(CPU_EMPTY_NOTES) == {D2H, H2D}
    assert StepObserver(_AsyncRuntime(), OffloadCounters(), tmp_path / "async").timeline.empty_notes == {}


def test_byte_counts_added_from_several_threads_at_once_end_at_the_exact_total():
    # the training thread (fetches, gradient copies) and the host worker (copy-backs) both add to
    # bytes_h2d/bytes_d2h; a short switch interval makes the threads interleave as often as they can
    import sys
    import threading

    counters, per_thread, threads = OffloadCounters(), 20000, 4
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def work():
            for _ in range(per_thread):
                counters.add("bytes_h2d", 3)
                counters.add("bytes_d2h", 1)
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert (counters.bytes_h2d, counters.bytes_d2h) == (3 * per_thread * threads, per_thread * threads)
