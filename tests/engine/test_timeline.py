"""Timeline: the Chrome trace holds the recorded events on the right tracks, in microseconds;
only the chosen steps are kept; the PNG is drawn when matplotlib is installed."""

from __future__ import annotations

import json
import threading

import pytest

from superoffload_hf.perf.timeline import (
    COMMIT, CPU_EMPTY_NOTES, D2H, DEVICE, H2D, HOST_ADAM, REPLAY, ROLLBACK, STEP, TRACKS, VALIDATION, Timeline,
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


def _crowded_cpu_steps(tl: Timeline, clock: FakeClock) -> None:
    """What a CPU run records: no copies, host Adam inline, and the marks and the device's idle
    gaps of different causes all within a fraction of a millisecond of each other."""
    for step in (2, 3):
        base = clock.t
        ms = lambda x: base + x / 1e3  # noqa: E731
        tl.begin_step(step)
        tl.span(DEVICE, "forward + backward", ms(0), ms(50))
        tl.span(HOST_ADAM, "step b1", ms(50.0), ms(50.2), bucket=1)
        tl.span(VALIDATION, "step(): commit", ms(50.2), ms(50.3))
        tl.instant(VALIDATION, ROLLBACK, ms(50.25))
        tl.instant(VALIDATION, REPLAY, ms(50.26))
        tl.instant(VALIDATION, COMMIT, ms(50.3))
        tl.span(DEVICE, "forward", ms(50.4), ms(70))
        tl.span(VALIDATION, "norms", ms(70.0), ms(70.3))
        tl.span(DEVICE, "forward", ms(70.3), ms(70.5))
        tl.span(DEVICE, "backward", ms(70.6), ms(100))  # a gap with nothing recorded in it
        clock.t = ms(100)
        tl.end_step()


def test_png_captions_never_overlap_and_empty_tracks_say_they_are_empty_and_why(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    clock = FakeClock()
    tl = Timeline.from_dir(tmp_path / "tl", steps=(2, 3), empty_notes=CPU_EMPTY_NOTES)
    tl.clock = clock
    _crowded_cpu_steps(tl, clock)
    assert {w["cause"] for w in tl.device_waits()} == {HOST_ADAM, VALIDATION, "nothing recorded"}
    fig = tl.figure()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    # Tick labels exist for ticks beyond the axis limits too; only those inside are drawn.
    hidden = {id(tick.label1) for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim()))
              for tick in axis.get_major_ticks() if not min(lo, hi) <= tick.get_loc() <= max(lo, hi)}
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    whole = fig.bbox
    for k, (text, box) in enumerate(boxes):
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1, text
        for other, other_box in boxes[k + 1:]:
            assert not box.overlaps(other_box), (text, other)
    shown = [text for text, _ in boxes]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        "step", "device compute", "device-to-host (empty)", "host Adam", "host-to-device (empty)", "validation"]
    assert f"empty: {CPU_EMPTY_NOTES[D2H]}" in shown and f"empty: {CPU_EMPTY_NOTES[H2D]}" in shown
    assert {"rollback (2)", "replay (2)", "commit (2)"} <= set(shown)
    assert any(text.startswith(f"device idle, waiting for {HOST_ADAM}: 2x") for text in shown), shown
    assert "superoffload step timeline, steps 2, 3" in shown
    plt.close(fig)
    assert tl.close()["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_empty_track_without_a_note_says_nothing_was_recorded():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    clock = FakeClock()
    tl = Timeline(None, steps=(2,), clock=clock)
    tl.begin_step(2)
    tl.span(DEVICE, "backward", 100.0, 100.001)
    tl.end_step()
    fig = tl.figure()
    notes = [t.get_text() for t in fig.axes[0].texts]
    assert notes == ["empty: nothing was recorded on this track"] * (len(TRACKS) - 2)  # all but step and device
    plt.close(fig)
