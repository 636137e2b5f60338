"""Data-parallel communication: the only module of the package that calls torch.distributed
collectives. NCCL between GPUs, gloo on CPUs.

Ranks form a grid: the *shard group* (default: every rank; or the `process_group` given to the
optimizer, e.g. the GPUs of one node) splits each bucket's host state into one shard per member;
the *replica groups* (rank j of every shard group) hold identical copies of shard j. Per step:

* `reduce_scatter_mean`: a completed bucket's flat gradient (link dtype, on the device) summed
  within the shard group into the rank's shard, then, with replicas, summed over its replica
  group, and divided by the world size: the average over *all* ranks, as DDP computes it.
  gloo without reduce-scatter falls back to an all-reduce of the whole bucket and a slice (twice
  the traffic of a reduce-scatter, and the whole sum on every rank).
* `all_gather`: the updated shards (the parameters' dtype) into the whole bucket, from the host
  worker thread; `all_gather_training`: the same from the training thread, on the same group
  (weight-flow's fetch of a unit's buckets, before its forward and again before its backward).
* `all_reduce_sum`: one float64 scalar (the sum of squares of the rank's shards) over the shard
  group: replicas hold the same shards and must not be counted twice.
* `all_reduce_mean` (device-resident buckets are replicated, not sharded) and `broadcast`: over
  the world.
* `all_reduce_presence`: which parameters have a gradient on any rank, over the world, on the
  *control group*, a gloo group no other collective uses: the vector lives on the host (no device
  synchronization, and no second NCCL communicator interleaving with reduce-scatters in flight).

Ordering. Collectives on one process group pair up by their order on each rank: ranks that issue
them in different orders deadlock, fail on a size mismatch, or silently exchange the wrong
tensors of equal size. So the training thread and the host worker thread use separate process
groups (`dist.new_group`), and each group's collectives are issued in one order on every rank
(the engine's contract, engine/dp/route.py): the training thread's reduce-scatters in the plan's bucket
order, whichever order this rank's gradients completed in (zeros for the gradients it lacks),
then presence, the late buckets, the device buckets and the norm; the worker's all-gathers in
job order (the same validated copy-backs, in bucket order, everywhere). On gloo a collective
blocks its caller until every peer has issued it: a rank issues everything a peer may already
wait for (its remaining reduce-scatters) before a collective on another group.

Across the two threads (NCCL requires the collectives of different communicators to be issued in
one order on every rank, or kernels of two communicators can wait for each other on a GPU): every
collective is issued holding `issue_lock`, and a training-thread collective first runs
`queued_gathers` (engine/dp/route.py: the first one of a step waits until the worker has issued every
all-gather the last step queued). So the order on every rank is: step t's reduce-scatters, control
and norm collectives (training thread), then its all-gathers (worker, job order), then step t+1's;
never an interleaving that depends on thread timing. Collectives this module does not issue (the
Trainer's token count on the default group every step, accelerate's barriers, user code) cannot
take the lock: step() returns only once the worker has issued the step's all-gathers
(DataParallel.wait_for_queued_gathers), so they come after them on every rank.

Communicators are created eagerly: `create` (the training thread, inside the optimizer's
constructor) creates every group in one order on every rank and issues one warm-up collective on
each of this rank's groups in that order (`warm_up`): NCCL creates a communicator lazily at its
first collective, which would otherwise happen in the worker thread for the gather group, at a
moment that depends on timing.
"""

from __future__ import annotations

import dataclasses
import contextlib
import datetime
import logging
import socket
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

logger = logging.getLogger("superoffload_hf")


@dataclass(frozen=True)
class Topology:
    """Where this rank sits in the (replica x shard) grid. Pure data."""

    world: int  # every rank
    rank: int  # global rank
    shard_world: int  # ranks that split the state (the shard group's size)
    shard_rank: int  # this rank's shard index
    shard_groups: tuple[tuple[int, ...], ...]  # every shard group's global ranks, sorted
    local_rank: int = 0  # among the ranks on this host
    local_world: int = 1  # ranks on this host
    local_numa_nodes: tuple = ()  # per local rank: the NUMA node of its device (None: unknown)

    @property
    def replicas(self) -> int:
        return self.world // self.shard_world

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(g[j] for g in self.shard_groups) for j in range(self.shard_world))

    @classmethod
    def from_groups(cls, world: int, rank: int, groups: Sequence[Sequence[int]]) -> "Topology":
        """`groups`: every rank's shard-group ranks (one entry per rank, duplicates expected)."""
        unique = tuple(sorted({tuple(sorted(int(r) for r in g)) for g in groups}))
        covered = sorted(r for g in unique for r in g)
        if covered != list(range(world)):
            raise ValueError(
                f"The `process_group`s given to the optimizer on the {world} ranks are {list(unique)}: "
                "they must partition the ranks (every rank in exactly one group). Pass each rank the group "
                "it belongs to, e.g. from `dist.new_subgroups()`.")
        sizes = {len(g) for g in unique}
        if len(sizes) != 1:
            raise ValueError(f"The optimizer's process groups {list(unique)} differ in size; every shard group "
                             "must have the same number of ranks (e.g. the GPUs of one node each).")
        mine = next(g for g in unique if rank in g)
        return cls(world, rank, len(mine), mine.index(rank), unique)


_EXIT_TEARDOWN: list = []  # the one object whose finalizer destroys the process groups at exit
_LIVE: "weakref.WeakSet[Collectives]" = weakref.WeakSet()  # released at exit, before the groups are destroyed


def destroy_process_groups_at_exit() -> None:
    """Destroy every process group at interpreter exit, while the interpreter is still whole.

    A script that never calls `destroy_process_group` (transformers' Trainer and accelerate do
    not) leaves its gloo groups to the interpreter's finalization, where their worker threads free
    tensors that need the GIL: the process aborts with "terminate called without an active
    exception" (SIGABRT, exit code -6) after training succeeded (pytorch/pytorch#190489; seen
    intermittently in the two-process launcher test). A `weakref.finalize`, not `atexit`: weakref's exit hook
    runs finalizers newest first, so this one, registered when the first group of ours is made,
    runs after the optimizers' own finalizers (created after it), whose close() may still issue
    collectives (a data-parallel flow's gather). A gloo group's threads end only when its last
    Python reference goes, not at `destroy_process_group`: every `Collectives` drops its groups
    first (`release()`), so that they end here, not in the interpreter's finalization."""
    if _EXIT_TEARDOWN:
        return
    anchor = _ExitAnchor()
    _EXIT_TEARDOWN.append(anchor)  # lives until exit
    weakref.finalize(anchor, _destroy_process_groups)


class _ExitAnchor:
    pass


def _destroy_process_groups() -> None:
    import torch.distributed as dist

    for collectives in list(_LIVE):
        collectives.release()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class QueuedGathers:
    """A port between the sharded route and the collectives: the route arms it (a weak reference
    to its wait) when the worker may hold all-gathers not issued yet; the next training-thread
    collective runs that wait once, first."""

    def __init__(self):
        self._armed: Optional[Callable[[], Optional[Callable[[], None]]]] = None

    def arm(self, wait_ref: Callable[[], Optional[Callable[[], None]]]) -> None:
        self._armed = wait_ref

    def wait(self) -> None:
        armed, self._armed = self._armed, None
        wait = armed() if armed is not None else None
        if wait is not None:
            wait()


class Collectives:
    """Process groups for one optimizer, and the collectives the engine issues on them."""

    def __init__(self, topology: Topology, grad_group, gather_group, replica_group, world_group,
                 control_group, backend: str):
        self.topology = topology
        self.grad_group = grad_group  # training thread, shard group
        self.gather_group = gather_group  # host worker thread, shard group
        self.replica_group = replica_group  # training thread; None without replicas
        self.world_group = world_group  # training thread, every rank
        self.control_group = control_group  # training thread, every rank, gloo: presence only
        self.backend = backend  # of the data groups (the control group is gloo)
        self.has_reduce_scatter = True  # False after gloo refused one (see reduce_scatter_mean)
        self.issue_lock = threading.Lock()  # held while a collective is issued (module docstring)
        # what a training-thread collective runs first (engine/dp/route.py arms it: queued all-gathers)
        self.queued_gathers = QueuedGathers()
        self.released = False
        _LIVE.add(self)

    def release(self) -> None:
        """Drop this rank's process groups (close(), and exit before the groups are destroyed):
        a gloo group's threads end with its last reference. Any later collective raises."""
        self.released = True
        self.grad_group = self.gather_group = self.replica_group = self.world_group = self.control_group = None
        _LIVE.discard(self)

    @classmethod
    def create(cls, process_group=None, timeout: Optional[datetime.timedelta] = None,
               numa_node: Optional[int] = None) -> Optional["Collectives"]:
        """None when this process trains alone (no process group, or a world of one rank and no
        `process_group`). Every rank must call this at the same point (it creates groups).
        `numa_node`: of this rank's device, shared with the other ranks of its host."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None:
                raise ValueError("`process_group` was given but torch.distributed is not initialised; call "
                                 "`torch.distributed.init_process_group` first (torchrun / accelerate launch do).")
            return None
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:
            return None
        destroy_process_groups_at_exit()
        own = list(range(world)) if process_group is None else dist.get_process_group_ranks(process_group)
        if rank not in own:
            raise ValueError(f"Rank {rank} is not a member of the `process_group` given to the optimizer "
                             f"(ranks {own}); pass each rank the group it belongs to.")
        everyone: list = [None] * world
        host = socket.gethostname()
        dist.all_gather_object(everyone, (own, host, numa_node))  # every rank's group (new_group is collective)
        topology = Topology.from_groups(world, rank, [g for g, _, _ in everyone])
        local = [r for r in range(world) if everyone[r][1] == host]
        topology = dataclasses.replace(topology, local_rank=local.index(rank), local_world=len(local),
                                       local_numa_nodes=tuple(everyone[r][2] for r in local))
        kw = {} if timeout is None else {"timeout": timeout}

        def groups_for(member_lists, **backend):
            mine = None
            for ranks in member_lists:  # every rank creates every group, in the same order
                group = dist.new_group(list(ranks), **kw, **backend)
                if rank in ranks:
                    mine = group
            return mine

        grad_group = groups_for(topology.shard_groups)
        gather_group = groups_for(topology.shard_groups)
        replica_group = groups_for(topology.replica_groups()) if topology.replicas > 1 else None
        world_group = grad_group if topology.replicas == 1 else groups_for([tuple(range(world))])
        control_group = groups_for([tuple(range(world))], backend="gloo")
        collectives = cls(topology, grad_group, gather_group, replica_group, world_group, control_group,
                          dist.get_backend(grad_group))
        collectives.warm_up()
        return collectives

    def groups(self) -> list[tuple[str, object]]:
        """This rank's process groups, by role, in creation order (each once)."""
        named = [("grad", self.grad_group), ("gather", self.gather_group), ("replica", self.replica_group),
                 ("world", self.world_group), ("control", self.control_group)]
        seen, out = set(), []
        for name, group in named:
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                out.append((name, group))
        return out

    def warm_up(self) -> None:
        """One small all-reduce on each of this rank's groups, in creation order, from the calling
        (training) thread: every communicator exists before training starts (NCCL would create
        the gather group's lazily, in the worker thread), created in the same order on every rank."""
        import torch.distributed as dist

        with self._issuing():
            for name, group in self.groups():
                device = torch.device("cpu") if name == "control" else self._device(group)
                dist.all_reduce(torch.zeros(1, device=device), group=group)

    @contextlib.contextmanager
    def _issuing(self, training: bool = True):
        """Around every collective: the training thread's wait for the worker's queued ones
        (`queued_gathers`), then the lock that keeps the two threads' collectives apart."""
        if self.released:  # group=None would silently mean the default group
            raise RuntimeError("SuperOffload: a collective of a closed optimizer (its process groups were released "
                               "at close() or at exit); build a new optimizer to keep training.")
        if training:
            self.queued_gathers.wait()
        with self.issue_lock:
            yield

    @property
    def world(self) -> int:
        return self.topology.world

    def describe(self) -> str:
        t = self.topology
        replicas = f" x {t.replicas} replicas" if t.replicas > 1 else ""
        return f"rank {t.rank}/{t.world}, shard {t.shard_rank} of {t.shard_world}{replicas} ({self.backend})"

    # ---- training thread ------------------------------------------------------------------

    def reduce_scatter_mean(self, flat_dev: torch.Tensor, shard_dev: torch.Tensor) -> None:
        """`shard_dev` := this rank's shard of the mean over all ranks of `flat_dev` (whose length
        is shard_world x shard_dev's). Summed in flat_dev's dtype, then divided once."""
        import torch.distributed as dist

        with self._issuing():
            self._reduce_scatter_sum(dist, flat_dev, shard_dev)
        shard_dev.div_(self.world)

    def _reduce_scatter_sum(self, dist, flat_dev: torch.Tensor, shard_dev: torch.Tensor) -> None:
        if self.has_reduce_scatter:
            try:
                _reduce_scatter(dist)(shard_dev, flat_dev, group=self.grad_group)
            except (RuntimeError, NotImplementedError) as error:  # a gloo without reduce-scatter
                unsupported = isinstance(error, NotImplementedError) or "support" in str(error).lower()
                if self.backend != "gloo" or not unsupported:  # a peer failed: not a capability
                    raise
                logger.warning("SuperOffload: %s has no reduce-scatter (%s); using all-reduce + slice "
                               "(2x the gradient traffic)", self.backend, str(error).splitlines()[0])
                self.has_reduce_scatter = False
        if not self.has_reduce_scatter:
            dist.all_reduce(flat_dev, group=self.grad_group)  # every rank gets the whole sum
            n = shard_dev.numel()
            start = self.topology.shard_rank * n
            shard_dev.copy_(flat_dev[start:start + n])
        if self.replica_group is not None:
            dist.all_reduce(shard_dev, group=self.replica_group)

    def all_reduce_sum(self, value: float) -> float:
        """The float64 sum over the shard group of one scalar per rank (a host sync on NCCL)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=self._device(self.grad_group))
        with self._issuing():
            dist.all_reduce(t, group=self.grad_group)
        return float(t.item())

    def all_reduce_presence(self, flags: torch.Tensor) -> torch.Tensor:
        """Element-wise "any rank" of a 0/1 vector (int32, on the host), over every rank, on the
        control group (host memory: no device synchronization)."""
        import torch.distributed as dist

        t = flags.to(device="cpu", dtype=torch.int32, copy=True)
        with self._issuing():
            dist.all_reduce(t, group=self.control_group)
        return t > 0

    def all_ranks_true(self, flag: bool) -> bool:
        """Whether `flag` is true on every rank (the control group, host memory)."""
        return not bool(self.all_reduce_presence(torch.tensor([not flag]))[0])

    def broadcast_ints(self, values: Sequence[int], length: int, src: int = 0) -> list[int]:
        """Global rank `src`'s list of at most `length` non-negative ints, on every rank, over the
        control group (host memory)."""
        import torch.distributed as dist

        t = torch.full((length,), -1, dtype=torch.int64)
        t[:len(values)] = torch.tensor(list(values), dtype=torch.int64)
        with self._issuing():
            dist.broadcast(t, src=src, group=self.control_group)
        return [int(v) for v in t.tolist() if v >= 0]

    def all_reduce_mean(self, tensor: torch.Tensor) -> None:
        """In place: the mean over every rank (a replicated, device-resident bucket's gradient)."""
        import torch.distributed as dist

        with self._issuing():
            dist.all_reduce(tensor, group=self.world_group)
        tensor.div_(self.world)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Global rank `src`'s values into `tensors` on every rank (e.g. initial weights, as DDP)."""
        import torch.distributed as dist

        with self._issuing():
            for t in tensors:
                dist.broadcast(t, src=src, group=self.world_group)

    def barrier(self) -> None:
        import torch.distributed as dist

        with self._issuing():
            dist.barrier(group=self.world_group)

    def broadcast_object(self, obj, src: int = 0):
        import torch.distributed as dist

        box = [obj]
        with self._issuing():
            dist.broadcast_object_list(box, src=src, group=self.world_group)
        return box[0]

    def all_gather_training(self, shard_dev: torch.Tensor, flat_dev: torch.Tensor) -> None:
        """As `all_gather`, from the training thread (weight-flow's fetches), on the gather group:
        a fetch pairs only with the same fetch on every rank (units in model order), never with a
        reduce-scatter, whatever gradients a rank lacks; the worker's all-gathers on that group
        (step()'s copy-backs) are all issued before it (`queued_gathers`)."""
        import torch.distributed as dist

        with self._issuing():
            _all_gather(dist)(flat_dev, shard_dev, group=self.gather_group)

    # ---- host worker thread ---------------------------------------------------------------

    def all_gather(self, shard_dev: torch.Tensor, flat_dev: torch.Tensor) -> None:
        """`flat_dev` := every shard of the shard group, in shard order."""
        import torch.distributed as dist

        with self._issuing(training=False):
            _all_gather(dist)(flat_dev, shard_dev, group=self.gather_group)

    def _device(self, group) -> torch.device:
        if self.backend == "nccl":  # the current accelerator (NCCL is CUDA's), through the generic API
            from superoffload_hf.device.accelerator import _accelerator_api

            index = _accelerator_api("current_device_index", "current_device_idx")()
            return torch.device(torch.accelerator.current_accelerator().type, index)
        return torch.device("cpu")


def _reduce_scatter(dist):
    # torch >= 2.10 names the tensor collectives *_single (the *_tensor names warn)
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather(dist):
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
