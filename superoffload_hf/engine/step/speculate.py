"""Whether a bucket launched now is stepped speculatively, and with which call: one decision per
step (at its first launch), then per bucket (its hyperparameters invertible, or a snapshot; the
snapshot trade's allowance under compact state). Shared by the collector and the sharded route
(dp.py), which launch buckets; nothing here touches a buffer."""

from __future__ import annotations

from typing import Callable, Optional

from superoffload_hf.engine.state.lifecycle import BucketRuntime
from superoffload_hf.engine.state.stepper import Hyper, StepCall
from superoffload_hf.engine.step.validate import SpeculationBudget


def invertible(h: Hyper, adamw: bool) -> bool:
    """Whether adam_rollback_ can undo a step with these hyperparameters (it divides by them)."""
    return h.beta1 > 0 and h.beta2 > 0 and (not adamw or h.lr * h.weight_decay != 1.0)


class Speculation:
    def __init__(self, *, step_state, policy, loss_scale, live, snapshot: bool, adamw: bool,
                 gradient_accumulation_steps: int):
        self.step, self.policy, self.loss_scale = step_state, policy, loss_scale
        self.live = live  # read at use: fire_log, max_grad_norm, sync_source, snapshot_trade
        self.snapshot, self.adamw = snapshot, adamw
        self.gradient_accumulation_steps = gradient_accumulation_steps

    def is_last_micro_batch(self, rt: BucketRuntime) -> bool:
        sync_source: Optional[Callable[[], bool]] = self.live.sync_source
        if sync_source is not None:
            return bool(sync_source())
        return max(rt.fires) >= self.gradient_accumulation_steps

    def call(self, rt: BucketRuntime) -> Optional[StepCall]:
        """The speculative step of `rt` launched now, or None (stepped at step())."""
        s = self.step
        if s.speculating is None:  # one decision per step, at its first launch
            s.speculating = self.live.fire_log is None and self.policy.should_speculate()
            s.budget = SpeculationBudget(self.live.max_grad_norm, self.loss_scale.scale)
        if not s.speculating or rt.no_spec or not all(rt.present):
            return None
        trade = self.live.snapshot_trade  # compact state, speculation auto: the snapshot it can afford
        if trade is not None and not trade.allows(rt.bucket.index):
            return None
        call = s.call(rt, 1.0)
        return call if self.snapshot or invertible(call.hyper, self.adamw) else None
