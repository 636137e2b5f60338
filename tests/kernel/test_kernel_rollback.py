"""GraceAdam rollback: the contract of reference.py (restore within a stated bound), on every ISA path.

Bounds, in units of ulp(combined magnitude) / beta (see _kernel_math.rollback_units):
- one step + its rollback: `rollback_error_bound_ulps` (4). With L2 weight decay (Adam), rollback
  recomputes g = grad + wd*p from the restored p, so the parameter's restore error enters both
  moments: g's magnitude includes wd*(|p| + |update|) and the bound is `rollback_error_bound_ulps_l2`
  (reference.py's docstring).
- step, rollback, step again vs one step: the restore error passes through one more step
  (multiplied by beta <= 1) plus one rounding either way: 2 * bound + 2 ulps of the step magnitudes.
- K step+rollback pairs: errors add at most linearly, the sum of the K one-pair bounds.
"""

from __future__ import annotations

import pytest
import torch

from _kernel_math import (HYPERS, assert_errors_within, clone_all, errors_in_ulps,
                          expected_step, random_state, rollback_errors, rollback_units)
from superoffload_hf.host.reference import rollback_error_bound_ulps, rollback_error_bound_ulps_l2

ADVERSARIAL_HYPERS = [  # large lr and decay, no bias correction: updates dwarf small parameters
    dict(step=1, lr=0.1, beta1=0.99, beta2=0.9, eps=1e-8, weight_decay=1.0, adamw=False,
         bias_correction=False, grad_scale=3.0),
    dict(step=4, lr=0.05, beta1=0.5, beta2=0.95, eps=1e-8, weight_decay=0.5, adamw=True,
         bias_correction=False, grad_scale=0.37),
]


def bound_for(hyper) -> float:
    l2 = not hyper["adamw"] and hyper["weight_decay"] != 0
    return rollback_error_bound_ulps_l2 if l2 else rollback_error_bound_ulps


def step_then_rollback(adam, state, grad, hyper, lowp_dtype=torch.bfloat16):
    work = clone_all(state)
    lowp = torch.empty(grad.numel(), dtype=lowp_dtype)
    adam.adam_step_(*work, grad, param_lowp=lowp, **hyper)
    stepped = clone_all(work)
    adam.adam_rollback_(*work, grad, param_lowp=lowp, **hyper)
    assert torch.equal(lowp, work[0].to(lowp_dtype)), "rollback must rewrite the lowp copy of the restored param"
    return stepped, work


@pytest.mark.parametrize("n", [1, 9, 17, 129, 20_011])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_rollback_restores_state_within_bound(cpp_adam, isa, n, grad_dtype):
    adam = cpp_adam(isa)
    for k, hyper in enumerate(HYPERS + ADVERSARIAL_HYPERS):
        state = random_state(n, seed=n + k, grad_dtype=grad_dtype)
        grad = state[3]
        stepped, restored = step_then_rollback(adam, state[:3], grad, hyper)
        errors = rollback_errors(restored, state[:3], rollback_units(state[:3], stepped, grad, hyper))
        assert_errors_within(errors, bound_for(hyper), f"isa={isa} n={n} grad={grad_dtype} hyper#{k}")


def test_rollback_of_a_first_adamw_step_restores_a_zero_second_moment_exactly(cpp_adam, isa):
    # v' = round(round((1-b2)*g)*g) and rollback subtracts that same rounded product: exactly 0.
    n = 1001
    param, _, _, grad = random_state(n, seed=1)
    zeros = torch.zeros(n)
    _, restored = step_then_rollback(cpp_adam(isa), (param, zeros, zeros), grad, HYPERS[1])
    assert torch.equal(restored[2], zeros)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("hyper", [HYPERS[0], HYPERS[1], HYPERS[4], ADVERSARIAL_HYPERS[1]],
                         ids=["adamw-first", "adamw-step7", "adamw-no-bias-correction", "adamw-adversarial"])
def test_rollback_restores_zero_moments_exactly_so_a_later_zero_gradient_only_decays(cpp_adam, isa, backend, hyper):
    """Elements whose moments were zero before the step (no gradient yet: an embedding row's first
    use) get both moments back exactly zero. A rounding residue in exp_avg alone (exp_avg_sq is
    restored to exactly 0) would be divided by eps at the next step: an element without a
    gradient would move by ~lr/1000 instead of only decaying (the data-parallel skip bug)."""
    from superoffload_hf.host import reference

    adam = cpp_adam(isa) if backend == "kernel" else reference
    n = 1001
    param, _, _, grad = random_state(n, seed=3)
    zeros = torch.zeros(n)
    _, (p, m, v) = step_then_rollback(adam, (param, zeros, zeros), grad, hyper)
    assert torch.equal(v, zeros)
    nonzero = int((m != 0).sum())
    assert nonzero == 0, f"isa={isa} {backend}: {nonzero} of {n} exp_avg elements restored to a residue, not 0"
    # the next step, with no gradient for these elements: AdamW only decays them, as torch does
    after = p.clone()
    adam.adam_step_(after, m.clone(), v.clone(), torch.zeros(n), **dict(hyper, step=hyper["step"] + 1))
    decay = 1.0 - hyper["lr"] * hyper["weight_decay"]
    want = p * torch.tensor(decay, dtype=torch.float32)
    assert torch.equal(after, want), f"isa={isa} {backend}: max |moved| {float((after - want).abs().max()):.3e}"


@pytest.mark.parametrize("hyper", HYPERS[1:4], ids=["adamw", "adam-l2", "adam-l2-no-bias-correction"])
def test_step_rollback_step_equals_one_step_within_bound(cpp_adam, isa, hyper):
    # The engine's replay: a speculative step, its rollback, and the step again with a clip factor.
    adam = cpp_adam(isa)
    state = random_state(20_011, seed=3)
    grad = state[3]
    _, restored = step_then_rollback(adam, state[:3], grad, hyper)
    replay = dict(hyper, grad_scale=hyper["grad_scale"] * 0.25)
    adam.adam_step_(*restored, grad, **replay)
    once = clone_all(state[:3])
    adam.adam_step_(*once, grad, **replay)
    _, magnitudes = expected_step(state[:3], grad, replay)
    bound = 2 * bound_for(hyper) + 2
    for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), restored, once):
        err = errors_in_ulps(got, want.double(), magnitudes[name])
        assert bool((err <= bound).all()), f"isa={isa} {name}: {err.max().item():.2f} ulps > {bound}"


@pytest.mark.parametrize("adamw", [True, False])
def test_repeated_step_rollback_pairs_do_not_drift(cpp_adam, isa, adamw):
    adam = cpp_adam(isa)
    n, pairs = 4099, 25
    state = random_state(n, seed=4)[:3]
    work = clone_all(state)
    gen = torch.Generator().manual_seed(5)
    allowed = {q: torch.zeros(n, dtype=torch.float64) for q in ("param", "exp_avg", "exp_avg_sq")}
    for k in range(pairs):
        grad = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-5, 0, (n,), generator=gen)
        hyper = dict(step=k + 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, adamw=adamw,
                     bias_correction=True, grad_scale=1.0)
        before = clone_all(work)
        adam.adam_step_(*work, grad, **hyper)
        units = rollback_units(before, work, grad, hyper)
        adam.adam_rollback_(*work, grad, **hyper)
        for q in allowed:  # each pair may add its own bound: linear accumulation at worst
            allowed[q] += bound_for(hyper) * units[q]
    for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), work, state):
        drift = (got.double() - want.double()).abs()
        ratio = drift / allowed[name]
        assert bool((drift <= allowed[name]).all()), (
            f"isa={isa} adamw={adamw} {name} drifted {ratio.max().item():.2f}x the summed bound of {pairs} pairs")


def test_rollback_that_cannot_invert_raises_before_touching_state(cpp_adam, isa):
    state = random_state(33, seed=6)
    before = clone_all(state)
    hyper = dict(HYPERS[1], beta1=0.0)
    with pytest.raises(ValueError, match="beta1"):
        cpp_adam(isa).adam_rollback_(*state[:3], state[3], **hyper)
    for got, want in zip(state, before):
        assert torch.equal(got, want)

