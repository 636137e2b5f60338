"""SuperOffloadCallback: the Trainer-side hooks that a TrainerCallback can carry.

- grad norm: the Trainer reads the gradient norm before `optimizer.step()`, but the SuperOffload
  optimizer computes it inside `step()`. The Trainer's `_get_grad_norm` (see trainer.py) returns
  a placeholder tensor from `grad_norm_placeholder()`; `on_optimizer_step` fills it with
  `optimizer.last_grad_norm`, and the Trainer's own logging reads it with `.item()` afterwards.
- counters: `on_log` adds the engine's counters to every training log record (the `logs` that
  later callbacks such as reporters see, and the record just appended to `state.log_history`).
- weights read outside a forward: on CUDA the updated weights reach the parameters in stream
  order, and only a forward waits for them. Before the Trainer saves a checkpoint, and when
  training ends, the callback makes later device work wait for every copy-back.

It must sit after DefaultFlowCallback (which decides `should_save`) and before the reporters
and printers (which read the logs); `SuperOffloadHooks` inserts it there.

The printed line stays short: `shorten_printed_logs` makes the Trainer's printer (the tqdm
progress bar's `ProgressCallback`, or `PrinterCallback`) print the stock keys plus one
`superoffload` summary (`short_summary`), while the log record and the reporters keep every
`superoffload/*` value.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from transformers import PrinterCallback, ProgressCallback, TrainerCallback

LOG_PREFIX = "superoffload/"
SUMMARY_KEY = "superoffload"  # the printed line's one entry in place of the superoffload/* keys

logger = logging.getLogger(__name__)


def describe_timeline(written: dict) -> str:
    """Where the step timeline went, for people: the trace (and how to open it) and the PNG."""
    parts = [f"{written['trace']} (open in https://ui.perfetto.dev)"]
    parts.append(str(written["png"]) if "png" in written else "no timeline.png (matplotlib is not installed: "
                                                              "pip install 'superoffload_hf[timeline]')")
    return ", ".join(parts)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The SuperOffload optimizer inside Accelerate's (or anyone's) `.optimizer` wrappers (ours
    forwards the read-outs, so look for a method only the optimizer itself has)."""
    while optimizer is not None and not hasattr(optimizer, "set_gradient_sync_source"):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


class SuperOffloadCallback(TrainerCallback):
    """Reports the SuperOffload optimizer's grad norm and counters through the Trainer's logs.

    Logged keys (training log records only), with N the `step()` calls since the last log:
    `superoffload/rollbacks`, `/replays`, `/skips`, `/speculative_steps`: totals since the start;
    `superoffload/host_step_s`: host Adam seconds per step, mean over the last N steps;
    `superoffload/device_wait_s`: seconds per step the device sat idle waiting for the host, same
    mean (on an accelerator measured with device events around the next forward's per-bucket
    waits; see OffloadCounters.device_wait_seconds);
    `superoffload/thread_wait_s`: seconds per step the training thread blocked on the host worker
    (includes waiting for the device's own backward to deliver gradients), same mean;
    `superoffload/overlap`: 1 - device_wait / host_step over the last N steps, clamped to [0, 1]
    (1.0: the host steps were fully hidden behind the device's work; absent while host_step is 0,
    and on the CPU device, where host jobs run inline and nothing overlaps);
    `superoffload/step_s`: the last step's wall time; `superoffload/predicted_step_s`: what the
    cost model predicted for the layout in use (after the first step);
    `superoffload/loss_scale`: the fp16 loss scale (fp16 only).
    """

    def __init__(self) -> None:
        self.timeline_written: dict = {}  # the files the step timeline went to, once training ended
        self._grad_norm: Optional[torch.Tensor] = None
        self._counters_at_last_log: dict[str, float] = {}

    # ---- grad norm ---------------------------------------------------------------------------

    def grad_norm_placeholder(self) -> torch.Tensor:
        """A 0-d tensor the Trainer logs as `grad_norm`; filled after the optimizer step."""
        self._grad_norm = torch.tensor(float("nan"), dtype=torch.float64)
        return self._grad_norm

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        optimizer = unwrap_optimizer(optimizer)
        if self._grad_norm is not None and optimizer is not None:
            norm = optimizer.last_grad_norm
            self._grad_norm.fill_(float("nan") if norm is None else float(norm))
            self._grad_norm = None

    # ---- weights read outside a forward ------------------------------------------------------

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if control.should_save:
            _synchronize(optimizer)

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        if control.should_save:
            _synchronize(optimizer)

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        _synchronize(optimizer)
        optimizer = unwrap_optimizer(optimizer)
        if optimizer is not None:
            written = optimizer.write_timeline()  # config `timeline_dir` (superoffload train --timeline DIR)
            if written:
                self.timeline_written = written
                logger.info("superoffload: step timeline written: %s", describe_timeline(written))

    # ---- counters ----------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        optimizer = unwrap_optimizer(optimizer)
        if optimizer is not None:
            self._counters_at_last_log = optimizer.counters.as_dict()

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        optimizer = unwrap_optimizer(optimizer)
        if optimizer is None or logs is None or "loss" not in logs:
            return  # evaluation and end-of-training records carry no step counters
        values = self.log_values(optimizer)
        record = state.log_history[-1] if state.log_history else {}
        # Trainer.log appends {**logs, "step": global_step} to log_history just before on_log.
        if record.get("step") == state.global_step and record.get("loss") == logs["loss"]:
            record.update(values)
        logs.update(values)

    def log_values(self, optimizer: Any) -> dict[str, float]:
        now = optimizer.counters.as_dict()
        last, self._counters_at_last_log = self._counters_at_last_log, now
        calls = now["steps"] + now["skips"] - last.get("steps", 0) - last.get("skips", 0)
        steps = max(calls, 1)
        host_s = (now["host_step_seconds"] - last.get("host_step_seconds", 0.0)) / steps
        wait_s = (now["device_wait_seconds"] - last.get("device_wait_seconds", 0.0)) / steps
        values = {LOG_PREFIX + name: now[name] for name in ("rollbacks", "replays", "skips", "speculative_steps")}
        values[LOG_PREFIX + "host_step_s"] = host_s
        values[LOG_PREFIX + "device_wait_s"] = wait_s
        values[LOG_PREFIX + "step_s"] = now["step_seconds"]
        if now["predicted_step_seconds"] > 0:
            values[LOG_PREFIX + "predicted_step_s"] = now["predicted_step_seconds"]
        values[LOG_PREFIX + "thread_wait_s"] = (now["thread_wait_seconds"] - last.get("thread_wait_seconds", 0.0)) / steps
        if host_s > 0.0 and not optimizer.host_is_device:
            values[LOG_PREFIX + "overlap"] = min(max(1.0 - wait_s / host_s, 0.0), 1.0)
        if float(optimizer.loss_scale) != 1.0:
            values[LOG_PREFIX + "loss_scale"] = float(optimizer.loss_scale)
        return values


def short_summary(logs: dict) -> str:
    """The `superoffload/*` values of a log record in a few words, for the printed line."""
    def ms(key: str) -> str:
        return f"{1e3 * logs[LOG_PREFIX + key]:.3g} ms"

    parts = [f"host Adam {ms('host_step_s')}/step", f"device wait {ms('device_wait_s')}"]
    if LOG_PREFIX + "overlap" in logs:
        parts.append(f"overlap {logs[LOG_PREFIX + 'overlap']:.2f}")
    parts += [f"rollbacks {logs[LOG_PREFIX + 'rollbacks']}", f"skips {logs[LOG_PREFIX + 'skips']}"]
    if LOG_PREFIX + "loss_scale" in logs:
        parts.append(f"loss scale {logs[LOG_PREFIX + 'loss_scale']:g}")
    return ", ".join(parts)


def printed_logs(logs: Optional[dict]) -> Optional[dict]:
    """`logs` with its `superoffload/*` values folded into one short `superoffload` entry."""
    if not logs or LOG_PREFIX + "host_step_s" not in logs:
        return logs
    printed = {k: v for k, v in logs.items() if not k.startswith(LOG_PREFIX)}
    printed[SUMMARY_KEY] = short_summary(logs)
    return printed


class _PrintsShortLogs:
    """Mixed into the Trainer's printers: they print `printed_logs(logs)`; the `logs` dict the
    other callbacks see is left whole."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return super().on_log(args, state, control, logs=printed_logs(logs), **kwargs)


class ShortProgressCallback(_PrintsShortLogs, ProgressCallback):
    pass


class ShortPrinterCallback(_PrintsShortLogs, PrinterCallback):
    pass


_SHORT = {ProgressCallback: ShortProgressCallback, PrinterCallback: ShortPrinterCallback}


def shorten_printed_logs(callbacks: list) -> None:
    """Make the Trainer's own printer print short lines. The instance stays (its progress bar,
    `remove_callback(ProgressCallback)` still finds it): only its class becomes the subclass."""
    for callback in callbacks:
        short = _SHORT.get(type(callback))
        if short is not None:
            callback.__class__ = short


def _synchronize(optimizer: Any) -> None:
    optimizer = unwrap_optimizer(optimizer)
    if optimizer is not None:
        # The checkpoint's model weights are read on the current stream: order it after every
        # host-to-device copy of updated weights.
        optimizer.synchronize()
