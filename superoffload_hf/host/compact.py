r"""The compact host state (issue 17): its format, and the reference that defines it.

One flat buffer of ``n`` elements (a bucket, a run within it, or a data-parallel shard) is stored
as six tensors; groups of ``G = COMPACT_GROUP = 32`` elements start at element 0 of the buffer
passed in (the last group may be partial)::

    master_bf16       torch.bfloat16 [n]            hi: the weight the device computes with
    master_err        torch.int8 [n]  ("compact")   err: the rounding remainder of hi, in units
                      torch.int16 [n] ("compact32")
    exp_avg_q         torch.int8 [n]                m = q * scale
    exp_avg_scale     torch.bfloat16 [ceil(n/G)]
    exp_avg_sq_q      torch.uint8 [n]               v = (q * scale)**2   (q encodes sqrt(v))
    exp_avg_sq_scale  torch.bfloat16 [ceil(n/G)]

Every operation below is an IEEE fp32 operation (correctly rounded, round to nearest even, no
flush to zero) or exact; every ISA kernel performs the same ones, so kernels and this reference
agree bitwise. The reference computes in float64 and rounds to fp32 after each operation, which
is the fp32 result: for + - * / sqrt because float64 has more than 2*24+2 bits; for fused
multiply-adds by rounding the float64 sum to odd first (`fma_fp32`).

Master (``B = 7`` for int8 err, ``15`` for int16), in integer bit space::

    hi    = bf16 round-to-nearest-even(w)         (a NaN becomes the quiet NaN 0x7fc0)
    delta = bits(w) - (bits(hi) << 16)            (int32; in [-32768, 32768])
    err   = clamp(rne(delta / 2**(15 - B)), -2**B, 2**B - 1);  err = 0 where hi is inf or NaN
    decode: bits(w) = (bits(hi) << 16) + err * 2**(15 - B)   (integer shift and add, mod 2**32)

Rounding to nearest even to bf16 is rounding the fp32 bit pattern (an integer, sign-magnitude) to
a multiple of 2**16, so delta is the rounding remainder in fp32 ulps of w, exactly, and continuous
across binade edges (the bit patterns of one sign are ordered like the values). compact's err
counts units of 2**8 fp32 ulps (1/128 of half an ulp of hi: "an int8 error term in half-ulps");
compact32's err is delta itself (exact fp32 except the tie delta = +32768, clamped to 32767).
This is equivalent in precision to a remainder ``r = w - hi`` counted in units of half an ulp of
hi divided by 2**B (the unit is the same inside a binade, and half of it just below a power-of-two
hi), so a weight is kept to 16 (compact) or 24 (compact32) significant bits, but decode and encode
are integer shifts and adds only: no exponent extraction, no power-of-two scaling, no float
multiplies. -0.0 decodes to -0.0; a weight so large that hi rounds to inf decodes to inf (the fp32
step would overflow there too); every ISA computes the same integers, so all agree bitwise.

Moments, per group of G elements (m and s = sqrt(v) after the update, both fp32)::

    amax  = max |x| over the group, compared as integers on the bits (|x| bits): NaN and inf
            sort above every finite value, so the order is exact and the same on every ISA
    group with a non-finite x (amax bits >= 0x7f800000): scale = NaN (0x7fc0), every q = 0; the
            whole group decodes to NaN (as the fp32 path's state turns NaN where a non-finite
            gradient reached it; rollback restores the pre-step bytes)
    all-zero group (amax == 0): scale = 0, every q = 0, decodes to exactly 0 (never NaN)
    otherwise, with Q = 127 (m) or 255 (s):
        scale = max(bf16_round_up(amax / Q), FLOOR)   FLOOR = 2**-126 (m), 2**-74 (s)
        rcp   = 1 / scale                              (fp32 division, once per group)
        q     = rne(x * rcp)                           |q| <= Q without clamping (x <= amax)
        s instead rounds stochastically with a dither computed from the data (below), then
                q = min(q, 255), and q = max(q, 1) where s > 0: a nonzero v never encodes to 0 (a
                zero v under a nonzero m would divide by eps)
    decode: m = q * scale (exact);  t = q * scale (exact), v = t * t (one rounding)

Why sqrt(v) is not rounded to nearest: v is an EMA with beta2 = 0.999, so it moves ~0.05% a step,
far less than half a quantisation step of an 8-bit code (0.2% at q = 255, 5% at q = 10), and the
group's bf16 scale (spacing 0.4-0.8%) does not follow such a change either: rounded to nearest,
the re-encoded v comes back as it was, and v can only ratchet up (a large gradient), never decay.
Measured (benchmarks/README.md, "Compact quality"): on a synthetic gradient stream sqrt(v) ended
~10% high after 1000 steps, updates ~9% small; the tiny recipe's loss after 1000 steps was +2%
over fp32 on every seed (after: within the seeds' scatter). Stochastic
rounding makes the encode unbiased (E[q] = s * rcp), so v follows its EMA on average. m moves ~10%
a step (beta1 = 0.9), much more than its steps: nearest.

The dither is 24 bits of a hash of the element's new fp32 m and s bits and its index j in the
group (0..31), all in uint32 arithmetic modulo 2**32 (every ISA computes the same integers)::

    h = bits(s) ^ (bits(m) * 0x9E3779B1) ^ (j * 0x632BE5AB)
    h ^= h >> 16;  h *= 0x7FEB352D;  h ^= h >> 15;  h *= 0x846CA68B;  h ^= h >> 16
    u = (h >> 8) * 2**-24                          (exact, in [0, 1))
    q = trunc(fp32(fp32(s * rcp) + u))             (s * rcp >= 0: trunc is floor)

An element whose state changes changes its dither; the result is a function of the stored state
and the gradient only (resume and rollback replay bit for bit). Decode is unchanged: compact bytes
written before this rounding (checkpoints included) decode and load as they are.

bf16_round_up(x) is the least bf16 >= x (x >= 0: add one to the high 16 bits when the low 16 are
nonzero). The floors keep 1/scale finite (m) and a decoded nonzero v nonzero ((2**-74)**2 =
2**-148 is an fp32 denormal): moments below them (denormals) encode coarsely: m below 2**-127
rounds to 0, v to at least 2**-148.

Compact step (`compact_step_`): decode -> the fp32 Adam/AdamW update with the coefficients of
`reference.adam_coefficients`, in the kernel's order and roundings (host/reference.py's
docstring) -> encode, element by element, the gradient read as it landed (fp32, bf16, fp16)::

    g = g_raw * grad_scale;  Adam with L2: g = fma(l2, p, g)
    m = fma(beta1, m, (1-beta1)*g);   v = fma(beta2, v, ((1-beta2)*g)*g)
    s = sqrt(v);  denom = fma(s, inv_sqrt_bc2, eps);  p = fma(-step_size, m/denom, p*decay)

then hi, err from p, and the groups of m and s as above. An inf/NaN gradient makes its element's
p, m, v non-finite, as in the fp32 kernel; encoding then turns that element's master and its
groups of m and v into NaN (or inf), never into finite garbage. Padding (zero state, zero
gradient) steps to zero and stays zero.

`compact_encode_` takes fp32 (or float64, first rounded to fp32) param / exp_avg / exp_avg_sq;
`compact_decode` writes fp32 (or float64: the same, exact, values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from superoffload_hf.host import reference

COMPACT_GROUP = 32
STATE_PRECISIONS = ("fp32", "compact", "compact32")

_M_LEVELS = 127
_S_LEVELS = 255
_M_SCALE_FLOOR = 2.0**-126
_S_SCALE_FLOOR = 2.0**-74
_NAN_BF16_BITS = 0x7FC0
COMPACT_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CompactSpec:
    """One state precision: its name, the dtype of master_err (None for fp32), stored bytes/param."""

    name: str
    err_dtype: Optional[torch.dtype]
    bytes_per_param: float

    @property
    def is_compact(self) -> bool:
        return self.err_dtype is not None

    @property
    def err_bits(self) -> int:
        """B: err holds B + 1 bits of the rounding remainder (units of 2**(15 - B) fp32 ulps of the weight)."""
        if self.err_dtype is None:
            raise ValueError(f"state precision {self.name!r} has no error term.")
        return 7 if self.err_dtype == torch.int8 else 15


_SPECS = {
    "fp32": CompactSpec("fp32", None, 12.0),
    "compact": CompactSpec("compact", torch.int8, 3 + 1 + 1 + 2 * 2 / COMPACT_GROUP),
    "compact32": CompactSpec("compact32", torch.int16, 4 + 1 + 1 + 2 * 2 / COMPACT_GROUP),
}


def spec_of(state_precision: str) -> CompactSpec:
    if state_precision not in _SPECS:
        raise ValueError(f"`state_precision` is {state_precision!r}; valid choices are {list(STATE_PRECISIONS)}.")
    return _SPECS[state_precision]


def scale_numel(n: int) -> int:
    """The number of per-group scales of an n-element buffer: ceil(n / COMPACT_GROUP)."""
    return (int(n) + COMPACT_GROUP - 1) // COMPACT_GROUP


def empty_state(n: int, state_precision: str = "compact") -> tuple:
    """The six zero tensors of an n-element compact buffer (all decode to 0), in the order the
    back-end methods take them."""
    spec = spec_of(state_precision)
    if not spec.is_compact:
        raise ValueError(f"`state_precision` is {state_precision!r}; expected 'compact' or 'compact32'.")
    k = scale_numel(n)
    return (torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=spec.err_dtype),
            torch.zeros(n, dtype=torch.int8), torch.zeros(k, dtype=torch.bfloat16),
            torch.zeros(n, dtype=torch.uint8), torch.zeros(k, dtype=torch.bfloat16))


# ---- fp32 arithmetic, computed in float64 ---------------------------------------------------------


def to_fp32(x: torch.Tensor) -> torch.Tensor:
    """x rounded to fp32 (nearest even), as float64."""
    return x.to(torch.float32).to(torch.float64)


def fma_fp32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c) = round32(a*b + c) of fp32 values held in float64: a*b is exact in float64;
    the sum is rounded to odd (TwoSum error, then a nudge to the odd neighbour), and rounding a
    round-to-odd float64 to fp32 is the correctly rounded result."""
    prod = a * b
    s = prod + c
    bb = s - prod
    err = (prod - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    nudge = (err != 0) & even & torch.isfinite(err)
    toward = torch.where(err > 0, torch.full_like(s, math.inf), torch.full_like(s, -math.inf))
    s = torch.where(nudge, torch.nextafter(s, toward), s)
    return to_fp32(s)


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16).to(torch.int32) & 0xFFFF


def _bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _fp32_bits(x64: torch.Tensor) -> torch.Tensor:
    return x64.to(torch.float32).view(torch.int32)


# ---- master -----------------------------------------------------------------------------------------


def master_err_shift(err_bits: int) -> int:
    """log2 of the fp32 bit-pattern units err counts: 8 for compact (int8), 0 for compact32 (int16)."""
    return 15 - err_bits


def encode_master(w: torch.Tensor, err_dtype: torch.dtype) -> tuple:
    """(hi bf16, err) of fp32 weights w (module docstring): all integer arithmetic on the bits."""
    w32 = w.to(torch.float32)
    hi = w32.to(torch.bfloat16)  # nearest even; torch's NaN bits vary by code path: made 0x7fc0
    hi = torch.where(torch.isnan(w32), _bf16_from_bits(torch.full(w32.shape, _NAN_BF16_BITS, dtype=torch.int32)), hi)
    bits_b = 7 if err_dtype == torch.int8 else 15
    hi_bits = _bf16_bits(hi)
    delta = w32.view(torch.int32).to(torch.int64) - ((hi_bits.to(torch.int64) << 16) - ((hi_bits.to(torch.int64) >> 15) << 32))
    shift = master_err_shift(bits_b)
    if shift:  # round half to even of delta / 2**shift: floor of (delta + 2**(shift-1) - 1 + parity)
        delta = (delta + (2 ** (shift - 1) - 1) + ((delta >> shift) & 1)) >> shift
    err = delta.clamp(-(2**bits_b), 2**bits_b - 1)
    not_finite = (hi_bits & 0x7F80) == 0x7F80
    err = torch.where(not_finite, torch.zeros_like(err), err)
    return hi, err.to(err_dtype)


def decode_master_bits(hi: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """The fp32 bits (int32) of the decoded weight: (bits(hi) << 16) + err * 2**(15 - B), mod 2**32."""
    bits_b = 7 if err.dtype == torch.int8 else 15
    bits = (_bf16_bits(hi).to(torch.int64) << 16) + err.to(torch.int64) * 2 ** master_err_shift(bits_b)
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def decode_master_float64(hi: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """The decoded weight (an fp32 value) in float64."""
    return decode_master_bits(hi, err).view(torch.float32).to(torch.float64)


# ---- moments ----------------------------------------------------------------------------------------


def _grouped(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    pad = scale_numel(n) * COMPACT_GROUP - n
    return torch.nn.functional.pad(x, (0, pad)).view(-1, COMPACT_GROUP)


def _bf16_round_up(x64: torch.Tensor) -> torch.Tensor:
    """The least bf16 >= x for x >= 0 (x fp32 values in float64), as float64."""
    bits = _fp32_bits(x64)
    hi16 = (bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int32)
    return _bf16_from_bits(hi16).to(torch.float64)


def encode_group_scales(x64: torch.Tensor, levels: int, floor: float) -> tuple:
    """Per-group (scale as bf16, rcp float64 (0 where no q is nonzero), non-finite mask) of fp32 values."""
    absbits = _grouped(_fp32_bits(x64)) & 0x7FFFFFFF
    amax_bits = absbits.amax(dim=1)
    not_finite = amax_bits >= 0x7F800000
    zero = amax_bits == 0
    amax = amax_bits.view(torch.float32).to(torch.float64)
    scale = _bf16_round_up(to_fp32(amax / levels)).clamp(min=floor)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    scale_bf16 = scale.to(torch.bfloat16)
    scale_bf16 = torch.where(not_finite, _bf16_from_bits(torch.full_like(amax_bits, _NAN_BF16_BITS)), scale_bf16)
    rcp = torch.where(zero | not_finite, torch.zeros_like(scale), to_fp32(1.0 / scale))
    return scale_bf16, rcp, not_finite


def _quantise(x64: torch.Tensor, rcp: torch.Tensor, not_finite: torch.Tensor) -> torch.Tensor:
    n = x64.numel()
    grouped = _grouped(x64)
    q = torch.round(to_fp32(grouped * rcp[:, None]))
    q = torch.where(not_finite[:, None] | ~torch.isfinite(q), torch.zeros_like(q), q)
    return q.reshape(-1)[:n]


def encode_exp_avg(m: torch.Tensor) -> tuple:
    """(q int8, scale bf16) of fp32 m."""
    m64 = to_fp32(m.to(torch.float64))
    scale, rcp, not_finite = encode_group_scales(m64, _M_LEVELS, _M_SCALE_FLOOR)
    return _quantise(m64, rcp, not_finite).to(torch.int8), scale


def encode_exp_avg_sq(v: torch.Tensor, m: torch.Tensor) -> tuple:
    """(q uint8 of sqrt(v), scale bf16) of fp32 v, beside the fp32 m whose bits seed the dither."""
    s = to_fp32(torch.sqrt(to_fp32(v.to(torch.float64))))
    return _encode_sqrt(s, to_fp32(m.to(torch.float64)))


_U32 = 0xFFFFFFFF


def _mul_u32(a: torch.Tensor, k: int) -> torch.Tensor:
    """a * k mod 2**32 for uint32 values a in int64 (split so no product leaves int64)."""
    return ((a * (k & 0xFFFF)) + (((a * (k >> 16)) & 0xFFFF) << 16)) & _U32


def sqrt_v_dither(m64: torch.Tensor, s64: torch.Tensor) -> torch.Tensor:
    """The dither u in [0, 1) of each element's sqrt(v) encode (module docstring), as float64."""
    n = s64.numel()
    lane = torch.arange(n, dtype=torch.int64) % COMPACT_GROUP
    h = (_fp32_bits(s64).to(torch.int64) & _U32) ^ _mul_u32(_fp32_bits(m64).to(torch.int64) & _U32, 0x9E3779B1)
    h = h ^ _mul_u32(lane, 0x632BE5AB)
    h = h ^ (h >> 16)
    h = _mul_u32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul_u32(h, 0x846CA68B)
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float64) * 2.0**-24


def _encode_sqrt(s: torch.Tensor, m: torch.Tensor) -> tuple:
    n = s.numel()
    scale, rcp, not_finite = encode_group_scales(s, _S_LEVELS, _S_SCALE_FLOOR)
    y = to_fp32(_grouped(s) * rcp[:, None]).reshape(-1)[:n]
    q = torch.trunc(to_fp32(y + sqrt_v_dither(m, s))).clamp(max=_S_LEVELS)
    q = torch.where(_expand(not_finite, n) | ~torch.isfinite(q), torch.zeros_like(q), q)
    q = torch.where((s > 0) & (q < 1) & ~_expand(not_finite, n), torch.ones_like(q), q)
    return q.to(torch.uint8), scale


def _expand(per_group: torch.Tensor, n: int) -> torch.Tensor:
    return per_group.repeat_interleave(COMPACT_GROUP)[:n]


def decode_exp_avg_float64(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale: exact in fp32 (and float64)."""
    return q.to(torch.float64) * _expand(scale.to(torch.float64), q.numel())


def decode_exp_avg_sq_float64(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q * scale)**2 rounded to fp32 (the decoded v the step uses), as float64."""
    t = q.to(torch.float64) * _expand(scale.to(torch.float64), q.numel())
    return to_fp32(t * t)


# ---- checks -----------------------------------------------------------------------------------------


def check_compact(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale) -> int:
    """The six compact tensors are CPU, flat, contiguous, of the format's dtypes and lengths; returns n."""
    n = master_bf16.numel()
    expected = (("master_bf16", master_bf16, (torch.bfloat16,), n),
                ("master_err", master_err, (torch.int8, torch.int16), n),
                ("exp_avg_q", exp_avg_q, (torch.int8,), n),
                ("exp_avg_scale", exp_avg_scale, (torch.bfloat16,), scale_numel(n)),
                ("exp_avg_sq_q", exp_avg_sq_q, (torch.uint8,), n),
                ("exp_avg_sq_scale", exp_avg_sq_scale, (torch.bfloat16,), scale_numel(n)))
    for name, t, dtypes, numel in expected:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` is {type(t).__name__}; expected a torch.Tensor.")
        if t.dtype not in dtypes:
            raise TypeError(f"`{name}` is {t.dtype}; expected {' or '.join(map(str, dtypes))} (the compact format, "
                            "superoffload_hf/host/compact.py).")
        if t.device.type != "cpu":
            raise TypeError(f"`{name}` is on {t.device}; expected a CPU tensor (the compact state lives in host memory).")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"`{name}` has shape {tuple(t.shape)}, strides {t.stride()}; expected a flat contiguous "
                             "1-D tensor (pass the buffer itself, not a strided view).")
        if t.numel() != numel:
            what = f"ceil({n}/{COMPACT_GROUP})" if "scale" in name else "the length of `master_bf16`"
            raise ValueError(f"`{name}` has {t.numel()} elements; expected {numel} ({what}).")
    return n


def _check_fp(name: str, t: torch.Tensor, n: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, torch.float64) or t.device.type != "cpu":
        what = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"`{name}` is {what}; expected an fp32 (or float64) CPU tensor.")
    if t.dim() != 1 or not t.is_contiguous() or t.numel() != n:
        raise ValueError(f"`{name}` has shape {tuple(t.shape)}, strides {t.stride()}; expected a flat contiguous "
                         f"1-D tensor of {n} elements (the length of `master_bf16`).")


def check_grad(grad: torch.Tensor, n: int) -> None:
    if not isinstance(grad, torch.Tensor) or grad.dtype not in COMPACT_GRAD_DTYPES or grad.device.type != "cpu":
        what = f"{grad.dtype} on {grad.device}" if isinstance(grad, torch.Tensor) else type(grad).__name__
        raise TypeError(f"`grad` is {what}; expected a float32, bfloat16 or float16 CPU tensor (as it landed).")
    if grad.dim() != 1 or not grad.is_contiguous() or grad.numel() != n:
        raise ValueError(f"`grad` has shape {tuple(grad.shape)}, strides {grad.stride()}; expected a flat contiguous "
                         f"1-D tensor of {n} elements (the length of `master_bf16`).")


# ---- the back-end operations ------------------------------------------------------------------------


def _store(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale, p64, m64, s64):
    hi, err = encode_master(p64.to(torch.float32), master_err.dtype)
    mq, ms = encode_exp_avg(m64)
    vq, vs = _encode_sqrt(s64, m64)
    for dst, src in ((master_bf16, hi), (master_err, err), (exp_avg_q, mq), (exp_avg_scale, ms),
                     (exp_avg_sq_q, vq), (exp_avg_sq_scale, vs)):
        dst.copy_(src)


def compact_encode_(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                    param, exp_avg, exp_avg_sq) -> None:
    """fp32 (or float64, rounded to fp32 first) state -> the compact bytes, in place."""
    n = check_compact(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale)
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_fp(name, t, n)
    p64 = to_fp32(param.to(torch.float64))
    m64 = to_fp32(exp_avg.to(torch.float64))
    s64 = to_fp32(torch.sqrt(to_fp32(exp_avg_sq.to(torch.float64))))
    _store(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale, p64, m64, s64)


def decode_float64(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale) -> tuple:
    """(param, exp_avg, exp_avg_sq) as float64 tensors holding the exact fp32 values of the decode."""
    return (decode_master_float64(master_bf16, master_err), decode_exp_avg_float64(exp_avg_q, exp_avg_scale),
            decode_exp_avg_sq_float64(exp_avg_sq_q, exp_avg_sq_scale))


def compact_decode(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                   param, exp_avg, exp_avg_sq) -> None:
    """The compact bytes -> fp32 (or float64) param, exp_avg, exp_avg_sq, written in place."""
    n = check_compact(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale)
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_fp(name, t, n)
    decoded = decode_float64(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale)
    for dst, src in zip((param, exp_avg, exp_avg_sq), decoded):
        dst.copy_(src)


def adam_update_fp32(p, m, v, g_raw, c: reference.AdamCoefficients) -> tuple:
    """The fp32 kernel's update (module docstring) on fp32 values held in float64; returns (p, m, v, s)."""
    f = lambda x: torch.full_like(p, x)  # noqa: E731  (fp32 coefficients, as make_coeffs rounds them)
    beta1, beta2, omb1, omb2 = (to_fp32(f(x)) for x in (c.beta1, c.beta2, c.one_minus_beta1, c.one_minus_beta2))
    step_size, inv_sqrt_bc2, eps = (to_fp32(f(x)) for x in (c.step_size, c.inv_sqrt_bc2, c.eps))
    decay, l2, grad_scale = (to_fp32(f(x)) for x in (c.decay, c.l2, c.grad_scale))
    g = to_fp32(g_raw * grad_scale)
    if float(torch.tensor(c.l2, dtype=torch.float32)) != 0.0:  # the kernel tests l2 rounded to fp32
        g = fma_fp32(l2, p, g)
    m = fma_fp32(beta1, m, to_fp32(omb1 * g))
    v = fma_fp32(beta2, v, to_fp32(to_fp32(omb2 * g) * g))
    s = to_fp32(torch.sqrt(v))
    denom = fma_fp32(s, inv_sqrt_bc2, eps)
    p = fma_fp32(-step_size, to_fp32(m / denom), to_fp32(p * decay))
    return p, m, v, s


def compact_step_(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale, grad, *,
                  step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction=True, grad_scale=1.0) -> None:
    """One Adam/AdamW step on the compact state in place: decode, fp32 update, encode."""
    n = check_compact(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale)
    check_grad(grad, n)
    c = reference.adam_coefficients(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                    adamw=adamw, bias_correction=bias_correction, grad_scale=grad_scale)
    p, m, v = decode_float64(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale)
    p, m, _, s = adam_update_fp32(p, m, v, grad.to(torch.float64), c)
    _store(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale, p, m, s)


def bytes_copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src bit for bit (same dtype and element count, both contiguous CPU tensors, disjoint)."""
    check_bytes_pair(dst, src)
    dst.copy_(src)


def check_bytes_pair(dst: torch.Tensor, src: torch.Tensor) -> None:
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            what = f"on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"`{name}` is {what}; expected a CPU tensor.")
        if not t.is_contiguous():
            raise ValueError(f"`{name}` has shape {tuple(t.shape)}, strides {t.stride()}; expected a contiguous "
                             "tensor (the copy never works on a hidden copy).")
    if dst.dtype != src.dtype:
        raise TypeError(f"`dst` is {dst.dtype}, `src` is {src.dtype}; expected the same dtype (a bytewise copy).")
    if dst.numel() != src.numel():
        raise ValueError(f"`dst` has {dst.numel()} elements, `src` has {src.numel()}; expected the same number.")
    if reference._overlaps(dst, src):
        raise ValueError("`dst` and `src` share memory; copy into a separate buffer.")
