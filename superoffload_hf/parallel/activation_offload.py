"""Activation offload (DESIGN.md section 12): under gradient checkpointing every decoder block
keeps one tensor for its backward, its input (Llama-3.1-8B at 512K tokens: 4 GB a block, 128 GB
in all). Each block's input goes to pinned host memory on a side stream as the forward produces
it, its device copy is freed once that copy has run, and it comes back in reverse block order,
`depth` blocks ahead of the recomputation that reads it:

    forward, block i:   compute waits copied(i-1); input i-1's device copy is dropped (freed)
                        ready(i) on compute -> d2h waits it -> copy input i to pinned host -> copied(i)
    backward, block i:  its recomputation unpacks input i: prefetch inputs i-1 .. i-depth
                        (allocated on compute; h2d waits an event of compute; copy; fetched(j));
                        compute waits fetched(i); the recomputation reads it

The last checkpointed block's input stays on the device (its backward comes first). Nothing here
blocks the host: every wait is a stream's wait on an event.

Finding the inputs: a saved-tensors hook (torch.autograd.graph.saved_tensors_hooks) is active
during the model's forward, pushed by a forward pre-hook of the model and popped by its forward
hook (which also runs when the forward raises). Inside a checkpointed block torch's checkpoint
hook is the innermost one, so what reaches ours is what the checkpoint saves of each block (its
input) and what the layers outside the blocks save (the final norm, the head, the loss: they
stay). Each block's forward pre-hook names its input tensors, and the saved tensor that *is* one
of them (identity, not equality) is offloaded. transformers 5.24 checkpoints `forward`, so the
pre-hook runs before the checkpoint saves (it says what to expect); earlier versions checkpoint
`__call__`, so it runs after (it claims what was saved); both are handled. A block offloads only
while it checkpoints (`gradient_checkpointing` set on it, training, grad enabled).

Synchronisations (SYNCS; the mutation tests, tests/parallel/test_activation_offload.py, remove each):
* `offload_waits_compute`: the d2h copy starts after the kernels that wrote the input.
* `release_waits_offload`: the compute stream waits for the d2h copy before the input's device
  copy is dropped: the memory returns to the compute stream's pool, whose next kernels may reuse
  it while the copy still reads it.
* `prefetch_waits_compute`: the h2d copy writes memory the allocator handed to the compute stream:
  kernels queued there before may still use it. The simulator cannot catch its removal (it
  never reuses memory).
* `prefetch_record_stream`: a prefetched buffer freed unread (a backward that stopped early) is
  not reused while h2d writes it.
* `recompute_waits_prefetch`: the compute stream waits for the h2d copy before the
  recomputation reads the input.

Pinned host buffers come from a pool (`PinnedPool`) and are reused across steps: a buffer comes
back once the saved input that held it is gone and no prefetch of it is in flight.
"""

from __future__ import annotations

import logging
import math
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from superoffload_hf.device.runtime import pinned_block_bytes

SYNCS = (
    "offload_waits_compute",     # the d2h copy reads the input after the kernels that wrote it
    "release_waits_offload",     # the input's device copy is freed after its d2h copy ran
    "prefetch_waits_compute",    # the h2d copy writes memory given to compute after compute's earlier kernels
    "prefetch_record_stream",    # a prefetched buffer freed unread is not reused while h2d writes it
    "recompute_waits_prefetch",  # the recomputation reads the input after its h2d copy
)

logger = logging.getLogger("superoffload_hf.parallel.activation_offload")

DEFAULT_DEPTH = 1  # block inputs prefetched ahead of the recomputation that reads one
# "auto": offload when the checkpointed blocks' inputs, all together, exceed this share of the
# device memory free at the first training forward (what is left must hold the largest block's
# recomputation, the head and the loss, which grow with the sequence too)
AUTO_SHARE = 0.25
MODES = ("on", "auto")


def _host_memory_left(runtime, budget_bytes: Optional[int]):
    from superoffload_hf.engine.host_limit import host_memory_left

    return host_memory_left(runtime, budget_bytes)


def offloaded_host_bytes(blocks: int, block_input_bytes: int, rounds: bool) -> int:
    """Pinned host bytes of one forward's offloaded inputs: every checkpointed block's but the
    last, each in a block the host allocator rounds up to a power of two where it `rounds`."""
    return max(0, blocks - 1) * pinned_block_bytes(block_input_bytes, rounds)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def checkpointed_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder blocks: transformers' GradientCheckpointingLayer modules, in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


@dataclass(frozen=True)
class Decision:
    on: bool
    reason: str

    def describe(self) -> str:
        return f"activation offload {'on' if self.on else 'off'} ({self.reason})"


def decide_auto(input_bytes: int, free_bytes: int, host_is_device: bool) -> Decision:
    """"auto": offload when the checkpointed inputs of one forward (`input_bytes`, every block's
    input) exceed AUTO_SHARE of the device's free memory; never where the device is the host."""
    if host_is_device:
        return Decision(False, "auto: the device is the host, nothing to free")
    share = input_bytes / max(free_bytes, 1)
    if input_bytes > AUTO_SHARE * free_bytes:
        return Decision(True, f"auto: the checkpointed block inputs take {input_bytes / 1e9:.3f} GB, "
                              f"{share:.0%} of the {free_bytes / 1e9:.3f} GB free > {AUTO_SHARE:.0%}")
    return Decision(False, f"auto: the checkpointed block inputs take {input_bytes / 1e9:.3f} GB, "
                           f"{share:.0%} of the {free_bytes / 1e9:.3f} GB free <= {AUTO_SHARE:.0%}")


class PinnedPool:
    """Page-locked host buffers (raw bytes), reused across steps: an input takes the smallest free
    buffer it fits in. Each buffer is the whole block the host allocator takes (a power of two on
    CUDA), so `nbytes` (every buffer allocated, free or held) is the host memory the pool takes.
    A miss finds only smaller free buffers (a longer sequence): they go, so the pool holds one
    forward's inputs at the longest sequence so far. `limit_bytes` (ActivationOffload.reserve):
    an allocation past it is refused."""

    def __init__(self, runtime, limit_bytes: Optional[int] = None):
        self.runtime = runtime
        self.limit_bytes = limit_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()  # give_back runs where a saved input is collected
        self.nbytes = 0
        self.allocations = 0
        self._per_forward = 1  # buffers one forward takes (reserve)

    def block_bytes(self, nbytes: int) -> int:
        return pinned_block_bytes(nbytes, self.runtime.pinned_rounds_to_power_of_two)

    def take(self, nbytes: int) -> torch.Tensor:
        block = self.block_bytes(nbytes)
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            smaller = sum(b.numel() for b in self._free)
            need = max(self.nbytes - smaller + block, block * self._per_forward)
            if self.limit_bytes is not None and need > self.limit_bytes:  # refused with the pool intact
                raise MemoryError(
                    f"activation offload: a block input of {nbytes} bytes needs a page-locked buffer of {block} "
                    f"bytes; with the {self._per_forward} of one forward the pool would hold {need} bytes, over the "
                    f"{self.limit_bytes} bytes reserved before training (ActivationOffload.reserve, sized for the "
                    "longest input expected). Reserve for the longest sequence and micro-batch the run feeds, "
                    "shorten them, or set `activation_offload: off`.")
            dropped, self._free = self._free, []
            self.nbytes -= smaller
            self.allocations += 1
            self.nbytes += block
        if dropped:
            del dropped
            # torch's host allocator caches freed page-locked blocks for ever: return them
            self.runtime.host_empty_cache()
        return self.runtime.host_empty(block, torch.uint8, pinned=True)

    def reserve(self, sizes: Sequence[int]) -> None:
        """Allocate a buffer for each of `sizes` bytes now (before training) and bound the pool
        at what it then holds."""
        buffers = [self.take(n) for n in sizes]
        with self._lock:
            self._free.extend(buffers)
            self.limit_bytes, self._per_forward = self.nbytes, max(1, len(buffers))

    def give_back(self, raw: torch.Tensor) -> None:
        with self._lock:
            self._free.append(raw)

    def drop(self, raw: torch.Tensor) -> None:
        """A buffer a copy may still read: not reused, freed with its last reference (CUDA's host
        allocator holds page-locked memory until the copies that used it have completed)."""
        with self._lock:
            self.nbytes -= raw.numel()

    def clear(self) -> None:
        with self._lock:
            self.nbytes -= sum(b.numel() for b in self._free)
            self._free = []


class _Saved:
    """What the hook keeps of one saved tensor: the device tensor (`device`), and once offloaded
    its pinned host copy (`host`, a view of the pool's `raw` buffer) and the copies' events."""

    __slots__ = ("device", "host", "raw", "shape", "dtype", "copied", "fetched", "peers", "position", "pool",
                 "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.device: Optional[torch.Tensor] = t
        self.host = self.raw = self.copied = self.fetched = self.peers = self.pool = None
        self.shape, self.dtype = t.shape, t.dtype
        self.position = -1  # in `peers`, this forward's block inputs in block order

    def __del__(self):
        if self.raw is None or self.pool is None:
            return
        if self.fetched is None:  # no prefetch in flight: a later d2h is ordered after its last read
            self.pool.give_back(self.raw)
        else:
            self.pool.drop(self.raw)


class ActivationOffload:
    """The hooks on one model. `mode` "on": offload from the first training forward on; "auto":
    decide at the first training forward (decide_auto). `omitted`: synchronisations to leave out
    (the mutation tests only). `host_budget`: config `host_memory_budget` (bytes; None: unset), the
    memory reserve() checks against in place of the machine's figure (engine/host_limit.py)."""

    def __init__(self, model: torch.nn.Module, runtime=None, mode: str = "on", depth: int = DEFAULT_DEPTH,
                 omitted: Sequence[str] = (), host_budget: Optional[int] = None):
        if mode not in MODES:
            raise ValueError(f"`mode` is {mode!r}; expected one of {list(MODES)}.")
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"`depth` is {depth!r}; expected an integer >= 1 (block inputs prefetched ahead).")
        unknown = sorted(set(omitted) - set(SYNCS))
        if unknown:
            raise ValueError(f"Unknown synchronisation(s) {unknown}; activation offload has {list(SYNCS)}.")
        blocks = checkpointed_blocks(model)
        if not blocks:
            raise ValueError(
                f"{type(model).__name__} has no transformers GradientCheckpointingLayer blocks: activation offload "
                "moves the inputs that gradient checkpointing keeps of each decoder block. Use a transformers "
                "model whose decoder layers support gradient checkpointing.")
        if runtime is None:
            from superoffload_hf.device import make_runtime

            runtime = make_runtime(next(model.parameters()).device)
        # weakly: the model holds these hooks (a cycle would outlive the model until the collector runs)
        self._blocks = [weakref.ref(b) for b in blocks]
        self.runtime, self.depth, self.omitted = runtime, depth, frozenset(omitted)
        self.host_budget = host_budget
        self.decision: Optional[Decision] = Decision(True, "on") if mode == "on" else None
        self.d2h, self.h2d = runtime.new_stream(), runtime.new_stream()
        self.pool = PinnedPool(runtime)
        self._reserved: Optional[int] = None  # reserve()'s block input bytes, for "auto" deciding on
        self.bytes_offloaded = self.bytes_fetched = 0
        self._scope = None  # the saved-tensors hooks, pushed for one forward
        self._peers: list = []  # this forward's block inputs (weak references), in block order
        self._expected: list[tuple[torch.Tensor, bool]] = []  # (a block's input, keep it) before it is saved
        self._recent: list[_Saved] = []  # saved since the last block began (earlier transformers)
        self._saves_before_pre_hook: Optional[bool] = None  # which of the two orders this transformers has
        self._to_release: list[_Saved] = []  # offloaded, device copy still held
        self._warned = False
        self._handles = [model.register_forward_pre_hook(self._model_begins),
                         model.register_forward_hook(self._model_ends, always_call=True)]
        for index, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(
                lambda module, args, index=index: self._block_begins(index, module, args)))

    @property
    def blocks(self) -> list[torch.nn.Module]:
        return [b for b in (ref() for ref in self._blocks) if b is not None]

    def _keeps(self, sync: str) -> bool:
        return sync not in self.omitted

    # ---- the model's forward ------------------------------------------------------------------

    def _model_begins(self, module, args) -> None:
        if self._scope is not None or in_backward() or not (module.training and torch.is_grad_enabled()):
            return
        if self.decision is not None and not self.decision.on:
            return
        self._peers = []
        self._scope = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._scope.__enter__()

    def _model_ends(self, module, args, output) -> None:
        if self._scope is None:
            return
        self._release_offloaded()
        self._expected, self._recent = [], []
        scope, self._scope = self._scope, None
        scope.__exit__(None, None, None)
        checkpointing = any(getattr(b, "gradient_checkpointing", False) for b in self.blocks)
        if checkpointing and self.decision is not None and self.decision.on and not self._peers and not self._warned:
            self._warned = True
            warnings.warn(
                "activation offload found no checkpointed block input among the tensors this training forward "
                "saved, so nothing was offloaded (with a transformers that checkpoints `__call__`, "
                "use_reentrant=True runs a block's hooks without grad). Enable gradient checkpointing with "
                "gradient_checkpointing_kwargs={\"use_reentrant\": False}.", stacklevel=2)

    def _block_begins(self, index: int, module, args) -> None:
        if self._scope is None or in_backward():  # (earlier transformers: a recomputation runs it again)
            return
        self._release_offloaded()
        recent, self._recent = self._recent, []
        if not (getattr(module, "gradient_checkpointing", False) and module.training and torch.is_grad_enabled()):
            return
        # what the checkpoint saves: the positional tensors (transformers binds the keyword ones,
        # masks and position embeddings, into the checkpointed function)
        inputs = [t for t in args if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if self.decision is None:
            self.decision = self._decide(inputs)
            logger.info("superoffload: %s", self.decision.describe())  # what "auto" decided, once
            if self.decision.on and self._reserved is not None:
                self.reserve(self._reserved)
        if not self.decision.on:
            return
        keep = not any(getattr(b, "gradient_checkpointing", False) for b in self.blocks[index + 1:])
        claimed = [s for s in recent if any(s.device is t for t in inputs)]
        if claimed:  # saved before this hook ran (the checkpoint wraps __call__)
            self._saves_before_pre_hook = True
            for saved in claimed:
                self._claim(saved, keep)
        else:  # saved after it (the checkpoint wraps forward)
            self._expected = [(t, keep) for t in inputs]

    def _decide(self, inputs: list[torch.Tensor]) -> Decision:
        """"auto", at the first checkpointed block of the first training forward."""
        per_block = sum(t.numel() * t.element_size() for t in inputs)
        checkpointing = sum(1 for b in self.blocks if getattr(b, "gradient_checkpointing", False))
        return decide_auto(per_block * checkpointing, self.runtime.memory_info()[0], self.runtime.host_is_device)

    # ---- the saved-tensors hooks ----------------------------------------------------------------

    def _pack(self, t: torch.Tensor):
        for k, (want, keep) in enumerate(self._expected):
            if want is t:
                del self._expected[k]
                self._saves_before_pre_hook = False
                saved = _Saved(t)
                self._claim(saved, keep)
                return saved
        if self._saves_before_pre_hook is not False and t.is_floating_point() and not isinstance(t, torch.nn.Parameter):
            saved = _Saved(t)  # a block's input, perhaps: its pre-hook, next, claims it
            self._recent.append(saved)
            return saved
        return t

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        if saved.peers is not None:
            self._prefetch_before(saved)
        if saved.host is None:
            return saved.device  # kept on the device
        if saved.device is None:
            self._fetch(saved)
        if self._keeps("recompute_waits_prefetch"):  # the recomputation reads what the prefetch writes
            self.runtime.current_stream().wait_event(saved.fetched)
        # The recomputation holds the device copy from here; a second backward (retain_graph)
        # fetches it again.
        t, saved.device, saved.fetched = saved.device, None, None
        return t

    # ---- offload, release, prefetch ---------------------------------------------------------------

    def _claim(self, saved: _Saved, keep: bool) -> None:
        saved.peers, saved.position = self._peers, len(self._peers)
        self._peers.append(weakref.ref(saved))
        if not keep and saved.device.is_contiguous():
            self._offload(saved)

    def _offload(self, saved: _Saved) -> None:
        rt, t = self.runtime, saved.device
        nbytes = t.numel() * t.element_size()
        rt.adopt_activation(t)
        raw = self.pool.take(nbytes)
        host = raw[:nbytes].view(t.dtype).view(t.shape)
        with torch.no_grad():
            ready = rt.new_event()
            ready.record(rt.current_stream())  # after the kernels that wrote t
            with rt.on_stream(self.d2h):
                if self._keeps("offload_waits_compute"):
                    # t was written on compute (RAW); also after the prefetch that last read this
                    # pooled host buffer (compute waited for it before this event)
                    self.d2h.wait_event(ready)
                rt.copy_(host, t)
                copied = rt.new_event()
                copied.record(self.d2h)
        saved.host, saved.raw, saved.copied, saved.pool = host, raw, copied, self.pool
        self.bytes_offloaded += nbytes
        self._to_release.append(saved)

    def _release_offloaded(self) -> None:
        """The device copies of the inputs offloaded so far go (no host wait: a stream wait)."""
        for saved in self._to_release:
            if self._keeps("release_waits_offload"):
                # the memory returns to the compute stream's pool: its next kernels may reuse it
                # only after the d2h copy read it
                self.runtime.current_stream().wait_event(saved.copied)
            saved.device = None
        self._to_release = []

    def _prefetch_before(self, saved: _Saved) -> None:
        for k in range(1, self.depth + 1):
            j = saved.position - k
            peer = saved.peers[j]() if j >= 0 else None
            if peer is not None and peer.host is not None and peer.device is None:
                self._fetch(peer)

    def _fetch(self, saved: _Saved) -> None:
        """Issue the host->device copy of an offloaded input on h2d (not waited for here)."""
        rt = self.runtime
        numel = math.prod(saved.shape)
        with torch.no_grad():
            buf = rt.device_empty(numel, saved.dtype)  # on the compute stream, which reads it
            allocated = rt.new_event()
            allocated.record(rt.current_stream())
            with rt.on_stream(self.h2d):
                if self._keeps("prefetch_waits_compute"):
                    # the allocator gave this memory to compute: its kernels queued before may still use it
                    self.h2d.wait_event(allocated)
                rt.copy_(buf, saved.host.view(-1))
                if self._keeps("prefetch_record_stream"):  # freed unread: not reused while h2d writes it
                    rt.record_stream(buf, self.h2d)
                fetched = rt.new_event()
                fetched.record(self.h2d)
        saved.device, saved.fetched = buf.view(saved.shape), fetched
        self.bytes_fetched += numel * saved.dtype.itemsize

    # ---- the edge ---------------------------------------------------------------------------------

    def reserve(self, block_input_bytes: int) -> int:
        """Size the pinned pool before training: a buffer for each checkpointed block's input but
        the last (it stays on the device) of `block_input_bytes` (micro-batch x sequence x hidden x
        element size, at the longest input the run feeds), the pool then bounded at what it holds
        (a longer input is refused with the figures). "auto" reserves when it decides on. Returns
        the host bytes (the allocator's rounded blocks)."""
        if not isinstance(block_input_bytes, int) or isinstance(block_input_bytes, bool) or block_input_bytes < 1:
            raise ValueError(f"`block_input_bytes` is {block_input_bytes!r}; expected an integer >= 1 (one block "
                             "input's bytes at the longest micro-batch).")
        count = max(0, sum(1 for b in self.blocks if getattr(b, "gradient_checkpointing", False)) - 1)
        need = count * self.pool.block_bytes(block_input_bytes)
        self._reserved = block_input_bytes
        if self.decision is None or not self.decision.on:
            return need
        left = _host_memory_left(self.runtime, self.host_budget)
        if left is not None and need - self.pool.nbytes > left[0]:
            raise MemoryError(
                f"activation offload: {count} block inputs of {block_input_bytes} bytes take {need} bytes of "
                f"page-locked host memory ({self.pool.block_bytes(block_input_bytes)} a block, the host allocator "
                f"rounding each up to a power of two); {left[1]} leaves {left[0]}. Shorten the sequence or the "
                "micro-batch, set `activation_offload: off`"
                + (", or raise `host_memory_budget`." if self.host_budget is not None else "."))
        self.pool.reserve([block_input_bytes] * count)
        return need

    @property
    def pinned_bytes(self) -> int:
        """Host bytes of the pinned pool (the block inputs of one forward, once it has run)."""
        return self.pool.nbytes

    def describe(self) -> str:
        decided = self.decision.describe() if self.decision else "activation offload auto (decided at the first training forward)"
        return (f"{decided}: {len(self.blocks)} blocks, prefetch depth {self.depth}, "
                f"{self.pinned_bytes / 1e6:.3f} MB pinned host buffers")

    def remove(self) -> None:
        """Remove the hooks (a forward in progress keeps its saved inputs valid)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.pool.clear()

    def __enter__(self) -> "ActivationOffload":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def apply_activation_offload(model: torch.nn.Module, runtime=None, mode: str = "on", depth: int = DEFAULT_DEPTH,
                             omitted: Sequence[str] = (), host_budget: Optional[int] = None) -> ActivationOffload:
    """Offload the block inputs gradient checkpointing keeps (enable it first, e.g.
    `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`)
    for every training forward of `model` from now on, on `runtime` (default: the runtime of the
    model's device, superoffload_hf.device.make_runtime). Returns the hooks: `.remove()`, or use
    them as a context manager. On the CPU device "on" copies to host memory and back for nothing
    but the same numbers (the config's `activation_offload` does not apply it there). `host_budget`:
    as the config's `host_memory_budget`, what reserve() checks against (None: the machine's figure)."""
    return ActivationOffload(model, runtime, mode, depth, omitted, host_budget)


def offload_for_config(model: torch.nn.Module, choice: str, gradient_checkpointing: bool,
                       runtime=None, block_input_bytes: Optional[int] = None,
                       host_budget: Optional[int] = None) -> tuple[Optional[ActivationOffload], str]:
    """The config's `activation_offload` (`choice`) for a run: the hooks on `model` (None: not
    applied) and the line that says what was decided and why. `block_input_bytes` (one block
    input at the longest micro-batch; None: unknown): the pinned pool is sized and bounded before
    training (ActivationOffload.reserve), against `host_budget` (config `host_memory_budget`) when set."""
    if choice == "off":
        return None, "activation offload off"
    if runtime is None:
        from superoffload_hf.device import make_runtime

        runtime = make_runtime(next(model.parameters()).device)
    if runtime.host_is_device:
        return None, f"activation offload {choice}: not applied, the device is the host (nothing to free)"
    if not gradient_checkpointing:
        if choice == "on":
            raise ValueError(
                "`activation_offload` is \"on\" but gradient checkpointing is off: the offload moves the block "
                "inputs that gradient checkpointing keeps. Set `gradient_checkpointing=True` (TrainingArguments, "
                "or the recipe's `training` block), or `activation_offload: auto` / `off`.")
        return None, "activation offload auto: off, gradient checkpointing is off"
    hooks = ActivationOffload(model, runtime, mode=choice, host_budget=host_budget)
    if block_input_bytes is None:
        return hooks, hooks.describe() + "; pinned pool sized at the first training forward (input size unknown)"
    need = hooks.reserve(block_input_bytes)
    return hooks, hooks.describe() + (f"; pinned pool of {need / 1e6:.3f} MB for block inputs of "
                                      f"{block_input_bytes / 1e6:.3f} MB, sized before training, bounded there")


def dry_run_pinned_bytes(recipe, model_config, choice: str, element_bytes: int, device_is_host: bool,
                         free_device_bytes: Optional[int] = None) -> int:
    """The pinned host bytes the offload takes in the run of `recipe` (0 where it is off):
    what the dry run's host check adds. "auto" decides against `free_device_bytes` (None:
    counted as on)."""
    t = recipe.training
    if choice == "off" or device_is_host or not (t.get("activation_checkpointing") or t.get("gradient_checkpointing")):
        return 0
    tokens = int(t.get("per_device_train_batch_size", 8)) * int(recipe.data.seq_len)
    per_block, layers = tokens * int(model_config.hidden_size) * element_bytes, int(model_config.num_hidden_layers)
    if choice == "auto" and free_device_bytes is not None and not decide_auto(layers * per_block, free_device_bytes,
                                                                               False).on:
        return 0
    return offloaded_host_bytes(layers, per_block, rounds=True)


def dry_run_line(recipe, model_config, choice: str, element_bytes: int, device_is_host: bool) -> str:
    """`superoffload train --dry-run`: what the checkpointed block inputs of one micro-batch take
    on the device, what offloading them takes in pinned host memory, and what `choice` does."""
    t = recipe.training
    layers, hidden = int(model_config.num_hidden_layers), int(model_config.hidden_size)
    tokens = int(t.get("per_device_train_batch_size", 8)) * int(recipe.data.seq_len)  # (the Trainer's default 8)
    per_block = tokens * hidden * element_bytes
    pinned = offloaded_host_bytes(layers, per_block, rounds=not device_is_host)
    head = (f"  activation offload {choice}; checkpointed block inputs {layers * per_block / 1e9:.3f} GB on the "
            f"device ({layers} x {per_block / 1e9:.3f} GB at {tokens} tokens a micro-batch), offloaded "
            f"{(layers - 1) * per_block / 1e9:.3f} GB, {pinned / 1e9:.3f} GB pinned host (each block rounded up "
            "to a power of two by the host allocator)")
    if choice == "off":
        return head + " - off"
    if device_is_host:
        return head + " - not applied, the device is the host"
    if not (t.get("activation_checkpointing") or t.get("gradient_checkpointing")):
        return head + (" - refused: it needs `training.gradient_checkpointing: true`" if choice == "on"
                       else " - off, gradient checkpointing is off")
    if choice == "on":
        return head + " - on"
    return head + (f" - auto: on if the device has less than {layers * per_block / AUTO_SHARE / 1e9:.3f} GB free at "
                   f"the first training forward (they would take over {AUTO_SHARE:.0%} of it)")
