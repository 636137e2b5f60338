r"""The host Adam operations in plain PyTorch: the specification, and the fallback.

All buffers are flat, contiguous, 1-D CPU tensors of one length ``n``. The state (``param``,
``exp_avg``, ``exp_avg_sq``) is floating point (fp32 in production; float64 tensors give the
exact-math reference the tests measure against). ``grad`` is fp32, bf16, fp16 or float64 and is
never modified.

Gradient staging (micro-batch accumulation into the fp32 buffer the step reads), ``src`` fp32,
bf16 or fp16, ``dst`` fp32, any shapes of one element count, both contiguous, disjoint::

    grad_copy_(dst, src):        dst = float(src)          (exact)
    grad_accumulate_(dst, src):  dst = dst + float(src)    (one fp32 addition)

torch's ``add_`` is ``fma(src, 1, dst)``, exactly ``dst + src``, so the kernel agrees with these
bitwise (where both operands are NaN the result is a NaN of either payload).

Adam step ``t`` (1-based), with ``g = grad * grad_scale``::

    if not adamw:  g = g + weight_decay * p                      (L2, torch.optim.Adam)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1**t,  bc2 = 1 - beta2**t        (both 1 when bias_correction is False)
    step_size = lr / bc1
    denom = sqrt(v) / sqrt(bc2) + eps
    if adamw:      p = p * (1 - lr * weight_decay)               (decoupled, torch.optim.AdamW)
    p = p - step_size * m / denom
    param_lowp = round_to_nearest_even(p)          (when a bf16/fp16 output buffer is given)

Rollback inverts it from the post-step state and the same gradient and arguments::

    p = p + step_size * m / denom                  (denom from the post-step v: what the step used)
    if adamw:      p = p / (1 - lr * weight_decay)
    if not adamw:  g = g + weight_decay * p        (p is now the pre-step parameter)
    m = (m - round((1 - beta1) * g)) / beta1      (the term the step added, rounded as it was)
    v = max((v - (1 - beta2) * g * g) / beta2, 0)

Error bound of rollback in fp32 (each element, after one step and its rollback), with
``ulp(x) = 2**-23 * 2**floor(log2(x))`` the ulp of a magnitude ``x``:

* exp_avg:    |m_restored - m| <= B ulp(beta1*|m| + (1-beta1)*|g|) / beta1
* exp_avg_sq: |v_restored - v| <= B ulp(beta2*|v| + (1-beta2)*g*g) / beta2
* param:      |p_restored - p| <= B ulp(|p| + |step_size * m/denom|) / (1 - lr*wd)

with ``B = rollback_error_bound_ulps`` (4) for AdamW and for Adam without weight decay. With
L2 decay (Adam, weight_decay > 0) the rollback recomputes ``g = grad*grad_scale + wd*p`` from
the *restored* p, so the moments inherit p's error: there ``|g|`` above means
``|grad*grad_scale| + wd*(|p| + |step_size*m/denom|)`` and the moment bound is
``rollback_error_bound_ulps_l2`` (8; measured worst 4.5 over random and adversarial data).

Zero moments (an element that had no gradient before this step: an embedding row's first use)
come back exactly zero, for AdamW and Adam without weight decay: the rollback subtracts the
rounded term the step added, so ``m = 0 + t`` gives back ``t - t = 0`` (and ``v`` likewise). Any
residue there would stay: with ``v`` restored to 0 the next step divides it by ``eps`` (a step
skipped after a speculative step then moved such elements by ~lr/1000 where torch does not move
them at all). Moments that were not zero but far below the step's term (``beta2*v`` under an ulp
of ``(1-beta2)*g*g``) come back within the bound above, which is then a large part of them, and
the next step's ``m/sqrt(v)`` carries it: a rollback without a replay (a skip) is exact only
where nothing was that small. The engine therefore speculates no bucket after one whose gradient
is not finite, on any data-parallel rank (engine/dp/route.py ``spread_nonfinite``).

The magnitudes are those the update combines, not the result, which cancellation can make
arbitrarily small. A consequence worth knowing: after a rollback and a *clipped* replay with
coefficient c, the replayed exp_avg_sq carries the restore error of the unclipped step, i.e. a
relative error of about B ulp / c**2 of the clipped contribution. The engine therefore never
speculates a bucket once clipping is already certain (see speculation.py), and rollback
"snapshot" restores bit-exactly when that is not enough.

The fp32 kernel performs the same operations in the same order with these roundings:
``m = fma(beta1, m, (1-beta1)*g)``, ``v = fma(beta2, v, ((1-beta2)*g)*g)``,
``denom = fma(sqrt(v), 1/sqrt(bc2), eps)``, ``p = fma(-step_size, m/denom, p*decay)``.
This reference writes them as separate torch ops, so it agrees with the kernel to an ulp or
two, not bitwise; the kernel's own ISA paths agree with each other bitwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

LOWP_DTYPES = (torch.bfloat16, torch.float16)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
GRAD_SRC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

rollback_error_bound_ulps = 4
rollback_error_bound_ulps_l2 = 8


@dataclass(frozen=True)
class AdamCoefficients:
    """Per-call scalars derived once from the hyperparameters (in float64)."""

    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    step_size: float
    inv_sqrt_bc2: float
    eps: float
    decay: float  # multiplier of p before the update: 1 - lr*wd for AdamW, else 1
    l2: float  # added to g as l2*p: wd for Adam, else 0
    grad_scale: float


def adam_coefficients(
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
) -> AdamCoefficients:
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"`step` is {step!r}; expected the 1-based count of the step being taken (>= 1).")
    if bias_correction:
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
    else:
        bc1 = bc2 = 1.0
    return AdamCoefficients(
        beta1=beta1,
        beta2=beta2,
        one_minus_beta1=1.0 - beta1,
        one_minus_beta2=1.0 - beta2,
        step_size=lr / bc1,
        inv_sqrt_bc2=1.0 / math.sqrt(bc2),
        eps=eps,
        decay=(1.0 - lr * weight_decay) if adamw else 1.0,
        l2=0.0 if adamw else weight_decay,
        grad_scale=grad_scale,
    )


def _check(param, exp_avg, exp_avg_sq, grad, param_lowp) -> None:
    # Any one device: the engine steps its device-resident buckets with these same ops.
    n, device = param.numel(), param.device
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.device != device or not t.is_floating_point() or t.dtype in LOWP_DTYPES:
            raise TypeError(f"`{name}` must be an fp32 or float64 tensor on {device} (the device of `param`), got {t.dtype} on {t.device}.")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"`{name}` must be a flat contiguous 1-D tensor, got shape {tuple(t.shape)}, strides {t.stride()}.")
        if t.numel() != n:
            raise ValueError(f"`{name}` has {t.numel()} elements, `param` has {n}; all buffers must have the same length.")
    if grad.device != device or grad.dtype not in GRAD_DTYPES:
        raise TypeError(f"`grad` must be an fp32, bf16 or fp16 tensor on {device} (the device of `param`), got {grad.dtype} on {grad.device}.")
    if grad.dim() != 1 or not grad.is_contiguous() or grad.numel() != n:
        raise ValueError(f"`grad` must be a flat contiguous 1-D tensor of {n} elements, got shape {tuple(grad.shape)}.")
    if param_lowp is not None:
        if param_lowp.device != device or param_lowp.dtype not in LOWP_DTYPES:
            raise TypeError(f"`param_lowp` must be a bf16 or fp16 tensor on {device} (the device of `param`), got {param_lowp.dtype} on {param_lowp.device}.")
        if param_lowp.dim() != 1 or not param_lowp.is_contiguous() or param_lowp.numel() != n:
            raise ValueError(f"`param_lowp` must be a flat contiguous 1-D tensor of {n} elements, got shape {tuple(param_lowp.shape)}.")


def _scaled_grad(grad: torch.Tensor, dtype: torch.dtype, grad_scale: float) -> torch.Tensor:
    g = grad.to(dtype)  # always a new tensor unless dtypes match
    if g.data_ptr() == grad.data_ptr():
        g = g.clone()
    if grad_scale != 1.0:
        g.mul_(grad_scale)
    return g


def adam_step_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    param_lowp: Optional[torch.Tensor] = None,
) -> None:
    """One Adam/AdamW step in place (see the module docstring for the math)."""
    _check(param, exp_avg, exp_avg_sq, grad, param_lowp)
    c = adam_coefficients(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          adamw=adamw, bias_correction=bias_correction, grad_scale=grad_scale)
    g = _scaled_grad(grad, param.dtype, c.grad_scale)
    if c.l2 != 0.0:
        g.add_(param, alpha=c.l2)
    exp_avg.mul_(c.beta1).add_(g, alpha=c.one_minus_beta1)
    exp_avg_sq.mul_(c.beta2).addcmul_(g, g, value=c.one_minus_beta2)
    denom = exp_avg_sq.sqrt().mul_(c.inv_sqrt_bc2).add_(c.eps)
    if c.decay != 1.0:
        param.mul_(c.decay)
    param.addcdiv_(exp_avg, denom, value=-c.step_size)
    if param_lowp is not None:
        param_lowp.copy_(param)


def adam_rollback_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    param_lowp: Optional[torch.Tensor] = None,
) -> None:
    """Undo `adam_step_` taken with the same gradient and arguments (bound: module docstring)."""
    _check(param, exp_avg, exp_avg_sq, grad, param_lowp)
    c = adam_coefficients(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          adamw=adamw, bias_correction=bias_correction, grad_scale=grad_scale)
    denom = exp_avg_sq.sqrt().mul_(c.inv_sqrt_bc2).add_(c.eps)
    param.addcdiv_(exp_avg, denom, value=c.step_size)
    if c.decay != 1.0:
        param.div_(c.decay)
    g = _scaled_grad(grad, param.dtype, c.grad_scale)
    if c.l2 != 0.0:
        g.add_(param, alpha=c.l2)
    # The terms adam_step_ added, computed by the same ops from zero (so rounded as they were):
    # moments that were zero come back exactly zero (module docstring).
    exp_avg.sub_(torch.zeros_like(exp_avg).add_(g, alpha=c.one_minus_beta1)).div_(c.beta1)
    exp_avg_sq.sub_(torch.zeros_like(exp_avg_sq).addcmul_(g, g, value=c.one_minus_beta2)).div_(c.beta2).clamp_(min=0.0)
    if param_lowp is not None:
        param_lowp.copy_(param)


def sum_squares(grad: torch.Tensor) -> float:
    """Sum of squares of a flat gradient, accumulated in float64.

    Returns inf or NaN when any element is non-finite (validation relies on it)."""
    if grad.device.type != "cpu" or grad.dtype not in GRAD_DTYPES:
        raise TypeError(f"`grad` must be an fp32, bf16 or fp16 CPU tensor, got {grad.dtype} on {grad.device}.")
    if grad.dim() != 1 or not grad.is_contiguous():
        raise ValueError(f"`grad` must be a flat contiguous 1-D tensor, got shape {tuple(grad.shape)}.")
    g = grad.to(torch.float64)
    return float(torch.dot(g, g))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_grad_pair(dst: torch.Tensor, src: torch.Tensor) -> None:
    # The kernel's checks, in its order and with its exception types; any one device.
    if src.dtype not in GRAD_SRC_DTYPES:
        raise TypeError(f"`src` must be float32, bfloat16 or float16, got {src.dtype}. Cast it (`.float()`) into the fp32 staging buffer first.")
    if dst.dtype != torch.float32:
        raise TypeError(f"`dst` must be float32, got {dst.dtype}. It is the fp32 gradient staging buffer the Adam step reads.")
    if src.device != dst.device:
        raise TypeError(f"`src` must be on {dst.device} (the device of `dst`), got {src.device}.")
    for name, t in (("dst", dst), ("src", src)):
        if not t.is_contiguous():
            raise ValueError(f"`{name}` must be contiguous, got shape {tuple(t.shape)}, strides {t.stride()}.")
    if src.numel() != dst.numel():
        raise ValueError(f"`src` has {src.numel()} elements, `dst` has {dst.numel()}; they must have the same number of elements.")
    if _overlaps(dst, src):
        raise ValueError("`dst` and `src` share memory; accumulate into a separate fp32 buffer.")


def grad_copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = float(src), in place (src fp32, bf16 or fp16; dst fp32; same element count)."""
    _check_grad_pair(dst, src)
    dst.view(-1).copy_(src.view(-1))


def lowp_copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (bf16/fp16) = src (fp32) rounded to nearest even, in place: the rounding of the
    step's `param_lowp`. Flat, contiguous, same element count."""
    if dst.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"`dst` must be bfloat16 or float16, got {dst.dtype}. It receives the rounded copy of the fp32 `src`.")
    if src.dtype != torch.float32:
        raise TypeError(f"`src` must be float32, got {src.dtype}.")
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"`{name}` must be a flat contiguous 1-D tensor, got shape {tuple(t.shape)}, strides {t.stride()}.")
    if dst.numel() != src.numel():
        raise ValueError(f"`dst` has {dst.numel()} elements, `src` has {src.numel()}; all buffers must have the same length.")
    dst.copy_(src)


def grad_accumulate_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = dst + float(src), one fp32 addition per element, in place."""
    _check_grad_pair(dst, src)
    dst.view(-1).add_(src.view(-1))
