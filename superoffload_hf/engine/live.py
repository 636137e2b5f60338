"""The engine's values that change over time and that its parts read at use, in one small
mutable holder shared by the engine and the parts (so that no part keeps the engine itself:
a part holding the engine is a reference cycle that keeps a dropped optimizer's buffers alive
until the cyclic garbage collector runs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from superoffload_hf.engine.measure import FireLog


@dataclass
class LiveInputs:
    # the optimizer's clipping threshold, read during backward (the speculation budget)
    max_grad_norm: Optional[float] = None
    # True while the backward of a step's last micro-batch runs (Accelerate's `sync_gradients`)
    sync_source: Optional[Callable[[], bool]] = None
    # the order the hooks fired in on the first step; None once the plan was learned from it
    fire_log: Optional[FireLog] = None
    # compact state under speculation auto: which buckets may speculate (plan/snapshot_trade.py)
    snapshot_trade: Optional[object] = None
