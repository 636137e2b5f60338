"""The compact reference optimizer the engine's compact state is compared with, bitwise.

Per parameter: its own compact buffers (groups from its first element, as the engine's slots are
padded to multiples of the group), stepped with host/compact.py's `compact_step_`; the global
norm, clip and skip decision as the engine's `decide` makes them from a float64 sum of squares;
the parameters the engine keeps in device-resident buckets (fp32 state on the device) stepped
with the fp32 reference (host/reference.py), as the engine steps them. The reference model holds
the bf16 weights: after each step, `master_bf16` (or the fp32 master cast to bf16).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from superoffload_hf.engine.step.validate import decide
from superoffload_hf.host import compact, reference

COMPACT_KEYS = ("master_bf16", "master_err", "exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale")


class CompactReferenceAdam:
    def __init__(self, groups: list[dict], precision: str, adamw: bool = True, fp32_indices=()):
        """`groups`: param groups of the reference model (params in the engine's order, lr,
        betas, eps, weight_decay); the parameters hold the initial weights (fp32 or bf16)."""
        self.groups, self.precision, self.adamw = groups, precision, adamw
        self.params = [p for g in groups for p in g["params"]]
        self.fp32_indices = set(fp32_indices)
        self.steps = [0] * len(self.params)
        self.state = []
        for i, p in enumerate(self.params):
            master = p.detach().to(torch.float32).reshape(-1).clone()
            zeros = torch.zeros_like(master)
            if i in self.fp32_indices:
                self.state.append({"master": master, "exp_avg": zeros, "exp_avg_sq": zeros.clone()})
            else:
                six = compact.empty_state(master.numel(), precision)
                compact.compact_encode_(*six, master, zeros, zeros)
                self.state.append(dict(zip(COMPACT_KEYS, six)))
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.data = self.weights(i).view(p.shape).clone()  # the bf16 weight the device computes with

    def weights(self, i: int) -> torch.Tensor:
        s = self.state[i]
        return s["master"].to(torch.bfloat16) if "master" in s else s["master_bf16"]

    def step(self, max_grad_norm: Optional[float]):
        """One step from the parameters' .grad; returns the Decision (skip: nothing changes)."""
        grads = [None if p.grad is None else p.grad.detach().to(torch.float32).reshape(-1) for p in self.params]
        sumsq = sum(float(torch.dot(g.double(), g.double())) for g in grads if g is not None)
        decision = decide(sumsq, 1.0, max_grad_norm)
        if decision.kind == "skip" or not math.isfinite(sumsq):
            return decision
        group_of = {id(p): g for g in self.groups for p in g["params"]}
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            group = group_of[id(p)]
            self.steps[i] += 1
            hyper = dict(step=self.steps[i], lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                         eps=group["eps"], weight_decay=group["weight_decay"], adamw=self.adamw,
                         grad_scale=decision.clip_coef)
            s = self.state[i]
            if "master" in s:
                reference.adam_step_(s["master"], s["exp_avg"], s["exp_avg_sq"], g, **hyper)
            else:
                compact.compact_step_(*(s[k] for k in COMPACT_KEYS), g, **hyper)
            with torch.no_grad():
                p.copy_(self.weights(i).view(p.shape))
        return decision

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def compact_groups(model: torch.nn.Module, lr: float, weight_decay: float) -> list[dict]:
    return [{"params": list(model.parameters()), "lr": lr, "betas": (0.9, 0.999), "eps": 1e-8,
             "weight_decay": weight_decay}]


def fp32_indices(opt) -> list[int]:
    """The parameters of the engine's device-resident buckets (fp32 state on the device)."""
    return [s.index for b in opt.plan.buckets if b.device_resident for s in b.slots]


def assert_state_matches(opt, ref: CompactReferenceAdam, where: str) -> None:
    """Every byte of every stepped parameter's state (opt.state_dict()) equals the reference's."""
    state = opt.state_dict()["state"]
    for i, want in enumerate(ref.state):
        if ref.steps[i] == 0:
            assert i not in state, f"{where}: parameter {i} has state but was never stepped"
            continue
        got = state[i]
        assert int(got["step"]) == ref.steps[i], f"{where}: parameter {i} step {got['step']}, reference {ref.steps[i]}"
        keys = {"master": "master_param"} if "master" in want else {}
        for key, value in want.items():
            mine = got[keys.get(key, key)].reshape(-1)
            assert mine.dtype == value.dtype and torch.equal(mine, value), (
                f"{where}: parameter {i} {key} differs from the compact reference in "
                f"{int((mine.double() != value.double()).sum())} of {value.numel()} elements")


def assert_weights_match(model: torch.nn.Module, ref_model: torch.nn.Module, where: str) -> None:
    model.state_dict(keep_vars=True)  # waits for the copy-backs on the way
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert p.dtype == q.dtype == torch.bfloat16, (name, p.dtype, q.dtype)
        assert torch.equal(p.detach(), q.detach()), (
            f"{where}: parameter {name} differs bitwise from the compact reference in "
            f"{int((p != q).sum())} of {p.numel()} elements")
