"""What the current optimizer step has decided and done so far; reset after step() or a discard."""

from __future__ import annotations

from typing import Optional

from superoffload_hf.engine.state.lifecycle import BucketRuntime
from superoffload_hf.engine.state.stepper import Hyper, StepCall, plan_runs
from superoffload_hf.engine.step.validate import SpeculationBudget


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
        bucket, present = rt.bucket, rt.present
        if rt.shard is not None:  # data parallel: the runs of this rank's pieces of the bucket
            bucket, present = rt.shard.local_bucket(), [rt.present[p.slot] for p in rt.shard.pieces]
        return StepCall(plan_runs(bucket, present, self.param_steps),
                        Hyper.of_group(self.groups[rt.bucket.group]), clip_coef / self.loss_scale.scale)
