"""What `speculation: auto` trades for compact state's rollback snapshot: a value computed once.

Compact state cannot be rolled back algebraically (quantisation is not invertible), so a bucket
stepped speculatively first copies its pre-step bytes aside (engine/state/buffers.py take_snapshot):
another 5.125 B/param of plain host memory for every bucket that ever speculates (kept once
taken), and each speculative step copies those bytes (read + write: 2 x 5.125 B/param) on the
host while backward runs. Speculation pays where that overlaps the backward: the host work of a
speculated bucket (its snapshot copy and its step) runs during backward instead of after it, so
it saves the exposed host step unless the copies themselves outlast the backward.

`snapshot_trade` decides how many host buckets (the first ones in the plan's ready order: the
earliest gradients, the most overlap) `auto` lets speculate:
* memory: as many as the host memory left after the rest of the footprint holds snapshots of
  (all of them where it fits; none where none does);
* time (once the first step measured the host step rate and the backward): none where copying
  the snapshots of those buckets takes at least as long as the backward they would overlap.
"on" speculates every host bucket, "off" none, fp32 state needs no snapshot (except `rollback:
snapshot`, which the user chose): the decision is theirs then. The engine computes it at
construction (memory) and again after the first step (memory and time); the dry run prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from superoffload_hf.plan.memory import BufferPolicy, _size
from superoffload_hf.plan.buckets import BucketPlan


@dataclass(frozen=True)
class SnapshotTrade:
    host_buckets: int
    speculated_buckets: int  # the first this-many host buckets of the plan may speculate
    allowed: frozenset  # their bucket indices
    snapshot_bytes: int  # the snapshots of those buckets (plain host memory, kept once taken)
    full_snapshot_bytes: int  # of every host bucket
    copy_bytes_per_step: int  # host memory traffic of taking the snapshots memory allows (read + write)
    copy_seconds_per_step: Optional[float]  # at the measured host bandwidth (None: not measured yet)
    backward_seconds: Optional[float]  # what the copies overlap (None: not measured yet)
    reason: str
    applies: bool = True  # compact state under `speculation: auto`; else the user's mode decides

    @property
    def snapshot_buckets(self) -> Optional[frozenset]:
        """For memory.footprint: the buckets whose snapshot to count (None: every one, as the
        policy says, where the user's mode decides)."""
        return self.allowed if self.applies else None

    def allows(self, bucket_index: int) -> bool:
        """Whether the host bucket `bucket_index` (of the plan it was decided for) may speculate."""
        return bucket_index in self.allowed

    def describe(self, num_params: int) -> str:
        per_param = self.full_snapshot_bytes / max(num_params, 1)
        when = ("" if self.copy_seconds_per_step is None
                else f", {self.copy_seconds_per_step * 1e3:.1f} ms per step against a {self.backward_seconds * 1e3:.1f} ms backward")
        return (f"speculation snapshot {self.full_snapshot_bytes / 1e9:.3f} GB ({per_param:.3f} B/param), "
                f"{self.copy_bytes_per_step / 1e9:.3f} GB copied per speculative step{when}; speculates "
                f"{self.speculated_buckets} of {self.host_buckets} host buckets ({self.reason})")


def bucket_snapshot_bytes(plan: BucketPlan, policy: BufferPolicy) -> list[int]:
    """Per host bucket, in plan order: the bytes of its snapshot (its state kinds' buffers)."""
    kinds = policy.host_kinds()
    return [sum(policy.kind_numel(kind, policy.host_numel(b.numel)) * _size(kinds[kind][0])
                for kind in policy.state_kinds)
            for b in plan.buckets if not b.device_resident]


def snapshot_trade(plan: BucketPlan, policy: BufferPolicy, mode: str, *, memory_left: Optional[int] = None,
                   other_bytes: int = 0, host_bytes_per_second: Optional[float] = None,
                   backward_seconds: Optional[float] = None, overlaps: bool = True) -> SnapshotTrade:
    """The decision (module docstring). `overlaps`: False on the CPU device, where auto never
    speculates (engine/step/validate.py SpeculationPolicy: nothing to overlap), so no snapshot is kept. `memory_left`: host bytes this process may still use
    before the engine allocates (None: unknown, no limit); `other_bytes`: what the engine needs
    of it besides the snapshots (the rest of the footprint and the re-plan's transient);
    `host_bytes_per_second`: the host memory bandwidth the host step reached (measured)."""
    sizes = bucket_snapshot_bytes(plan, policy)
    indices = [b.index for b in plan.buckets if not b.device_resident]
    full = sum(sizes)
    applies = policy.compact and mode == "auto"
    if not applies:
        count = len(sizes) if mode != "off" and policy.snapshot else 0
        reason = (f"speculation {mode}" if policy.compact else
                  "rollback snapshot" if policy.snapshot else "fp32 state: rolled back in place, no snapshot")
        return _trade(sizes, indices, count, full, None, None, reason, applies=False)
    count, reason = len(sizes), "the snapshots fit"
    if not overlaps:
        return _trade(sizes, indices, 0, full, None, None, "the device is the CPU: auto never speculates there")
    if memory_left is not None:
        budget = memory_left - other_bytes
        held = 0
        for count, size in enumerate(sizes + [None]):
            if size is None or held + size > budget:
                break
            held += size
        if count < len(sizes):
            reason = (f"host memory: {max(budget, 0) / 1e9:.3f} GB left for snapshots of "
                      f"{full / 1e9:.3f} GB")
    copy_bytes, copy_s = 2 * sum(sizes[:count]), None
    if host_bytes_per_second and backward_seconds is not None:
        copy_s = copy_bytes / host_bytes_per_second
        if count and copy_s >= backward_seconds:
            reason = (f"copying the snapshots takes {copy_s * 1e3:.1f} ms, no less than the "
                      f"{backward_seconds * 1e3:.1f} ms backward they would overlap")
            count = 0
    return _trade(sizes, indices, count, full, copy_s, backward_seconds, reason, copy_bytes=copy_bytes)


def _trade(sizes: Sequence[int], indices: Sequence[int], count: int, full: int, copy_s, backward_s, reason: str,
           applies: bool = True, copy_bytes: Optional[int] = None) -> SnapshotTrade:
    taken = sum(sizes[:count])
    return SnapshotTrade(host_buckets=len(sizes), speculated_buckets=count, allowed=frozenset(indices[:count]),
                         snapshot_bytes=taken,
                         full_snapshot_bytes=full, copy_bytes_per_step=2 * taken if copy_bytes is None else copy_bytes, copy_seconds_per_step=copy_s,
                         backward_seconds=backward_s, reason=reason, applies=applies)
