"""What each step looked like, for people: the step timeline (perf.timeline) and the device's
idle time waiting for the host.

A step opens at the first forward after the previous `step()` (or at its first gradient) and is
recorded in the timeline until the next one opens, so host work queued by `step()` that runs
during the next forward stays in its step. Spans are host-clock times: when the training thread
issued device work, when the worker ran the host Adam, when it saw a gradient land. The step's
forward + backward is also bracketed by timing events on the compute stream (an asynchronous
device): `device_step_span()` is its device time, which the learned plan uses.

Device idle: on an accelerator, each per-bucket wait of a forward is bracketed by two timing
events on the compute stream; the time between them is the time the stream stalled for that
copy-back. They are read at a later step() once complete (`query()`), never by blocking.
"""

from __future__ import annotations

from typing import Callable

from superoffload_hf.perf.timeline import (
    COMMIT, CPU_EMPTY_NOTES, DEVICE, REPLAY, ROLLBACK, SKIP, VALIDATION, Timeline,
)


class StepObserver:
    def __init__(self, runtime, counters, timeline_dir=None, timeline_steps=(2, 3)):
        self.runtime, self.counters = runtime, counters
        notes = CPU_EMPTY_NOTES if runtime.host_is_device else None
        self.timeline = (Timeline.from_dir(timeline_dir, timeline_steps, empty_notes=notes) if timeline_dir
                         else Timeline.disabled())
        self.step_index = 0  # step() calls so far
        self.open = False
        self._opened_at = 0.0
        self.last_step_span = 0.0  # the last step, from its first forward to step()
        self._last_step_call: float = None
        self._idle_pending: list = []  # (before, after) timing events around device waits
        self._span_events = (None, None)  # timing events at the step's open and at step()

    # ---- training thread --------------------------------------------------------------------

    def open_step(self) -> None:
        """The first forward (or gradient) of the next step."""
        if self.open:
            return
        self.open = True
        tl = self.timeline
        tl.end_step()
        tl.begin_step(self.step_index + 1)
        self._opened_at = tl.now()
        self._span_events = (self._timing_event(), None)

    def _timing_event(self):
        if not self.runtime.is_async:
            return None
        event = self.runtime.new_event(timing=True)
        event.record(self.runtime.current_stream())
        return event

    def device_step_span(self):
        """Device seconds of the last step's forward + backward, None where unknown (a
        synchronous device, or its events have not completed: never waits for them)."""
        opened, began = self._span_events
        if opened is None or began is None or not (opened.query() and began.query()):
            return None
        return opened.elapsed_time(began) / 1000.0

    def step_begins(self) -> float:
        self.open_step()
        self._span_events = (self._span_events[0], self._timing_event())
        now = self.timeline.now()
        self.last_step_span = now - self._opened_at
        if self._last_step_call is not None:
            self.counters.step_seconds = now - self._last_step_call
        self._last_step_call = now
        self.timeline.span(DEVICE, "forward + backward", self._opened_at, now, clock="host (issue)")
        return now

    def step_ends(self, started: float, decision, step_state) -> None:
        tl = self.timeline
        end = tl.now()
        tl.span(VALIDATION, f"step(): {decision.kind}", started, end, grad_norm=decision.grad_norm,
                clip_coef=decision.clip_coef)
        name = {"skip": SKIP}.get(decision.kind, COMMIT)
        tl.instant(VALIDATION, name, end, kind=decision.kind)
        if step_state.rolled_back:
            tl.instant(VALIDATION, ROLLBACK, end)
        if step_state.replayed:
            tl.instant(VALIDATION, REPLAY, end)
        self.open = False
        self.step_index += 1
        self._collect_idle()

    def thread_waited(self, why: str, start: float, seconds: float) -> None:
        """The training thread blocked `seconds` on the host worker."""
        self.counters.thread_wait_seconds += seconds
        if not self.runtime.is_async:
            self.counters.device_wait_seconds += seconds  # the training thread is the device
        if seconds > 0:
            self.timeline.span(DEVICE, f"waiting for host: {why}", start, start + seconds)

    def around_device_wait(self, wait: Callable[[], None]) -> None:
        """`wait` queues a wait on the compute stream: bracket it with timing events."""
        if not self.runtime.is_async:
            wait()
            return
        stream = self.runtime.current_stream()
        before, after = self.runtime.new_event(timing=True), self.runtime.new_event(timing=True)
        before.record(stream)
        wait()
        after.record(stream)
        self._idle_pending.append((before, after))

    def _collect_idle(self) -> None:
        still = []
        for before, after in self._idle_pending:
            if after.query():  # both recorded on one stream: `before` has completed too
                self.counters.device_wait_seconds += before.elapsed_time(after) / 1000.0
            else:
                still.append((before, after))
        self._idle_pending = still

    def close(self) -> dict:
        """Write the timeline (when one is recorded); returns the paths written."""
        self._collect_idle()
        if self.timeline.enabled and self.timeline.directory is not None:
            return self.timeline.close()
        return {}
