"""Adam over a bucket: which elements to update with which step number, and the calls that do it.

A bucket is normally one kernel call over its whole flat buffers. Two things split it into
"runs" of consecutive parameters: a parameter without a gradient this step is not updated
(torch semantics), and parameters whose step counts differ (one missed earlier steps) need
different bias corrections. The same runs, hyperparameters and grad scale that a speculative
step used are kept so that its rollback inverts exactly that call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from superoffload_hf.engine.state.buffers import BucketBuffers
from superoffload_hf.plan.buckets import Bucket
from superoffload_hf.plan.memory import NORM_CHUNK
from superoffload_hf.host.compact import COMPACT_GROUP, scale_numel


@dataclass(frozen=True)
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    @classmethod
    def of_group(cls, group: Mapping) -> "Hyper":
        beta1, beta2 = group["betas"]
        return cls(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))


@dataclass(frozen=True)
class Run:
    offset: int  # first element in the bucket's flat buffers
    numel: int
    step: int  # the 1-based Adam step this update takes (bias correction)
    slots: tuple[int, ...]  # positions (in bucket.slots) of the parameters it covers


@dataclass(frozen=True)
class StepCall:
    """Everything one bucket update depends on, recorded so it can be undone or compared."""

    runs: tuple[Run, ...]
    hyper: Hyper
    grad_scale: float


def plan_runs(bucket: Bucket, present: Sequence[bool], param_steps: Sequence[int]) -> tuple[Run, ...]:
    """Maximal runs of consecutive present parameters that share a step count and are contiguous
    in the buffers (padding between slots, plan/buckets.py `align`, is never stepped)."""
    runs: list[Run] = []
    for k, slot in enumerate(bucket.slots):
        if not present[k]:
            continue
        step = param_steps[slot.index] + 1
        last = runs[-1] if runs else None
        if (last is not None and last.slots[-1] == k - 1 and last.step == step
                and last.offset + last.numel == slot.offset):
            runs[-1] = Run(last.offset, last.numel + slot.numel, step, last.slots + (k,))
        else:
            runs.append(Run(slot.offset, slot.numel, step, (k,)))
    return tuple(runs)


def apply(op: Callable, bufs: BucketBuffers, grad: torch.Tensor, call: StepCall, adamw: bool,
          lowp: Optional[torch.Tensor] = None) -> None:
    """Run `op` (adam_step_ or adam_rollback_ of a back end) over every run of `call`, reading
    the gradient from `grad` (the bucket's fp32 buffer, or a round kept in the link dtype)."""
    h = call.hyper
    for run in call.runs:
        if run.numel == 0:
            continue
        end = run.offset + run.numel
        op(bufs.master[run.offset:end], bufs.exp_avg[run.offset:end], bufs.exp_avg_sq[run.offset:end],
           grad[run.offset:end], step=run.step, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
           weight_decay=h.weight_decay, adamw=adamw, bias_correction=True, grad_scale=call.grad_scale,
           param_lowp=None if lowp is None else lowp[run.offset:end])


def apply_compact(adam, bufs: BucketBuffers, grad: torch.Tensor, call: StepCall, adamw: bool) -> None:
    """`adam.compact_step_` over every run of `call` on a compact host bucket's six buffers. A run
    starts at a slot, a multiple of the group (plan/buckets.py align): its scales start at offset / G."""
    h = call.hyper
    for run in call.runs:
        if run.numel == 0:
            continue
        end = run.offset + run.numel
        groups = slice(run.offset // COMPACT_GROUP, scale_numel(end))
        adam.compact_step_(bufs.master_bf16[run.offset:end], bufs.master_err[run.offset:end],
                           bufs.exp_avg_q[run.offset:end], bufs.exp_avg_scale[groups],
                           bufs.exp_avg_sq_q[run.offset:end], bufs.exp_avg_sq_scale[groups], grad[run.offset:end],
                           step=run.step, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                           weight_decay=h.weight_decay, adamw=adamw, bias_correction=True, grad_scale=call.grad_scale)


def run_slots(call: StepCall) -> list[int]:
    return [k for run in call.runs for k in run.slots]




def sum_squares_on_device(flat: torch.Tensor) -> torch.Tensor:
    """float64 sum of squares as a 0-d tensor on flat's device (no host synchronization), in
    chunks: an fp64 copy of a whole bucket (the embedding: 525M elements for Llama-3.1-8B) would
    be a 4.2 GB transient."""
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for chunk in flat.split(NORM_CHUNK):
        g = chunk.to(torch.float64)
        total += torch.dot(g, g)
    return total
