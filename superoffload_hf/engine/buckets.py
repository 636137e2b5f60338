"""The buckets at run time: the plan, each bucket's runtime and buffers, which parameter lives
where, and each parameter's Adam step count. Also the per-parameter state interface that
checkpoints and re-planning go through (`export_param`, `import_param`)."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from superoffload_hf.engine.buffers import BucketBuffers
from superoffload_hf.engine.lifecycle import BucketRuntime
from superoffload_hf.engine.plan import BucketPlan, ParamSlot


class BucketSet:
    def __init__(self, params: list[torch.Tensor], layout, transfer, cast: str):
        self.params = params
        self.index_of = {p: i for i, p in enumerate(params)}
        self.layout, self.transfer, self.cast = layout, transfer, cast
        self.param_steps = [0] * len(params)
        self.runtimes: list[BucketRuntime] = []
        self.plan: BucketPlan = None  # set by install()

    def install(self, plan: BucketPlan, state_of: Callable[[int, ParamSlot, BucketBuffers], None]) -> None:
        """Build buffers for `plan` and fill them through state_of(param index, slot, bufs)."""
        self.plan = plan
        self.transfer.reserve(max((b.numel for b in plan.buckets if not b.device_resident), default=0))
        self.runtimes = []
        self.where: dict[int, tuple[BucketRuntime, int]] = {}
        for bucket in plan.buckets:
            bufs = self.layout.allocate(bucket, self.transfer, self.cast)
            rt = BucketRuntime(bucket, bufs, [self.params[s.index] for s in bucket.slots])
            for k, slot in enumerate(bucket.slots):
                state_of(slot.index, slot, bufs)
                self.where[slot.index] = (rt, k)
            self.runtimes.append(rt)
        self.runtime_of = {self.params[i]: rt for i, (rt, _) in self.where.items()}

    def initial_state(self, index: int, slot: ParamSlot, bufs: BucketBuffers) -> None:
        # fp32 masters from the parameters as given (an fp32 model keeps full precision).
        bufs.view(bufs.master, slot).copy_(self.params[index].detach().reshape(-1))
        if bufs.lowp is not None:
            bufs.view(bufs.lowp, slot).copy_(bufs.view(bufs.master, slot))

    def replan(self, plan: BucketPlan) -> None:
        """Move every parameter's state into the buffers of a new plan. The caller has waited
        for every queued job (nothing may touch the old buffers any more)."""
        old = {s.index: (rt, s) for rt in self.runtimes for s in rt.bucket.slots}
        left = {rt: len(rt.bucket.slots) for rt in self.runtimes}

        def move(index: int, slot: ParamSlot, bufs: BucketBuffers) -> None:
            rt, old_slot = old[index]
            bufs.copy_param_from(rt.bufs, old_slot, slot)
            left[rt] -= 1
            if left[rt] == 0:
                rt.bufs = None  # free it now: peak memory stays near one copy of the state

        self.install(plan, move)

    def host(self) -> Iterator[BucketRuntime]:
        return (rt for rt in self.runtimes if not rt.bucket.device_resident)

    def on_device(self) -> Iterator[BucketRuntime]:
        return (rt for rt in self.runtimes if rt.bucket.device_resident)

    # ---- per-parameter state (checkpoints) -------------------------------------------------

    def slot_of(self, index: int) -> tuple[BucketRuntime, ParamSlot]:
        rt, k = self.where[index]
        return rt, rt.bucket.slots[k]

    def export_param(self, index: int) -> dict[str, torch.Tensor]:
        """CPU fp32 copies of master / exp_avg / exp_avg_sq, shaped like the parameter."""
        rt, slot = self.slot_of(index)
        return rt.bufs.export_param(slot)

    def import_param(self, index: int, values: dict[str, torch.Tensor]) -> None:
        rt, slot = self.slot_of(index)
        rt.bufs.import_param(slot, values)

    def refresh_device_params(self) -> None:
        """Copy every master weight to its device parameter (after loading state; the caller
        has synchronized)."""
        with torch.no_grad():
            for rt in self.runtimes:
                for p, slot in zip(rt.params, rt.bucket.slots):
                    p.detach().copy_(BucketBuffers.view(rt.bufs.master, slot).view(slot.shape))
