"""BucketPlan: which parameters form which bucket, in which order, and where each bucket lives.

Pure data: built from parameter sizes and param-group membership, no tensors and no devices,
so it is deterministic, printable and unit-tested on its own.

* Buckets come in gradient-ready order: the order in which their last gradient arrives during
  backward. Before the first step that order is guessed as the reverse of the parameters'
  order (backward runs the forward in reverse), each param group's parameters spread over the
  whole backward in proportion (the Trainer's groups, decay and no-decay, each list the model's
  parameters in model order: the model order interleaves them); after it, the engine re-plans
  from the order its hooks actually fired in.
* A bucket never mixes param groups (their hyperparameters differ). Each group packs its
  parameters into its own open bucket in ready order, so interleaved groups (decay / no-decay,
  as the HF Trainer builds them) do not fragment the plan into tiny buckets.
* "Deferred" parameters (their gradient arrives more than once per backward, or irregularly)
  go into buckets of their own that are never stepped speculatively; they come last.
* The last `device_buckets` buckets (the first layers, whose gradients arrive last) keep their
  fp32 state on the device and are stepped there.
* `align` > 1 (compact host state: the group of host/compact.py, 32) starts every parameter's
  slot at a multiple of `align` elements, so no group of the per-group scales spans two
  parameters and a parameter's state is the same bytes in any plan. The elements between slots
  ("gaps") are padding: zero in every buffer, never stepped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

BYTES_PER_MB = 2**20
FP32_BYTES = 4
AUTO_BUCKET_MB = 32.0
AUTO_MIN_BUCKETS = 4


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a bucket's flat buffers."""

    index: int  # the parameter's index in the optimizer (its state_dict key)
    offset: int  # first element of the parameter in the bucket's flat buffers
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Bucket:
    index: int
    group: int
    slots: tuple[ParamSlot, ...]
    numel: int
    device_resident: bool
    speculative: bool  # False for deferred parameters: stepped only at step(), after validation

    @property
    def gaps(self) -> tuple[tuple[int, int], ...]:
        """(start, end) of the padding between slots (`align` > 1); () when slots are contiguous."""
        gaps, end = [], 0
        for s in self.slots:
            if s.offset > end:
                gaps.append((end, s.offset))
            end = s.offset + s.numel
        return tuple(gaps)

    @property
    def param_indices(self) -> tuple[int, ...]:
        return tuple(s.index for s in self.slots)

    @property
    def megabytes(self) -> float:
        return self.numel * FP32_BYTES / BYTES_PER_MB


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[Bucket, ...]
    bucket_numel: int
    group_labels: tuple[str, ...] = ()
    align: int = 1  # every slot starts at a multiple of this many elements

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        shapes: Sequence[Sequence[int]],
        groups: Sequence[Sequence[int]],
        *,
        bucket_numel: int,
        device_buckets: int = 0,
        ready_order: Optional[Sequence[int]] = None,
        deferred: Iterable[int] = (),
        group_labels: Sequence[str] = (),
        align: int = 1,
    ) -> "BucketPlan":
        """Plan buckets for parameters `0..len(shapes)-1`.

        `groups[g]` lists the parameter indices of param group g (a partition of all indices).
        `ready_order` lists indices in the order their gradients become ready (default: reverse
        of each group's index order, the groups interleaved in proportion); indices it omits
        follow in reverse index order. `deferred` indices go
        into trailing non-speculative buckets. `align`: every slot starts at a multiple of it
        (padding counts towards `bucket_numel`)."""
        shapes = [tuple(int(d) for d in s) for s in shapes]
        group_of = _group_of(groups, len(shapes))
        _check_positive_int("bucket_numel", bucket_numel)
        _check_count("device_buckets", device_buckets)
        _check_positive_int("align", align)
        order = _guessed_order(group_of) if ready_order is None else _full_order(ready_order, len(shapes))
        deferred = set(deferred)
        packed = _pack([i for i in order if i not in deferred], shapes, group_of, bucket_numel, True, align)
        packed += _pack([i for i in order if i in deferred], shapes, group_of, bucket_numel, False, align)
        n_device = min(device_buckets, len(packed))
        buckets = tuple(
            Bucket(index=k, group=g, slots=slots, numel=_numel(slots),
                   device_resident=k >= len(packed) - n_device, speculative=spec)
            for k, (g, slots, spec) in enumerate(packed)
        )
        return cls(buckets=buckets, bucket_numel=bucket_numel, group_labels=tuple(group_labels), align=align)

    # ---- queries --------------------------------------------------------------------------

    @property
    def num_params(self) -> int:
        return sum(len(b.slots) for b in self.buckets)

    @property
    def num_device_buckets(self) -> int:
        return sum(b.device_resident for b in self.buckets)

    @property
    def total_numel(self) -> int:
        """Elements of every bucket's buffers (padding between slots included)."""
        return sum(b.numel for b in self.buckets)

    @property
    def param_numel(self) -> int:
        """Elements of the parameters themselves (no padding)."""
        return sum(s.numel for b in self.buckets for s in b.slots)

    def locate(self) -> dict[int, tuple[int, ParamSlot]]:
        """Parameter index -> (bucket index, slot)."""
        return {s.index: (b.index, s) for b in self.buckets for s in b.slots}

    def ready_order(self) -> list[int]:
        return [s.index for b in self.buckets for s in b.slots]

    # ---- printing -------------------------------------------------------------------------

    def __str__(self) -> str:
        mb = self.bucket_numel * FP32_BYTES / BYTES_PER_MB
        lines = [
            f"BucketPlan: {len(self.buckets)} buckets, {self.num_params} params, "
            f"{self.total_numel} elements; bucket size {self.bucket_numel} elements ({mb:.3g} MB fp32); "
            f"{self.num_device_buckets} device-resident"
            + (f"; slots aligned to {self.align} elements" if self.align > 1 else ""),
            f"{'bucket':>6}  {'where':<6} {'spec':<4} {'group':>5} {'numel':>12} {'MB':>9}  params",
        ]
        for b in self.buckets:
            where = "device" if b.device_resident else "host"
            lines.append(
                f"{b.index:>6}  {where:<6} {'yes' if b.speculative else 'no':<4} {b.group:>5} "
                f"{b.numel:>12} {b.megabytes:>9.3f}  {_ranges(b.param_indices)}"
            )
        for g, label in enumerate(self.group_labels):
            lines.append(f"group {g}: {label}")
        return "\n".join(lines)


def auto_bucket_numel(bucket_size_mb, total_numel: int, min_buckets: int = AUTO_MIN_BUCKETS) -> int:
    """Elements per bucket for the config's `bucket_size_mb` ("auto": 32 MB, shrunk so that a
    small model still gets at least `min_buckets` buckets)."""
    if bucket_size_mb == "auto":
        full = int(AUTO_BUCKET_MB * BYTES_PER_MB) // FP32_BYTES
        return max(1, min(full, math.ceil(total_numel / max(1, min_buckets))))
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or not bucket_size_mb > 0:
        raise ValueError(f"`bucket_size_mb` is {bucket_size_mb!r}; expected \"auto\" or a number > 0.")
    return max(1, int(bucket_size_mb * BYTES_PER_MB) // FP32_BYTES)


# ---- helpers --------------------------------------------------------------------------------


def _pack(order, shapes, group_of, bucket_numel, speculative, align=1):
    """Pack indices into per-group buckets; return (group, slots, speculative) sorted by the
    position at which each bucket's last parameter arrives. Sizes count the padding to `align`."""
    open_buckets: dict[int, tuple[int, list[int]]] = {}  # group -> (last position, indices)
    closed: list[tuple[int, int, list[int]]] = []  # (completion position, group, indices)
    for position, i in enumerate(order):
        g = group_of[i]
        last, current = open_buckets.get(g, (position, []))
        if current and _padded(_sum_numel(current, shapes, align), align) + _prod(shapes[i]) > bucket_numel:
            closed.append((last, g, current))
            current = []
        open_buckets[g] = (position, current + [i])
    closed += [(last, g, current) for g, (last, current) in open_buckets.items()]
    closed.sort(key=lambda c: c[0])
    return [(g, _slots(indices, shapes, align), speculative) for _, g, indices in closed]


def _slots(indices, shapes, align=1) -> tuple[ParamSlot, ...]:
    slots, offset = [], 0
    for i in indices:
        n = _prod(shapes[i])
        offset = _padded(offset, align)
        slots.append(ParamSlot(index=i, offset=offset, numel=n, shape=shapes[i]))
        offset += n
    return tuple(slots)


def _padded(numel: int, align: int) -> int:
    return -(-numel // align) * align


def _guessed_order(group_of: Sequence[int]) -> list[int]:
    """Reverse index order within each group; across groups, by the fraction of its group a
    parameter closes (a group's last parameter ~ the model's last), latest first. One group:
    plain reverse index order."""
    sizes: dict[int, int] = {}
    for g in group_of:
        sizes[g] = sizes.get(g, 0) + 1
    seen: dict[int, int] = {}
    key = []
    for i, g in enumerate(group_of):
        seen[g] = seen.get(g, 0) + 1
        key.append((seen[g] / sizes[g], i))
    return sorted(range(len(group_of)), key=lambda i: key[i], reverse=True)


def _full_order(ready_order, n: int) -> list[int]:
    order = [int(i) for i in ready_order]
    bad = [i for i in order if not 0 <= i < n]
    if bad or len(set(order)) != len(order):
        raise ValueError(
            f"`ready_order` must list distinct parameter indices in [0, {n}); got out-of-range "
            f"{bad[:5]} or duplicates in {order[:10]}..."
        )
    seen = set(order)
    return order + [i for i in range(n - 1, -1, -1) if i not in seen]


def _group_of(groups, n: int) -> list[int]:
    group_of = [-1] * n
    for g, indices in enumerate(groups):
        for i in indices:
            if not 0 <= i < n or group_of[i] != -1:
                raise ValueError(
                    f"Parameter index {i} in group {g} is out of range [0, {n}) or appears in two "
                    "groups; each parameter must belong to exactly one param group."
                )
            group_of[i] = g
    missing = [i for i, g in enumerate(group_of) if g == -1]
    if missing:
        raise ValueError(f"Parameters {missing[:10]} belong to no param group; `groups` must cover every index.")
    return group_of


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` is {value!r}; expected an integer >= 1 (elements per bucket).")


def _check_count(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` is {value!r}; expected an integer >= 0.")


def _prod(shape) -> int:
    return math.prod(shape) if shape else 1


def _sum_numel(indices, shapes, align=1) -> int:
    """Elements of slots `indices` packed in order, the padding between them included."""
    end = 0
    for i in indices:
        end = _padded(end, align) + _prod(shapes[i])
    return end


def _numel(slots) -> int:
    """Elements of a bucket's buffers: up to the end of its last slot (padding between slots included)."""
    return slots[-1].offset + slots[-1].numel if slots else 0


def _ranges(indices: Sequence[int]) -> str:
    """[9, 8, 7, 3, 4] -> "9-7,3-4": runs of consecutive indices, in the bucket's order."""
    runs: list[list[int]] = []
    for i in indices:
        run = runs[-1] if runs else None
        if run and (abs(i - run[-1]) == 1) and (len(run) == 1 or i - run[-1] == run[-1] - run[-2]):
            run.append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
