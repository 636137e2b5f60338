"""The flat buffers of one bucket: master weights, Adam moments, gradient staging.

A host bucket's buffers are views into the plan's host arenas (engine/state/arenas.py: one allocation per
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
* `snap_*` (rollback "snapshot", or compact state) master / moments before the speculative step.

Under compact state (plan/memory.py) a host bucket holds `master_bf16`, `master_err`, `exp_avg_q`,
`exp_avg_scale`, `exp_avg_sq_q`, `exp_avg_sq_scale` instead of master / exp_avg / exp_avg_sq
(`state_kinds` says which); `master_bf16` is also the copy-back's source. A parameter's scales
are `[slot.offset / G, ...)` of the scale buffers: every slot starts at a multiple of the group.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from superoffload_hf.plan.memory import COMPACT_KINDS, SCALE_KINDS, STATE_KINDS
from superoffload_hf.plan.buckets import ParamSlot
from superoffload_hf.host.compact import COMPACT_GROUP, scale_numel

# (kind, dtype, pinned[, numel]) -> a new buffer (default: the bucket's numel), counted by the Ledger
Alloc = Callable[..., torch.Tensor]
STATE_KEYS = STATE_KINDS


class BucketBuffers:
    def __init__(self, numel: int, on_host: bool, alloc: Alloc, state_kinds: tuple[str, ...] = STATE_KINDS):
        self.numel = numel
        self.on_host = on_host
        self._alloc = alloc
        self.state_kinds = state_kinds  # STATE_KINDS (fp32), or COMPACT_KINDS (a compact host bucket)
        self.master: Optional[torch.Tensor] = None  # set by BucketSet, kind by kind
        self.exp_avg: Optional[torch.Tensor] = None
        self.exp_avg_sq: Optional[torch.Tensor] = None
        for kind in COMPACT_KINDS:  # (compact host buckets only)
            setattr(self, kind, None)
        self.grad: Optional[torch.Tensor] = None
        self.lowp: Optional[torch.Tensor] = None
        self.recv: Optional[torch.Tensor] = None
        self._snapshot: Optional[tuple[torch.Tensor, ...]] = None

    @staticmethod
    def view(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        return flat[slot.offset:slot.offset + slot.numel]

    @staticmethod
    def kind_view(kind: str, flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        """A slot's part of a buffer of `kind`: its elements, or its groups' scales."""
        if kind in SCALE_KINDS:
            first = slot.offset // COMPACT_GROUP  # slots start at multiples of the group (plan/buckets.py align)
            return flat[first:first + scale_numel(slot.numel)]
        return BucketBuffers.view(flat, slot)

    @property
    def compact(self) -> bool:
        return self.state_kinds is COMPACT_KINDS

    @property
    def copy_back_source(self) -> torch.Tensor:
        """What the copy-back sends: the cast "host" copy, compact state's bf16 master as it is,
        or the fp32 master."""
        if self.lowp is not None:
            return self.lowp
        return self.master_bf16 if self.compact else self.master

    def recv_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The landing buffer (a view of the host arena of its kind, see engine/state/arenas.py)."""
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
        worker runs this during backward, where torch's OpenMP team would compete with it), or
        under compact state its `bytes_copy_` (the six tensors' bytes, any dtype)."""
        if self._snapshot is None:  # plain host memory: snapshots never cross the link
            self._snapshot = tuple(self._alloc("snapshot", t.dtype, False, t.numel()) for t in self._state())
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
        return tuple(getattr(self, kind) for kind in self.state_kinds)

    # ---- per-parameter import / export (checkpoints) --------------------------------------

    def export_param(self, slot: ParamSlot) -> dict[str, torch.Tensor]:
        """The state of one parameter, kind by kind (`state_kinds`), on the CPU: views of the
        live buffers for a host bucket (no copy, as torch.optim's state_dict references its
        state), copies for a device-resident bucket. fp32 master / exp_avg / exp_avg_sq are
        shaped like the parameter; compact kinds are flat (the scales: one per group)."""
        if self.compact:
            return {kind: self.kind_view(kind, flat, slot).detach() for kind, flat in zip(self.state_kinds, self._state())}
        return {key: self.view(flat, slot).detach().view(slot.shape).to("cpu")
                for key, flat in zip(STATE_KEYS, self._state())}

    def import_param(self, slot: ParamSlot, values: dict[str, torch.Tensor]) -> None:
        """Copy one parameter's state in (`values` holds this buffer's `state_kinds`; fp32 kinds
        from any device and dtype, compact kinds in their own dtypes: a bytes copy)."""
        for kind, flat in zip(self.state_kinds, self._state()):
            self.kind_view(kind, flat, slot).copy_(values[kind].detach().reshape(-1))
        if self.lowp is not None:
            self.view(self.lowp, slot).copy_(self.view(self.master, slot))
