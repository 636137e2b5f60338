"""Timeline: the Chrome trace holds the recorded events on the right tracks, in microseconds;
only the chosen steps are kept; the PNG is drawn when matplotlib is installed."""

from __future__ import annotations

import json
import threading

import pytest

from superoffload_hf.perf.timeline import (
    D2H, DEVICE, H2D, HOST_ADAM, REPLAY, ROLLBACK, STEP, VALIDATION, Timeline,
)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _record_step(tl: Timeline, clock: FakeClock, step: int, rollback: bool = False) -> None:
    """One step of 10 ms: backward 0-6 ms in two parts, two buckets through D2H / Adam / H2D,
    the device idle from 6 to 8 ms waiting on the host Adam of bucket 1."""
    base = clock.t
    tl.begin_step(step)
    ms = lambda x: base + x / 1e3  # noqa: E731
    tl.span(DEVICE, "backward", ms(0), ms(3))
    tl.span(DEVICE, "backward", ms(3), ms(6))
    for b, (t0, t1) in enumerate(((3, 4), (6, 7))):
        tl.span(D2H, f"bucket {b}", ms(t0), ms(t0 + 0.5), bucket=b, bytes=1024)
        tl.span(HOST_ADAM, f"bucket {b}", ms(t0 + 0.5), ms(t1 + 0.5), bucket=b, speculative=True)
        tl.span(H2D, f"bucket {b}", ms(t1 + 0.5), ms(t1 + 1.0), bucket=b)
    tl.span(VALIDATION, "norm", ms(7.5), ms(7.6))
    if rollback:
        tl.instant(VALIDATION, ROLLBACK, ms(7.6), buckets=2)
        tl.instant(VALIDATION, REPLAY, ms(7.7), clip=0.5)
    tl.span(DEVICE, "forward", ms(8), ms(10))
    clock.t = ms(10)
    tl.end_step()


def test_trace_holds_the_chosen_steps_on_their_tracks_in_microseconds(tmp_path):
    clock = FakeClock()
    tl = Timeline(tmp_path, steps=(2, 3), clock=clock)
    for step in (1, 2, 3, 4):
        _record_step(tl, clock, step, rollback=(step == 3))
    written = tl.close()
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert written["trace"] == tmp_path / "trace.json"
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names.values()) == {STEP, DEVICE, D2H, HOST_ADAM, H2D, VALIDATION}
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["args"]["step"] for e in spans} == {2, 3}  # steps 1 and 4 were not chosen
    steps = sorted((e for e in spans if names[e["tid"]] == STEP), key=lambda e: e["ts"])
    assert [e["name"] for e in steps] == ["step 2", "step 3"]
    assert steps[0]["ts"] == pytest.approx(0.0) and steps[0]["dur"] == pytest.approx(10_000.0)
    assert steps[1]["ts"] == pytest.approx(10_000.0)
    adam = [e for e in spans if names[e["tid"]] == HOST_ADAM and e["args"]["step"] == 2]
    assert [(e["name"], e["ts"], e["dur"]) for e in adam] == [
        ("bucket 0", pytest.approx(3500.0), pytest.approx(1000.0)), ("bucket 1", pytest.approx(6500.0), pytest.approx(1000.0))]
    assert adam[0]["args"]["bucket"] == 0 and adam[0]["args"]["speculative"] is True
    instants = [e for e in events if e["ph"] == "i"]
    assert [(e["name"], names[e["tid"]], e["args"]["step"]) for e in instants] == [
        (ROLLBACK, VALIDATION, 3), (REPLAY, VALIDATION, 3)]
    assert instants[0]["ts"] == pytest.approx(17_600.0) and instants[0]["s"] == "t"


def test_device_waits_name_what_the_device_waited_for():
    clock = FakeClock()
    tl = Timeline(None, steps=(1,), clock=clock)
    _record_step(tl, clock, 1)
    (wait,) = tl.device_waits()
    assert (wait["end_s"] - wait["start_s"]) == pytest.approx(0.002)
    assert wait["cause"] == HOST_ADAM


def test_work_started_in_a_chosen_step_is_kept_until_the_next_step_begins():
    clock = FakeClock()
    tl = Timeline(None, steps=(1,), clock=clock)
    _record_step(tl, clock, 1)
    end = clock.t
    tl.span(H2D, "late copy-back", end - 0.001, end + 0.002)  # recorded after end_step()
    tl.span(H2D, "next step's copy", end + 0.001, end + 0.002)  # started after the step: dropped
    tl.begin_step(2)
    tl.span(H2D, "step 2", end, end + 0.001)
    assert [e.name for e in tl.events() if e.track == H2D][-1] == "late copy-back"


def test_disabled_and_unchosen_steps_record_nothing():
    tl = Timeline.disabled()
    tl.begin_step(2)
    tl.span(DEVICE, "x", 0.0, 1.0)
    tl.instant(VALIDATION, ROLLBACK, 0.5)
    tl.end_step()
    assert tl.events() == [] and tl.close() == {}
    tl = Timeline(None, steps=(5,))
    tl.begin_step(1)
    tl.span(DEVICE, "x", 0.0, 1.0)
    assert tl.events() == []


def test_spans_from_many_threads_are_all_kept():
    tl = Timeline(None, steps=None)
    tl.begin_step(0)

    def record(k):
        for i in range(500):
            tl.span(HOST_ADAM, f"t{k} {i}", float(i), float(i) + 0.5)

    threads = [threading.Thread(target=record, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tl.end_step()
    assert len([e for e in tl.events() if e.track == HOST_ADAM]) == 2000


def test_a_span_that_ends_before_it_starts_raises():
    tl = Timeline(None, steps=None)
    tl.begin_step(0)
    with pytest.raises(ValueError, match="ends"):
        tl.span(DEVICE, "bad", 2.0, 1.0)


def test_png_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    clock = FakeClock()
    tl = Timeline.from_dir(tmp_path / "tl", steps=(2, 3))
    tl.clock = clock
    for step in (2, 3):
        _record_step(tl, clock, step, rollback=(step == 3))
    written = tl.close()
    png = tmp_path / "tl" / "timeline.png"
    assert written["png"] == png
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
