"""Dynamic loss scaling for fp16 device parameters (torch.amp.GradScaler's policy).

The loss is multiplied by `scale` before backward; the host step unscales by passing
`grad_scale = clip_coef / scale` to the kernel. A step with non-finite gradients is skipped and
the scale backs off; after `growth_interval` consecutive good steps it grows. bf16 and fp32
need no scaling: `FixedLossScale` keeps the scale at 1.
"""

from __future__ import annotations

import math


class FixedLossScale:
    scale = 1.0

    def update(self, found_non_finite: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"kind": "fixed", "scale": 1.0}

    def load_state_dict(self, state: dict) -> None:
        pass


class DynamicLossScale:
    def __init__(self, init: float, growth_factor: float, backoff_factor: float, growth_interval: int):
        self.scale = float(init)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.good_steps = 0

    def update(self, found_non_finite: bool) -> None:
        if found_non_finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = self.scale * self.growth_factor
            self.scale = grown if math.isfinite(grown) else self.scale
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"kind": "dynamic", "scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "dynamic":
            return  # a bf16/fp32 checkpoint: keep the configured initial scale
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
