"""Record the collectives a process issues, per communicator, and compare the records of ranks.

NCCL pairs the collectives of one communicator (process group) by their issue order on each rank,
and needs the collectives of *different* communicators issued in one order on every rank too:
kernels of two communicators queued in opposite orders on two GPUs wait for each other (a hang).
gloo runs each collective to completion in its caller and does not hang on the second kind, so a
CPU test sees only what `compare` reports.

`install()` wraps torch.distributed's collectives (the module's functions, which
torch.distributed.distributed_c10d's own object collectives also call): each call records the
communicator (its name, which torch numbers in creation order, the same on every rank, and its
ranks), the operation, the shape of its first tensor and the thread, at the moment it is called
(before it blocks). Nested calls (all_gather_object's all_gathers) are recorded once, as the outer
call. Not seen: point-to-point operations (send/recv pair unequal operations by design), functional
collectives (torch.distributed._functional_collectives, DTensor, torch.compile) and functions bound
by name before `install()` (`from torch.distributed import all_reduce`).
"""

from __future__ import annotations

import inspect
import threading
from typing import NamedTuple, Optional, Sequence

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "barrier", "monitored_barrier",
               "all_gather_object", "broadcast_object_list", "gather", "gather_object", "scatter",
               "scatter_object_list", "reduce", "all_to_all", "all_to_all_single")


class Event(NamedTuple):
    group: str  # the communicator's name (creation order)
    ranks: tuple  # its global ranks
    op: str
    shape: tuple  # of the first tensor argument; () without one
    thread: str

    def where(self) -> str:
        return f"{self.op}{list(self.shape)} on group {self.group} {list(self.ranks)} ({self.thread})"


class Recorder:
    """What `install()` returns: `events` in issue order; `uninstall()` restores torch.distributed."""

    def __init__(self):
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._nested = threading.local()
        self._originals: list[tuple[object, str, object]] = []

    def uninstall(self) -> None:
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)
        recorder = self

        def recording(*args, **kwargs):
            depth = getattr(recorder._nested, "depth", 0)
            if depth == 0:
                bound = signature.bind_partial(*args, **kwargs)
                event = _event(name, bound.arguments)
                with recorder._lock:
                    recorder.events.append(event)
            recorder._nested.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                recorder._nested.depth = depth

        recording.__wrapped__ = original
        return recording


def install() -> Recorder:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    recorder = Recorder()
    for name in COLLECTIVES:
        original = getattr(distributed_c10d, name, None) or getattr(dist, name, None)
        if original is None:
            continue
        wrapped = recorder._wrap(name, original)
        for module in (dist, distributed_c10d):
            if hasattr(module, name):
                recorder._originals.append((module, name, getattr(module, name)))
                setattr(module, name, wrapped)
    return recorder


def _event(op: str, arguments: dict) -> Event:
    import torch
    import torch.distributed as dist

    group = arguments.get("group")
    group = dist.group.WORLD if group is None else group
    shape: tuple = ()
    for value in arguments.values():
        first = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(first, torch.Tensor):
            shape = tuple(first.shape)
            break
    return Event(str(group.group_name), tuple(dist.get_process_group_ranks(group)), op, shape,
                 threading.current_thread().name)


def compare(per_rank: Sequence[Sequence[Event]]) -> Optional[str]:
    """None when every communicator's collectives (operation and shape) are the same sequence on
    each of its ranks, and for every two communicators, their collectives interleave in one order
    on every rank holding both; else what differs first, naming the ranks and the collectives."""
    per_rank = [[Event(*e) for e in events] for events in per_rank]
    groups: dict[str, tuple] = {}
    for events in per_rank:
        for e in events:
            groups.setdefault(e.group, e.ranks)
    for name, ranks in sorted(groups.items()):
        sequences = {r: [(e.op, e.shape) for e in per_rank[r] if e.group == name] for r in ranks if r < len(per_rank)}
        problem = _first_difference(sequences, f"group {name} {list(ranks)}: the collectives differ")
        if problem:
            return problem
    names = sorted(groups)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            both = [r for r in groups[a] if r in groups[b] and r < len(per_rank)]
            sequences = {r: [e for e in per_rank[r] if e.group in (a, b)] for r in both}
            problem = _first_difference(
                {r: [e.group for e in s] for r, s in sequences.items()},
                f"groups {a} {list(groups[a])} and {b} {list(groups[b])}: their collectives interleave in "
                "different orders on different ranks (on NCCL a hang)", detail=sequences)
            if problem:
                return problem
    return None


def _first_difference(sequences: dict, what: str, detail: Optional[dict] = None) -> Optional[str]:
    if len(sequences) < 2:
        return None
    (r0, s0), *rest = sequences.items()
    for r, s in rest:
        if s == s0:
            continue
        at = next((i for i, (x, y) in enumerate(zip(s0, s)) if x != y), min(len(s0), len(s)))
        show = detail or sequences
        around = {k: [e.where() if isinstance(e, Event) else e for e in show[k][max(0, at - 2):at + 3]]
                  for k in (r0, r)}
        return (f"{what}: ranks {r0} and {r} first differ at position {at} (of {len(s0)} and {len(s)}); "
                f"from position {max(0, at - 2)}: rank {r0}: {around[r0]}; rank {r}: {around[r]}")
    return None
