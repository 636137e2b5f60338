"""Helpers for the kernel tests: random Adam states, the float64 math, errors in ulps.

Errors are measured in ulps of the magnitudes an update combines, not of its result (which
cancellation can make arbitrarily small); see superoffload_hf/reference.py.
"""

from __future__ import annotations

import torch

from superoffload_hf.host import reference

# Hyperparameter sets covering: first step, AdamW with decay, Adam with L2, no bias correction,
# grad_scale != 1 (inexact in binary and a power of two), betas other than the defaults.
HYPERS = [
    dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True,
         bias_correction=True, grad_scale=1.0),
    dict(step=7, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=0.1, adamw=True,
         bias_correction=True, grad_scale=0.37),
    dict(step=12, lr=2e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.05, adamw=False,
         bias_correction=True, grad_scale=2.0**-10),
    dict(step=3, lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-7, weight_decay=0.01, adamw=False,
         bias_correction=False, grad_scale=3.0),
    dict(step=1000, lr=5e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True,
         bias_correction=False, grad_scale=1.0),
]

# Vector widths 8 (AVX2, NEON x2) and 16 floats (AVX-512) and their neighbours; 64-128 element tiles.
EDGE_SIZES = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129]

# Per-step error bounds in ulps of the combined magnitudes (the kernel rounds each coefficient to
# fp32 once and then rounds each operation: a handful of half-ulps each, see the analysis in
# csrc/grace_adam/selftest.cpp). Observed maxima on random data: 2.9, 2.2 and 4.0 ulps.
STEP_BOUND_ULPS = {"param": 13.0, "exp_avg": 4.0, "exp_avg_sq": 7.0}


def random_state(n: int, seed: int, grad_dtype=torch.float32):
    """fp32 (param, exp_avg, exp_avg_sq) and a gradient spanning many binades; about one element in
    ten has fresh moments (a first step) and one in ten a zero gradient."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(n, generator=gen, dtype=torch.float64) * 6 - 5)  # 1e-5 .. 1e1
    grad = (torch.randn(n, generator=gen, dtype=torch.float64) * scale).float()
    param = torch.randn(n, generator=gen)
    exp_avg = (torch.randn(n, generator=gen, dtype=torch.float64) * scale * 0.5).float()
    exp_avg_sq = (torch.rand(n, generator=gen, dtype=torch.float64) * scale**2).float()
    fresh = torch.rand(n, generator=gen) < 0.1
    exp_avg[fresh] = 0.0
    exp_avg_sq[fresh] = 0.0
    grad[torch.rand(n, generator=gen) < 0.1] = 0.0
    return param, exp_avg, exp_avg_sq, grad.to(grad_dtype)


def clone_all(tensors):
    return [t.clone() for t in tensors]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor (for bitwise comparisons, NaN payloads included)."""
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit patterns, except that a NaN only has to meet a NaN (which operand's NaN an
    operation propagates when several are NaN is not specified across instruction sets)."""
    both_nan = actual.isnan() & expected.isnan()
    differ = (bits(actual) != bits(expected)) & ~both_nan
    if differ.any():
        i = int(differ.nonzero()[0])
        raise AssertionError(f"{what}: {int(differ.sum())} of {actual.numel()} elements differ bitwise; "
                             f"first at {i}: {actual[i].item()!r} vs {expected[i].item()!r}")


def ulp32(magnitude: torch.Tensor) -> torch.Tensor:
    """The fp32 ulp of each (float64, non-negative) magnitude: 2**(floor(log2 x) - 23)."""
    _, exponent = torch.frexp(magnitude)
    ulp = torch.ldexp(torch.ones_like(magnitude), exponent - 24)
    return torch.where(magnitude > 0, ulp, torch.zeros_like(ulp)).clamp(min=2.0**-149)


def errors_in_ulps(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    return (actual.double() - expected).abs() / ulp32(magnitude)


def assert_within_ulps(actual, expected, magnitude, bound: float, what: str) -> None:
    err = errors_in_ulps(actual, expected, magnitude)
    worst = int(err.argmax())
    if not bool((err <= bound).all()):  # NaN errors fail too
        raise AssertionError(f"{what}: error {err[worst].item():.2f} ulps > {bound} at element {worst} "
                             f"(actual {actual[worst].item()!r}, expected {expected[worst].item()!r}, "
                             f"magnitude {magnitude[worst].item()!r})")


def step_magnitudes(state64, grad, hyper, v_new):
    """Per element, the magnitudes a step combines (float64): exp_avg, exp_avg_sq and param.
    `v_new` is the exact new exp_avg_sq."""
    param, exp_avg, exp_avg_sq = state64
    c = reference.adam_coefficients(**hyper)
    g = grad.double().abs() * c.grad_scale + abs(c.l2) * param.abs()
    m_mag = c.beta1 * exp_avg.abs() + c.one_minus_beta1 * g
    v_mag = c.beta2 * exp_avg_sq + c.one_minus_beta2 * g * g
    denom = v_new.sqrt() * c.inv_sqrt_bc2 + c.eps
    # Xv / v' > 1 only where L2 makes the new gradient cancel; it scales the relative error of denom.
    v_ratio = torch.where(v_new > 0, v_mag / v_new, torch.ones_like(v_new)).clamp(min=1.0)
    p_mag = param.abs() * c.decay + c.step_size * (m_mag / denom) * v_ratio
    return {"param": p_mag, "exp_avg": m_mag, "exp_avg_sq": v_mag}


def reference_step(state64, grad, hyper):
    """One step of the float64 reference from float64 copies of the state; returns new copies."""
    p, m, v = clone_all(state64)
    reference.adam_step_(p, m, v, grad, **hyper)
    return p, m, v


def as_float64(state):
    return [t.double() for t in state]


def expected_step(before32, grad, hyper):
    """The exact (float64) result of one step from the fp32 state, and the magnitudes it combines."""
    state64 = as_float64(before32)
    expected = reference_step(state64, grad, hyper)
    return expected, step_magnitudes(state64, grad, hyper, expected[2])


def assert_step_within_bound(before32, after32, grad, hyper, what: str, expected=None) -> None:
    """`after32` is one kernel step from `before32`: compare with the float64 math, every element."""
    expected, magnitudes = expected or expected_step(before32, grad, hyper)
    for name, actual, exp in zip(("param", "exp_avg", "exp_avg_sq"), after32, expected):
        assert_within_ulps(actual, exp, magnitudes[name], STEP_BOUND_ULPS[name], f"{what} {name}")


def rollback_units(before32, stepped32, grad, hyper):
    """Per element, the unit the rollback bound of reference.py is stated in (float64):
    ulp(combined magnitude) / beta1, / beta2 and / (1 - lr*wd) for exp_avg, exp_avg_sq and param.
    `stepped32` is the state after the step being rolled back (its m/denom is the update)."""
    param, exp_avg, exp_avg_sq = as_float64(before32)
    c = reference.adam_coefficients(**hyper)
    m_new, v_new = stepped32[1].double(), stepped32[2].double()
    update = c.step_size * m_new.abs() / (v_new.sqrt() * c.inv_sqrt_bc2 + c.eps)
    # With L2 decay rollback recomputes g = grad + wd*p from the restored p, whose error is a few
    # ulp(|p| + |update|): that magnitude, not |p|, enters the gradient's.
    g = grad.double().abs() * c.grad_scale + abs(c.l2) * (param.abs() + update)
    return {
        "param": ulp32(param.abs() + update) / c.decay,
        "exp_avg": ulp32(c.beta1 * exp_avg.abs() + c.one_minus_beta1 * g) / c.beta1,
        "exp_avg_sq": ulp32(c.beta2 * exp_avg_sq + c.one_minus_beta2 * g * g) / c.beta2,
    }


def rollback_errors(restored32, before32, units):
    """Per quantity, the restore error of every element in units of the documented bound."""
    names = ("param", "exp_avg", "exp_avg_sq")
    return {name: (r.double() - b.double()).abs() / units[name] for name, r, b in zip(names, restored32, before32)}


def assert_errors_within(errors: dict, bound: float, what: str) -> None:
    for name, err in errors.items():
        worst = int(err.argmax())
        if not bool((err <= bound).all()):
            raise AssertionError(f"{what} {name}: error {err[worst].item():.2f} units > {bound} at element {worst}")
