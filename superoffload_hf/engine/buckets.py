"""The buckets at run time: the plan, each bucket's runtime and buffers, which parameter lives
where, and each parameter's Adam step count. Also the per-parameter state interface that
checkpoints and re-planning go through (`export_param`, `import_param`).

When the device is this host's memory (the CPU runtime) and the device dtype is fp32, a host
bucket's parameters are views into its fp32 master buffer (`alias_params`): a host step updates
them in place, nothing is copied back, and there is no second copy of the weights.
"""

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
        self.aliases_masters = transfer.runtime.host_is_device and layout.dtype == torch.float32
        self._aliases: list[tuple[int, int]] = []  # (param index, data_ptr) of aliased parameters

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
        self.alias_params()

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

    def alias_params(self) -> None:
        """Point each host bucket's parameters at its fp32 master (when `aliases_masters`): after
        install(), so a re-plan re-points them into the new buffers."""
        self._aliases = []
        if not self.aliases_masters:
            return
        with torch.no_grad():
            for rt in self.host():
                master = rt.bufs.master.numpy()  # the same memory; keeps the buffer alive
                for p, slot in zip(rt.params, rt.bucket.slots):
                    p.data = _param_over(master, slot)
                    self._aliases.append((slot.index, p.data_ptr()))
                rt.params_alias_master = True

    def check_aliases(self) -> None:
        """Raise if user code replaced an aliased parameter's storage since alias_params()."""
        for index, ptr in self._aliases:
            p = self.params[index]
            if p.data_ptr() != ptr:
                raise RuntimeError(
                    f"Parameter {index} (shape {tuple(p.shape)}, {p.dtype}) no longer shares memory with "
                    "the optimizer's fp32 master weight: its storage was replaced after the optimizer was "
                    "built (`p.data = ...`, `model.to(dtype)`, `model.half()`, ...). On the CPU with fp32 "
                    "the parameters are views of the master weights, so the optimizer would update a "
                    "tensor the model no longer uses. Move or cast the model before building the "
                    "optimizer; to set new values, write them in place (`p.data.copy_(...)`, "
                    "`model.load_state_dict(...)`).")

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
                if rt.params_alias_master:
                    continue  # the parameters are the masters
                for p, slot in zip(rt.params, rt.bucket.slots):
                    p.detach().copy_(BucketBuffers.view(rt.bufs.master, slot).view(slot.shape))


def _param_over(master, slot: ParamSlot) -> torch.Tensor:
    """A tensor over the slot's elements of `master` (a numpy view of a bucket's fp32 master) with
    a storage of its own: savers that keep only one of the tensors sharing a storage
    (accelerate's save_model, safetensors' save_model) must see every parameter as separate."""
    if slot.numel == 0:
        return torch.empty(slot.shape, dtype=torch.float32)
    return torch.frombuffer(master, dtype=torch.float32, count=slot.numel,
                            offset=slot.offset * master.itemsize).view(slot.shape)
