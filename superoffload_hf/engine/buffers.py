"""The flat fp32 buffers of one bucket: master weights, Adam moments, gradient staging.

A host bucket's buffers live in host memory (page-locked when the device is CUDA, via the
allocator the engine passes in); a device-resident bucket's live on the device. The layout is
the plan's: parameter `slot` occupies `[slot.offset, slot.offset + slot.numel)` of every buffer.

* `grad`   fp32 accumulation of the bucket's gradients over the micro-batches of one step.
* `recv`   (host, lazily) the landing buffer of a gradient copy that must be added to `grad`
           or cast to fp32 first; its dtype is the dtype that crosses the link.
* `lowp`   (host, cast "host" only) the low-precision copy of `master` the kernel writes.
* `snap_*` (rollback "snapshot" only) master / moments before the speculative step.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from superoffload_hf.engine.plan import Bucket, ParamSlot

Alloc = Callable[[int, torch.dtype], torch.Tensor]
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class BucketBuffers:
    def __init__(self, bucket: Bucket, alloc: Alloc, lowp_dtype: Optional[torch.dtype] = None):
        self.numel = bucket.numel
        self._alloc = alloc
        self.master = alloc(self.numel, torch.float32)
        self.exp_avg = alloc(self.numel, torch.float32).zero_()
        self.exp_avg_sq = alloc(self.numel, torch.float32).zero_()
        self.grad = alloc(self.numel, torch.float32).zero_()
        self.lowp = alloc(self.numel, lowp_dtype) if lowp_dtype is not None else None
        self.recv: Optional[torch.Tensor] = None
        self._snapshot: Optional[tuple[torch.Tensor, ...]] = None

    @staticmethod
    def view(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        return flat[slot.offset:slot.offset + slot.numel]

    def recv_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if self.recv is None or self.recv.dtype != dtype:
            self.recv = self._alloc(self.numel, dtype)
        return self.recv

    def take_snapshot(self) -> None:
        if self._snapshot is None:  # plain host memory: snapshots never cross the link
            self._snapshot = tuple(torch.empty_like(t, pin_memory=False) for t in self._state())
        for saved, live in zip(self._snapshot, self._state()):
            saved.copy_(live)

    def restore_snapshot(self) -> None:
        if self._snapshot is None:
            raise RuntimeError("restore_snapshot() without take_snapshot(): the engine lost track of a speculative step.")
        for saved, live in zip(self._snapshot, self._state()):
            live.copy_(saved)
        if self.lowp is not None:
            self.lowp.copy_(self.master)

    def _state(self) -> tuple[torch.Tensor, ...]:
        return (self.master, self.exp_avg, self.exp_avg_sq)

    # ---- per-parameter import / export (checkpoints, re-planning) -------------------------

    def export_param(self, slot: ParamSlot) -> dict[str, torch.Tensor]:
        """CPU fp32 copies shaped like the parameter."""
        return {key: self.view(flat, slot).detach().to("cpu", torch.float32, copy=True).view(slot.shape)
                for key, flat in zip(STATE_KEYS, self._state())}

    def copy_param_from(self, other: "BucketBuffers", other_slot: ParamSlot, slot: ParamSlot) -> None:
        """One parameter's state from another bucket's buffers (re-planning), any devices."""
        for mine, theirs in zip(self._state(), other._state()):
            self.view(mine, slot).copy_(self.view(theirs, other_slot))
        if self.lowp is not None:
            self.view(self.lowp, slot).copy_(self.view(self.master, slot))

    def import_param(self, slot: ParamSlot, values: dict[str, torch.Tensor]) -> None:
        """Copy master / exp_avg / exp_avg_sq of one parameter in, from any device and dtype."""
        for key, flat in zip(STATE_KEYS, self._state()):
            self.view(flat, slot).copy_(values[key].detach().reshape(-1))
        if self.lowp is not None:
            self.view(self.lowp, slot).copy_(self.view(self.master, slot))
