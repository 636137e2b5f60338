"""What the current optimizer step has decided and done so far; reset after step() or a discard."""

from __future__ import annotations

from typing import Optional

from superoffload_hf.engine.lifecycle import BucketRuntime
from superoffload_hf.engine.stepper import Hyper, StepCall, plan_runs
from superoffload_hf.engine.validate import SpeculationBudget


class StepState:
    def __init__(self, groups: list[dict], param_steps: list[int], loss_scale):
        self.groups = groups  # the optimizer's live list: hyperparameters are read at use
        self.param_steps = param_steps
        self.loss_scale = loss_scale
        self.reset()

    def reset(self) -> None:
        self.speculating: Optional[bool] = None  # decided once per step, at its first launch
        self.budget: Optional[SpeculationBudget] = None
        self.speculative = self.rolled_back = self.replayed = False

    def call(self, rt: BucketRuntime, clip_coef: float) -> StepCall:
        """The Adam update of `rt`'s present parameters with the current hyperparameters."""
        return StepCall(plan_runs(rt.bucket, rt.present, self.param_steps),
                        Hyper.of_group(self.groups[rt.bucket.group]), clip_coef / self.loss_scale.scale)
