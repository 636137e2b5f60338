"""The flat buffers of one bucket: master weights, Adam moments, gradient staging.

A host bucket's buffers are views into the plan's host arenas (memory.py: one allocation per
kind, page-locked only where the data crosses the link); a device-resident bucket's are its own
device tensors. BucketSet sets them. The layout is the plan's: parameter `slot` occupies
`[slot.offset, slot.offset + slot.numel)` of every buffer.

* `grad`   fp32 accumulation of the bucket's gradients over the micro-batches of one step.
           Where the policy keeps none at rest (BufferPolicy.grad_on_demand) it is allocated
           by `grad_buffer()` for a step that needs it and dropped after it; under
           BufferPolicy.grad_lazy otherwise, allocated the first time it is needed and kept.
* `recv`   (host, lazily) the landing buffer of a gradient copy that must be added to `grad`
           or cast to fp32 first; its dtype is the dtype that crosses the link.
* `lowp`   (host, cast "host" only) the low-precision copy of `master` the kernel writes.
* `snap_*` (rollback "snapshot" only) master / moments before the speculative step.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from superoffload_hf.engine.memory import STATE_KINDS
from superoffload_hf.engine.plan import ParamSlot

# (kind, dtype, pinned) -> a new buffer of the bucket's numel, counted by the engine's Ledger
Alloc = Callable[[str, torch.dtype, bool], torch.Tensor]
STATE_KEYS = STATE_KINDS


class BucketBuffers:
    def __init__(self, numel: int, on_host: bool, alloc: Alloc):
        self.numel = numel
        self.on_host = on_host
        self._alloc = alloc
        self.master: Optional[torch.Tensor] = None  # set by BucketSet, kind by kind
        self.exp_avg: Optional[torch.Tensor] = None
        self.exp_avg_sq: Optional[torch.Tensor] = None
        self.grad: Optional[torch.Tensor] = None
        self.lowp: Optional[torch.Tensor] = None
        self.recv: Optional[torch.Tensor] = None
        self._snapshot: Optional[tuple[torch.Tensor, ...]] = None

    @staticmethod
    def view(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        return flat[slot.offset:slot.offset + slot.numel]

    def recv_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The landing buffer (a view of the host arena of its kind, see memory.py)."""
        if self.recv is None or self.recv.dtype != dtype:
            self.recv = self._alloc("grad landing", dtype, True)  # a copy target: page-locked
        return self.recv

    def grad_buffer(self) -> torch.Tensor:
        """The fp32 gradient buffer, allocated (contents undefined) if there is none."""
        if self.grad is None:
            # never crosses a link: the CPU, or gradients that land in low precision in `recv`
            self.grad = self._alloc("grad", torch.float32, False)
        return self.grad

    def drop_transients(self) -> None:
        """Forget the snapshot (re-planning: the buffers go)."""
        self._snapshot = None

    def take_snapshot(self, copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """`copy(dst, src)`: the host Adam's `grad_copy_` (fp32 -> fp32 on the kernel's pool: the
        worker runs this during backward, where torch's OpenMP team would compete with it)."""
        if self._snapshot is None:  # plain host memory: snapshots never cross the link
            self._snapshot = tuple(self._alloc("snapshot", torch.float32, False) for _ in STATE_KEYS)
        for saved, live in zip(self._snapshot, self._state()):
            copy(saved, live)

    def restore_snapshot(self, copy: Callable[[torch.Tensor, torch.Tensor], None],
                         cast: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """`copy` as for take_snapshot; `cast(lowp, master)`: the host Adam's `lowp_copy_`."""
        if self._snapshot is None:
            raise RuntimeError("restore_snapshot() without take_snapshot(): the engine lost track of a speculative step.")
        for saved, live in zip(self._snapshot, self._state()):
            copy(live, saved)
        if self.lowp is not None:
            cast(self.lowp, self.master)

    def _state(self) -> tuple[torch.Tensor, ...]:
        return (self.master, self.exp_avg, self.exp_avg_sq)

    # ---- per-parameter import / export (checkpoints) --------------------------------------

    def export_param(self, slot: ParamSlot) -> dict[str, torch.Tensor]:
        """master / exp_avg / exp_avg_sq of one parameter as CPU fp32 tensors shaped like it:
        views of the live buffers for a host bucket (no copy, as torch.optim's state_dict
        references its state), copies for a device-resident bucket."""
        return {key: self.view(flat, slot).detach().view(slot.shape).to("cpu")
                for key, flat in zip(STATE_KEYS, self._state())}

    def import_param(self, slot: ParamSlot, values: dict[str, torch.Tensor]) -> None:
        """Copy master / exp_avg / exp_avg_sq of one parameter in, from any device and dtype."""
        for key, flat in zip(STATE_KEYS, self._state()):
            self.view(flat, slot).copy_(values[key].detach().reshape(-1))
        if self.lowp is not None:
            self.view(self.lowp, slot).copy_(self.view(self.master, slot))
