"""One bucket at run time: its buffers, its parameters, and its lifecycle as a state machine.

A host bucket goes through these states in one optimizer step (who moves it in brackets):

    IDLE ──first gradient──> COLLECTING                                          [training]
    COLLECTING ──last micro-batch flushed, norm job queued──> LAUNCHED            [training]
    LAUNCHED ──norm known, not stepped──> STAGED                                  [worker]
    LAUNCHED ──norm known, stepped speculatively, copy-back issued──> SPECULATED  [worker]
    LAUNCHED | STAGED | SPECULATED ──another gradient arrived (rollback queued)──> COLLECTING
    STAGED | SPECULATED ──step() decided; commit / replay / rollback queued──> VALIDATED
    VALIDATED ──after step(): its copy-back may still be on the way──> RETURNING  [training]
    RETURNING ──the next forward (or synchronize) waited for it──> IDLE            [training]
    any ──discard (zero_grad before step()), after waiting for its jobs──> IDLE   [training]

Every transition is checked against this table (`BucketStateError` on an illegal one). The
training thread moves a bucket only when none of its worker jobs is queued, except to
LAUNCHED/COLLECTING when queueing them; the worker moves it only inside those jobs. So each
transition has one writer at a time, and the training thread reads what the worker wrote after
waiting for the bucket's jobs (`pending.idle`) or its norm (`norm_ready`).

Per-slot collection bookkeeping (`present`, `fires`, `round_fired`, `round_dev`, `autograd_grads`)
belongs to the training thread; `sumsq`, `spec` and `h2d_event` are written by the worker's jobs.
"""

from __future__ import annotations

import enum
import threading
from typing import Optional

import torch

from superoffload_hf.engine.state.buffers import BucketBuffers
from superoffload_hf.plan.buckets import Bucket
from superoffload_hf.engine.state.stepper import StepCall
from superoffload_hf.engine.step.worker import Pending
from superoffload_hf.host.segmented import SegmentedGrad


class BucketState(enum.Enum):
    IDLE = "idle"
    COLLECTING = "collecting"
    LAUNCHED = "launched"
    STAGED = "staged"
    SPECULATED = "speculated"
    VALIDATED = "validated"
    RETURNING = "returning"


S = BucketState
TRANSITIONS: dict[BucketState, frozenset[BucketState]] = {
    S.IDLE: frozenset({S.COLLECTING, S.IDLE}),
    S.COLLECTING: frozenset({S.LAUNCHED, S.IDLE}),
    S.LAUNCHED: frozenset({S.STAGED, S.SPECULATED, S.COLLECTING, S.IDLE}),
    S.STAGED: frozenset({S.VALIDATED, S.COLLECTING, S.IDLE}),
    S.SPECULATED: frozenset({S.VALIDATED, S.COLLECTING, S.IDLE}),
    S.VALIDATED: frozenset({S.RETURNING, S.IDLE}),
    S.RETURNING: frozenset({S.IDLE, S.COLLECTING}),
}
LAUNCHED_STATES = frozenset({S.LAUNCHED, S.STAGED, S.SPECULATED})


class BucketStateError(RuntimeError):
    """An illegal bucket transition: a bug in the engine (please report it)."""


class BucketRuntime:
    def __init__(self, bucket: Bucket, bufs: BucketBuffers, params: list[torch.Tensor]):
        self.bucket = bucket
        self.bufs = bufs
        self.params = params  # the device parameters, in slot order
        self.params_alias_master = False  # they are views of bufs.master (BucketSet.alias_params)
        # bufs.grad exists only for a step that accumulates (BufferPolicy.grad_on_demand); else
        # the step reads autograd's gradients in place (`autograd_grads`)
        self.grad_on_demand = False
        self.shard = None  # data parallel: this rank's Shard of a host bucket (its buffers hold only that)
        self.pending = Pending()  # worker jobs queued on this bucket
        self.norm_ready = threading.Event()
        self.h2d_event = None  # the last copy-back to the device (None: nothing in flight)
        self.fetch_event = None  # weight-flow: the last fetch reading this bucket's host weights
        # What the worker's step reads as this step's gradient: bufs.grad, or the receive buffer
        # when one round in the link dtype is the whole step, or (grad_on_demand) autograd's
        # gradients as a SegmentedGrad. Written and read by worker jobs; valid until the next
        # step's first round (kept across reset(): queued jobs read it), except a SegmentedGrad.
        self.grad_in: Optional[torch.Tensor | SegmentedGrad] = bufs.grad
        self.state = BucketState.IDLE
        self.reset()

    def move(self, to: BucketState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise BucketStateError(
                f"bucket {self.bucket.index}: illegal transition {self.state.value} -> {to.value} "
                f"(allowed: {sorted(s.value for s in TRANSITIONS[self.state])}). This is a bug in "
                "superoffload_hf; please report it with the traceback."
            )
        self.state = to
        self.lean = False  # Collector.on_grad: the full path decides again

    def reset(self) -> None:
        """Forget this accumulation step's collection (after step() or a discard)."""
        n = len(self.bucket.slots)
        self.present = [False] * n  # got a gradient in this accumulation step
        self.fires = [0] * n  # gradients delivered in this accumulation step
        self.round_fired = [False] * n
        self.round_dev: Optional[torch.Tensor] = None
        self.staged = False  # bufs.grad holds gradients of this accumulation step
        self.sumsq: Optional[float] = None
        self.spec: Optional[StepCall] = None  # the speculative step taken, if any
        self.no_spec = False  # a gradient arrived after launch: no more speculation this step
        self.redo = False  # a speculative step was rolled back before step(): stepping is a replay
        self.norm_ready.clear()
        self.lean = False  # the hooks' lean path (Collector.on_grad) is off until the full path allows it
        # grad_on_demand: each parameter's gradient of this step as autograd produced it (in the
        # parameter's shape, contiguous), read in place by the step. Released here, as torch
        # frees them at zero_grad(); no job can still read them: this path (the CPU device) runs
        # its jobs inline.
        self.autograd_grads: list[Optional[torch.Tensor]] = [None] * n
        if self.grad_on_demand:
            self.grad_in = None
            self.bufs.grad = None  # an fp32 buffer this step needed goes with it

    @property
    def launched(self) -> bool:
        return self.state in LAUNCHED_STATES

    @property
    def round_complete(self) -> bool:
        return all(self.round_fired)

    def zero_absent_grads(self) -> None:
        """bufs.grad of the parameters without a gradient yet this step (it holds the last one's)."""
        for k, present in enumerate(self.present):
            if not present:
                BucketBuffers.view(self.bufs.grad, self.bucket.slots[k]).zero_()

    def autograd_grad(self) -> SegmentedGrad:
        """This step's gradient as autograd's tensors (absent parameters: None)."""
        return SegmentedGrad(self.autograd_grads, [slot.numel for slot in self.bucket.slots])

    def accumulate_from_now(self) -> None:
        """A parameter received a second gradient this step (grad_on_demand): allocate the fp32
        buffer, copy the held gradients in (zeros for the absent) and release them."""
        flat = self.bufs.grad_buffer()
        for k, slot in enumerate(self.bucket.slots):
            held = self.autograd_grads[k]
            if held is not None:
                BucketBuffers.view(flat, slot).copy_(held.view(-1))  # kept in the parameter's shape
            else:
                BucketBuffers.view(flat, slot).zero_()
        self.autograd_grads = [None] * len(self.bucket.slots)
        self.grad_in = flat

    def take_round(self) -> torch.Tensor:
        """The round's flat device gradient, absent parameters and padding zeroed (a ring slot
        holds an earlier round's bytes there); starts a new round."""
        flat = self.round_dev
        for k, fired in enumerate(self.round_fired):
            if not fired:
                BucketBuffers.view(flat, self.bucket.slots[k]).zero_()
        for start, end in self.bucket.gaps:  # the norm sums the whole buffer
            flat[start:end].zero_()
        self.round_dev = None
        self.round_fired = [False] * len(self.bucket.slots)
        return flat
