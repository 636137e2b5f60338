"""Timeline: what the device, the links and the host did during a few chosen steps, written as a
Chrome trace (DIR/trace.json: open it in https://ui.perfetto.dev or chrome://tracing) and drawn
as a picture (DIR/timeline.png, with the optional `matplotlib`: `pip install superoffload_hf[timeline]`).

    timeline = Timeline.from_dir("out/timeline", steps=(2, 3))
    timeline.begin_step(step)                   # the training loop, once per optimizer step
    timeline.span(DEVICE, "backward", t0, t1)   # any thread: seconds of time.perf_counter()
    timeline.span(HOST_ADAM, "bucket 7", t0, t1, bucket=7, speculative=True)
    timeline.instant(VALIDATION, ROLLBACK, t, buckets=3)
    timeline.end_step()
    timeline.close()                            # writes trace.json and timeline.png

Recording costs one attribute test per call outside the chosen steps (and nothing at all with
`Timeline.disabled()`). Work that starts during a chosen step but is recorded after `end_step()`
(a copy-back that finishes during the next forward) is kept until the next `begin_step()`.
Thread-safe: the worker and copy threads record while the training thread does.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Union

DEVICE = "device compute"
D2H = "device-to-host"
HOST_ADAM = "host Adam"
H2D = "host-to-device"
VALIDATION = "validation"
STEP = "step"
TRACKS = (STEP, DEVICE, D2H, HOST_ADAM, H2D, VALIDATION)
"""Tracks in display order; other names are allowed and are shown after these."""
ROLLBACK, REPLAY, SKIP, COMMIT = "rollback", "replay", "skip", "commit"
"""Names of the validation instants the engine marks."""
CPU_EMPTY_NOTES = {
    D2H: "the device is the CPU, backward's gradients are read where they are",
    H2D: "the device is the CPU, the parameters are updated in place",
}
"""Why the copy tracks stay empty when the CPU is the device (engine/observe.py passes them)."""

TRACE_FILE, PNG_FILE = "trace.json", "timeline.png"
_PID = 1


@dataclass(frozen=True)
class Event:
    track: str
    name: str
    start_s: float
    end_s: Optional[float]  # None: an instant
    step: Optional[int]
    args: dict = field(default_factory=dict)


class Timeline:
    def __init__(self, directory: Union[str, Path, None] = None, steps: Optional[Iterable[int]] = (2, 3),
                 enabled: bool = True, clock=time.perf_counter, empty_notes: Optional[dict] = None):
        """`steps`: the optimizer steps to record (None: every step). `directory`: where
        `close()` writes; None: only `write(directory)` writes. `empty_notes`: track -> why it
        may stay empty (the picture says so when it does)."""
        self.empty_notes = dict(empty_notes or {})
        self.directory = Path(directory) if directory is not None else None
        self.steps = None if steps is None else frozenset(int(s) for s in steps)
        self.enabled = enabled
        self.clock = clock
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._windows: list[tuple[int, float, float]] = []  # (step, start, end) of recorded steps
        self._recording = False  # inside a chosen step
        self._tail_end: Optional[float] = None  # after a chosen step: keep work that started before this
        self._step: Optional[int] = None
        self._step_start = 0.0

    @classmethod
    def from_dir(cls, directory: Union[str, Path], steps: Optional[Iterable[int]] = (2, 3),
                 empty_notes: Optional[dict] = None) -> "Timeline":
        """A recorder that writes DIR/trace.json and DIR/timeline.png on `close()`."""
        return cls(directory, steps, empty_notes=empty_notes)

    @classmethod
    def disabled(cls) -> "Timeline":
        return cls(None, steps=(), enabled=False)

    # ---- recording (any thread) -----------------------------------------------------------

    def now(self) -> float:
        return self.clock()

    @property
    def recording(self) -> bool:
        return self.enabled and self._recording

    def begin_step(self, step: int) -> None:
        if not self.enabled:
            return
        self._recording = self.steps is None or step in self.steps
        self._tail_end = None
        self._step, self._step_start = step, self.clock()

    def end_step(self) -> None:
        if not self.recording:
            return
        end = self.clock()
        with self._lock:
            self._windows.append((self._step, self._step_start, end))
            self._events.append(Event(STEP, f"step {self._step}", self._step_start, end, self._step))
        self._recording, self._tail_end = False, end

    def span(self, track: str, name: str, start_s: float, end_s: float, **args) -> None:
        """Something that ran on `track` from `start_s` to `end_s` (clock seconds)."""
        if not self._keeps(start_s):
            return
        if end_s < start_s:
            raise ValueError(f"span {name!r} on {track!r} ends ({end_s}) before it starts ({start_s}).")
        with self._lock:
            self._events.append(Event(track, name, float(start_s), float(end_s), self._step, args))

    def instant(self, track: str, name: str, t_s: float, **args) -> None:
        """A moment on `track`: a rollback, a replay, a skip, a decision."""
        if not self._keeps(t_s):
            return
        with self._lock:
            self._events.append(Event(track, name, float(t_s), None, self._step, args))

    def _keeps(self, start_s: float) -> bool:
        if not self.enabled:
            return False
        if self._recording:
            return True
        tail = self._tail_end
        return tail is not None and start_s <= tail

    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    # ---- analysis -------------------------------------------------------------------------

    def device_waits(self) -> list[dict]:
        """Gaps in the device track inside each recorded step, each with the track that was
        busiest during it (what the device waited for) or "nothing recorded"."""
        events = self.events()
        waits = []
        for step, start, end in self._windows:
            busy = sorted((e.start_s, e.end_s) for e in events if e.track == DEVICE and e.end_s is not None
                          and e.end_s > start and e.start_s < end)
            cursor = start
            for s, e in busy + [(end, end)]:
                if s > cursor:
                    waits.append(dict(step=step, start_s=cursor, end_s=s, cause=self._cause(events, cursor, s)))
                cursor = max(cursor, e)
        return waits

    @staticmethod
    def _cause(events: list[Event], start: float, end: float) -> str:
        overlap: dict[str, float] = {}
        for e in events:
            if e.end_s is None or e.track in (DEVICE, STEP):
                continue
            o = min(e.end_s, end) - max(e.start_s, start)
            if o > 0:
                overlap[e.track] = overlap.get(e.track, 0.0) + o
        return max(overlap, key=overlap.get) if overlap else "nothing recorded"

    # ---- writing --------------------------------------------------------------------------

    def to_chrome_trace(self) -> dict:
        """The Chrome trace event format: one thread per track, times in microseconds from the
        start of the first recorded step."""
        events = self.events()
        origin = min((e.start_s for e in events), default=0.0)
        tracks = _ordered_tracks(events)
        tid = {t: i + 1 for i, t in enumerate(tracks)}
        out = [{"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": "superoffload step"}}]
        for t in tracks:
            out.append({"ph": "M", "pid": _PID, "tid": tid[t], "name": "thread_name", "args": {"name": t}})
            out.append({"ph": "M", "pid": _PID, "tid": tid[t], "name": "thread_sort_index", "args": {"sort_index": tid[t]}})
        for e in events:
            record = {"name": e.name, "cat": e.track, "pid": _PID, "tid": tid[e.track],
                      "ts": (e.start_s - origin) * 1e6, "args": _jsonable(dict(e.args, step=e.step))}
            if e.end_s is None:
                record.update(ph="i", s="t")
            else:
                record.update(ph="X", dur=(e.end_s - e.start_s) * 1e6)
            out.append(record)
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write(self, directory: Union[str, Path, None] = None) -> dict:
        """Write trace.json and (when matplotlib imports) timeline.png; the paths written."""
        directory = Path(directory) if directory is not None else self.directory
        if directory is None:
            raise ValueError("Timeline.write() needs a directory: pass one, or build with Timeline.from_dir(DIR).")
        directory.mkdir(parents=True, exist_ok=True)
        written = {"trace": directory / TRACE_FILE}
        written["trace"].write_text(json.dumps(self.to_chrome_trace()))
        png = directory / PNG_FILE
        if self.draw(png):
            written["png"] = png
        return written

    def close(self) -> dict:
        """Finish an open step and write both files to the directory given at construction."""
        if self.recording:
            self.end_step()
        if not self.enabled or self.directory is None:
            return {}
        return self.write()

    def draw(self, path: Union[str, Path]) -> bool:
        """Draw the recorded steps to `path` (PNG); False when matplotlib is not installed."""
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        fig = self.figure()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return True

    def figure(self):
        """The picture as a matplotlib Figure: one row per track (every standard track, an empty
        one labelled as such), the device's idle gaps hatched, the validation instants as marks.
        Every caption is in the legend below the axes, so no two captions can overlap."""
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
        from matplotlib.transforms import blended_transform_factory

        events = self.events()
        origin = min((e.start_s for e in events), default=0.0)
        tracks = list(TRACKS) + [t for t in _ordered_tracks(events) if t not in TRACKS]
        used = {e.track for e in events}
        row = {t: len(tracks) - 1 - i for i, t in enumerate(tracks)}
        fig, ax = plt.subplots(figsize=(14, 2.2 + 0.55 * len(tracks)), layout="constrained")
        for e in events:
            if e.end_s is None:
                continue
            x, w = (e.start_s - origin) * 1e3, (e.end_s - e.start_s) * 1e3
            ax.broken_barh([(x, max(w, 1e-3))], (row[e.track] - 0.4, 0.8), facecolors=_COLORS.get(e.track, "#937860"),
                           edgecolors="white", linewidth=0.3)
        handles, marks = [], {}
        for e in events:
            if e.end_s is None:
                x = (e.start_s - origin) * 1e3
                color = _MARK_COLORS.get(e.name, "#555555")
                ax.plot([x, x], [row[e.track] - 0.45, row[e.track] + 0.45], color=color, linewidth=1.5)
                marks[e.name] = marks.get(e.name, 0) + 1
        for name, count in marks.items():
            handles.append(Line2D([], [], color=_MARK_COLORS.get(name, "#555555"), linewidth=1.5,
                                  label=f"{name} ({count})"))
        idle: dict[str, list[float]] = {}
        for wait in self.device_waits():
            x, w = (wait["start_s"] - origin) * 1e3, (wait["end_s"] - wait["start_s"]) * 1e3
            ax.broken_barh([(x, w)], (row[DEVICE] - 0.4, 0.8), facecolors="none", edgecolors="red", hatch="///",
                           linewidth=0.5)
            idle.setdefault(wait["cause"], []).append(w)
        for cause, widths in sorted(idle.items(), key=lambda item: -sum(item[1])):
            what = f"waiting for {cause}" if cause != "nothing recorded" else "nothing recorded meanwhile"
            handles.append(Patch(facecolor="none", edgecolor="red", hatch="///",
                                 label=f"device idle, {what}: {len(widths)}x, {sum(widths):.3g} ms"))
        text_row = blended_transform_factory(ax.transAxes, ax.transData)
        labels = []
        for t in tracks:
            if t in used:
                labels.append(t)
                continue
            labels.append(f"{t} (empty)")
            why = self.empty_notes.get(t, "nothing was recorded on this track")
            ax.text(0.5, row[t], f"empty: {why}", transform=text_row, ha="center", va="center", fontsize=8,
                    color="#777777", style="italic")
        ax.set_yticks(list(row.values()), labels)
        ax.set_ylim(-0.6, len(tracks) - 0.4)
        ax.set_xlabel("ms since the first recorded step began")
        steps = ", ".join(str(step) for step, _, _ in self._windows) or "none recorded"
        ax.set_title(f"superoffload step timeline, steps {steps}")
        ax.grid(axis="x", alpha=0.3)
        if handles:
            fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 3), fontsize=8,
                       frameon=False)
        return fig


_COLORS = {STEP: "#d0d0d0", DEVICE: "#4c72b0", D2H: "#55a868", HOST_ADAM: "#dd8452", H2D: "#8172b2",
           VALIDATION: "#c44e52"}
_MARK_COLORS = {COMMIT: "black", ROLLBACK: "red", REPLAY: "#ff7f0e", SKIP: "#cc00cc"}


def _ordered_tracks(events: list[Event]) -> list[str]:
    seen = {e.track for e in events}
    return [t for t in TRACKS if t in seen] + sorted(seen - set(TRACKS))


def _jsonable(args: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v)) for k, v in args.items()}
