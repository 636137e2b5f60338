"""A flat gradient given as consecutive segments: the tensors autograd produced, read in place.

On the CPU device with fp32 parameters, copying every gradient into a bucket's flat fp32 buffer
would cost a few percent of a training step; the host Adam reads them where they are instead.
Segment k covers elements ``[offsets[k], offsets[k] + numels[k])`` of the bucket's flat state.
A segment may be absent (None: that parameter has no gradient this step): it counts as zeros in
``sum_squares`` and must not be stepped (the engine's runs only cover present parameters).

Slicing by element offsets, at segment boundaries only (run boundaries are slot boundaries),
gives the segments of that range; both host Adam back ends take a SegmentedGrad wherever they
take a flat gradient.
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

import torch


class SegmentedGrad:
    def __init__(self, segments: Sequence[Optional[torch.Tensor]], numels: Sequence[int]):
        if len(segments) != len(numels):
            raise ValueError(f"{len(segments)} segments but {len(numels)} numels; give one numel per segment.")
        for k, (g, n) in enumerate(zip(segments, numels)):
            if g is not None and g.numel() != n:
                raise ValueError(f"segment {k} has {g.numel()} elements, expected {n}.")
        self.segments = tuple(segments)
        self.numels = tuple(int(n) for n in numels)
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)

    def numel(self) -> int:
        return self.offsets[-1]

    def __len__(self) -> int:
        return self.numel()

    def __getitem__(self, s: slice) -> "SegmentedGrad":
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError(f"a SegmentedGrad is sliced by a contiguous element range, got {s!r}.")
        start, stop, _ = s.indices(self.numel())
        first, last = self._boundary(start), self._boundary(max(start, stop))
        return SegmentedGrad(self.segments[first:last], self.numels[first:last])

    def _boundary(self, offset: int) -> int:
        k = bisect.bisect_left(self.offsets, offset)
        if k >= len(self.offsets) or self.offsets[k] != offset:
            raise ValueError(f"offset {offset} is not a segment boundary (boundaries: {self.offsets}); "
                             "a SegmentedGrad is sliced at whole parameters only.")
        # empty segments share a boundary with their neighbour: a slice starting there keeps them
        return k

    def present(self) -> list[torch.Tensor]:
        """The segments with a gradient (for a sum of squares: the absent ones are zeros)."""
        return [g for g in self.segments if g is not None]

    def tensors(self) -> list[torch.Tensor]:
        """Every segment, for a step; raises if one is absent (it has no gradient to step with)."""
        absent = [k for k, (g, n) in enumerate(zip(self.segments, self.numels)) if g is None and n]
        if absent:
            raise ValueError(f"segments {absent} are absent (no gradient this step); a step covers "
                             "only parameters that have one.")
        return [g for g in self.segments if g is not None]  # an absent empty segment covers nothing

    def cat(self) -> torch.Tensor:
        """The flat gradient (absent segments as zeros): a copy, for the reference back end."""
        parts = [g.reshape(-1) if g is not None else torch.zeros(n, dtype=torch.float32)
                 for g, n in zip(self.segments, self.numels)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)
