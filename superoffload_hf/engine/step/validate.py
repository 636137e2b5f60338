"""Validation of a step (commit / clip-and-replay / skip) and the speculation policy.

`decide` turns the global squared norm into what step() must do. `SpeculationBudget` stops
speculating within a step as soon as the buckets seen so far prove that the step will be
clipped or skipped (their partial sum of squares is a lower bound of the global one), so only
buckets launched before that point can need a rollback. `SpeculationPolicy` says
whether the next step speculates: "on" always, "off" never, "auto" unless more than
`max_rollback_rate` of the last `window` speculative steps rolled back (typical early in
training); while not speculating it keeps watching whether steps *would* have rolled back,
so it resumes once they stop. "auto" never speculates where nothing can overlap the host step
(`overlap=False`: the CPU device, whose host jobs run inline, between backward's kernels).
Under "on" it says once, as a warning, when that share of the last `window` steps rolled back
(every step clipped, early in training), and what to set.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger("superoffload_hf")

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


@dataclass(frozen=True)
class Decision:
    kind: str  # "commit", "clip", "skip", or "empty" (no gradient at all: nothing to do)
    grad_norm: float  # global L2 norm of the unscaled gradients, before clipping
    clip_coef: float  # 1.0 unless kind == "clip"

    @property
    def rolls_back(self) -> bool:
        """Whether speculative work taken with clip_coef 1 must be undone."""
        return self.kind in ("clip", "skip")


def decide(sum_squares: float, loss_scale: float, max_grad_norm: Optional[float]) -> Decision:
    """`sum_squares`: float64 sum of the squared (loss-scaled) gradients of every bucket."""
    norm = math.sqrt(sum_squares) / loss_scale if sum_squares >= 0 else math.nan
    if not math.isfinite(norm):
        return Decision("skip", norm, 1.0)
    if max_grad_norm is not None:
        coef = max_grad_norm / (norm + CLIP_EPS)
        if coef < 1.0:
            return Decision("clip", norm, coef)
    return Decision("commit", norm, 1.0)


class SpeculationBudget:
    """Per step: admit a bucket's speculative step while the running sum of squares still
    allows a commit. Used by the host worker only (launch jobs run in gradient-ready order)."""

    def __init__(self, max_grad_norm: Optional[float], loss_scale: float):
        self.max_grad_norm = max_grad_norm
        self.loss_scale = loss_scale
        self.running = 0.0

    def admit(self, sum_squares: float) -> bool:
        self.running += sum_squares
        if not math.isfinite(self.running):
            return False
        if self.max_grad_norm is None:
            return True
        return math.sqrt(self.running) / self.loss_scale + CLIP_EPS <= self.max_grad_norm


class SpeculationPolicy:
    def __init__(self, mode: str, window: int, max_rollback_rate: float, overlap: bool = True):
        if mode not in ("on", "off", "auto"):
            raise ValueError(f"`speculation` is {mode!r}; valid choices are ['auto', 'on', 'off'].")
        self.mode = mode
        self.overlap = overlap
        self.window = int(window)
        self.max_rollback_rate = float(max_rollback_rate)
        self.recent: deque[bool] = deque(maxlen=self.window)  # True: that step rolled back / would have
        self.warned = False  # "on" and rollbacks dominate: said once

    def should_speculate(self) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        return self.overlap and self.rollback_rate() <= self.max_rollback_rate

    def may_speculate(self) -> bool:
        """Whether any step may speculate (the mode, not this step's choice, which under "auto"
        follows this rank's own rollbacks)."""
        return self.mode == "on" or (self.mode == "auto" and self.overlap)

    def rollback_rate(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    def record(self, decision: Decision, speculated: bool, rolled_back: bool) -> None:
        """Called after every validated step. A speculative step is charged only when a bucket
        was actually rolled back (a clip decided by the first bucket stops speculation at once
        and costs nothing); a step that did not speculate records whether it would have had to."""
        self.recent.append(rolled_back if speculated else decision.rolls_back)
        if self.mode == "on" and not self.warned and len(self.recent) == self.window \
                and self.rollback_rate() > self.max_rollback_rate:
            self.warned = True
            logger.warning("superoffload: %s", self.rollbacks_dominate())

    def rollbacks_dominate(self) -> str:
        """What `speculation: on` costs here when most steps roll back, and what to set."""
        where = ("on the CPU device speculation overlaps nothing, so every rollback is pure cost; "
                 if not self.overlap else "")
        return (f"speculation \"on\": {sum(self.recent)} of the last {len(self.recent)} steps were rolled back and "
                "redone (their gradient norm exceeded max_grad_norm, or was not finite), each costing a second "
                f"host Adam pass; {where}set `speculation: auto` (it speculates only while at most "
                f"{self.max_rollback_rate:g} of recent steps roll back, and never on the CPU device), or "
                "`speculation: off`.")

    def state_dict(self) -> dict:
        return {"mode": self.mode, "recent": [bool(r) for r in self.recent]}

    def load_state_dict(self, state: dict) -> None:
        self.recent = deque((bool(r) for r in state.get("recent", [])), maxlen=self.window)
