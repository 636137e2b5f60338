"""The compact host state format (superoffload_hf/host/compact.py): encode/decode, the step, checks."""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import pytest
import torch

from _kernel_math import HYPERS, STEP_BOUND_ULPS, assert_bitwise_equal, random_state, step_magnitudes, ulp32
from superoffload_hf.host import compact, reference
from superoffload_hf.host.kernel import ReferenceHostAdam
from superoffload_hf.host.segmented import SegmentedGrad

G = compact.COMPACT_GROUP
SIZES = [1, 31, 32, 33, 64, 100, 4099]
PRECISIONS = ["compact", "compact32"]


def encoded(p, m, v, precision="compact"):
    state = compact.empty_state(p.numel(), precision)
    compact.compact_encode_(*state, p, m, v)
    return state


def per_element(scale: torch.Tensor, n: int) -> torch.Tensor:
    return scale.double().repeat_interleave(G)[:n]


def master_unit(hi: torch.Tensor, bits_b: int) -> torch.Tensor:
    biased = (hi.view(torch.int16).int() & 0xFFFF) >> 7 & 0xFF
    return torch.ldexp(torch.ones(hi.numel(), dtype=torch.float64), (biased.clamp(min=1) - 135 - bits_b).double())


def test_spec_of_names_the_precisions_and_their_bytes():
    assert compact.spec_of("compact").bytes_per_param == 5.125
    assert compact.spec_of("compact32").bytes_per_param == 6.125
    assert compact.spec_of("compact32").err_dtype == torch.int16 and compact.spec_of("compact").err_bits == 7
    assert not compact.spec_of("fp32").is_compact
    with pytest.raises(ValueError, match=r"`state_precision` is 'int8'.*'compact32'"):
        compact.spec_of("int8")
    assert [compact.scale_numel(n) for n in (0, 1, 31, 32, 33)] == [0, 1, 1, 1, 2]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_errors_are_within_half_a_quantisation_step(precision, n):
    p, m, v, _ = random_state(n, seed=n)
    state = encoded(p, m, v, precision)
    hi, err, mq, ms, vq, vs = state
    bits_b = compact.spec_of(precision).err_bits
    p2, m2, v2 = (torch.empty(n) for _ in range(3))
    compact.compact_decode(*state, p2, m2, v2)
    # master: err rounds the remainder to nearest in units no larger than half an ulp of hi / 2**B
    # (the clamp at 2**B - 1 costs at most one more unit)
    assert bool(((p2.double() - p.double()).abs() <= master_unit(hi, bits_b)).all())
    assert bool(((p2.double() - p.double()).abs() <= master_unit(hi, bits_b) / 2).sum() >= n - n // 100 - 1)
    assert_bitwise_equal(hi, p.to(torch.bfloat16), "hi is the bf16 rounding of the weight")
    # exp_avg: half a step of its group's scale (plus the fp32 rounding of m * (1/scale))
    m_err = (m2.double() - m.double()).abs()
    assert bool((m_err <= per_element(ms, n) * (0.5 + 1e-5)).all())
    # sqrt(v), rounded stochastically: floor or ceil of s / scale (less than a step off), or the
    # forced q = 1 (decoded at or above the true value)
    s, t = v.double().sqrt(), per_element(vs, n) * vq.double()
    ok = ((t - s).abs() <= per_element(vs, n) * (1 + 1e-5)) | ((vq == 1) & (t >= s))
    assert bool(ok.all())
    assert bool((v2.double() == (t * t).float().double()).all())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_master_decode_is_exact_and_bf16_part_is_the_weight(precision):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5000, generator=gen) * 10.0 ** torch.randint(-30, 30, (5000,), generator=gen)
    w[:4] = torch.tensor([0.0, -0.0, 1.0, -3.0])
    w[4:8] = torch.tensor([2.0**-149, -(2.0**-140), 2.0**-126, 3.0e38])  # denormals, the bf16 overflow edge
    hi, err = compact.encode_master(w, compact.spec_of(precision).err_dtype)
    exact = compact.decode_master_float64(hi, err)
    assert bool((exact.float().double() == exact).all()), "decode must be exact in fp32"
    bits_b = compact.spec_of(precision).err_bits
    finite = torch.isfinite(hi.float())
    assert bool(((exact - w.double()).abs()[finite] <= master_unit(hi, bits_b)[finite]).all())
    # the weight carries 8 + B + 1 significant bits: compact32 keeps ~24 bits, compact ~16
    rel = ((exact - w.double()).abs() / w.double().abs().clamp(min=2.0**-126))[finite]
    assert float(rel.max()) <= 2.0 ** -(8 + bits_b)


def test_master_split_of_chosen_values_by_hand():
    # 1 + 2**-12: bf16 keeps 1.0; delta = 2**-12 / 2**-23 = 2048 fp32 ulps -> compact err = 2048/256 = 8
    # 1 - 2**-12: just below the binade edge the fp32 ulp halves: delta = -4096 -> err = -16 (exact)
    w = torch.tensor([1.0 + 2.0**-12, 1.0 - 2.0**-12, float("nan"), float("inf"), -2.0**-149, -0.0])
    hi, err = compact.encode_master(w, torch.int8)
    assert hi.float().tolist()[:2] == [1.0, 1.0] and err.tolist()[:2] == [8, -16]
    assert math.isnan(hi[2].item()) and err[2] == 0 and hi[3].item() == math.inf and err[3] == 0
    # the smallest denormal: bf16 rounds it to -0 (bits 0x8000); delta = 1 (sign-magnitude) -> rne(1/256) = 0
    assert hi[4].view(torch.int16).item() == -0x8000 and err[4] == 0
    hi16, err16 = compact.encode_master(w, torch.int16)
    assert err16.tolist()[:2] == [2**11, -(2**12)] and err16[4] == 1  # compact32 keeps it exactly
    decoded = compact.decode_master_float64(hi16, err16)
    assert decoded[:2].tolist() == [1.0 + 2.0**-12, 1.0 - 2.0**-12] and decoded[4].item() == -(2.0**-149)
    assert math.copysign(1.0, compact.decode_master_float64(hi, err)[5].item()) == -1.0  # -0.0 stays -0.0


def bits_of(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def test_master_err_is_the_rounded_bit_pattern_remainder_with_ties_to_even():
    # delta (the remainder in fp32 ulps) -> compact err = rne(delta / 256): the ties round to even
    base = bits_of(1.5)  # 0x3fc00000, a bf16 value
    deltas = [0, 1, 127, 128, 129, 384, 640, -128, -384, 32767, -32767, -32768, 32768]
    w = torch.tensor([base + d for d in deltas], dtype=torch.int32).view(torch.float32)
    hi, err = compact.encode_master(w, torch.int8)
    hi16, err16 = compact.encode_master(w, torch.int16)
    # +32768 is a tie that rounds hi down (to even): clamped to 127 / 32767
    assert err.tolist() == [0, 0, 0, 0, 1, 2, 2, 0, -2, 127, -128, -128, 127]
    assert err16.tolist()[:-1] == deltas[:-1] and err16[-1] == 32767
    # base - 32768 is a tie between 0x3fbf (odd) and 0x3fc0: hi rounds up to base, delta = -32768
    assert (compact._bf16_bits(hi)[-2] << 16).item() == base and (compact._bf16_bits(hi)[-1] << 16).item() == base
    assert bool((hi.view(torch.int16) == hi16.view(torch.int16)).all())


def test_master_decode_is_integer_shift_and_add_on_the_bits():
    gen = torch.Generator().manual_seed(5)
    hi_bits = torch.randint(0, 0x7F80, (4000,), generator=gen, dtype=torch.int32)
    hi_bits[::2] |= 0x8000  # negative weights
    hi = compact._bf16_from_bits(hi_bits)
    err8 = torch.randint(-128, 128, (4000,), generator=gen, dtype=torch.int32)
    err16 = torch.randint(-32768, 32768, (4000,), generator=gen, dtype=torch.int32)
    for err, mult, dtype in ((err8, 256, torch.int8), (err16, 1, torch.int16)):
        want = ((hi_bits.long() << 16) + err.long() * mult) & 0xFFFFFFFF
        want = torch.where(want >= 2**31, want - 2**32, want).to(torch.int32)
        got = compact.decode_master_bits(hi, err.to(dtype))
        assert_bitwise_equal(got, want, f"decode of {dtype}")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_master_precision_is_continuous_across_binade_edges(precision):
    # weights just below and above powers of two (where hi's exponent changes): the error stays
    # within half a unit of 2**(15 - B) fp32 ulps of w, on both sides of every edge
    bits_b = compact.spec_of(precision).err_bits
    edges = [bits_of(2.0**k) for k in range(-125, 127, 7)] + [bits_of(-(2.0**k)) for k in range(-120, 120, 11)]
    offsets = list(range(-40000, 40001, 997))
    w_bits = torch.tensor([e + o for e in edges for o in offsets], dtype=torch.int64)
    w = w_bits.to(torch.int32).view(torch.float32)
    hi, err = compact.encode_master(w, compact.spec_of(precision).err_dtype)
    got_bits = compact.decode_master_float64(hi, err).float().view(torch.int32).long()
    half_unit = 2 ** (15 - bits_b) // 2
    assert int((got_bits - w_bits.to(torch.int32).long()).abs().max()) <= max(half_unit, 1)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 96])
def test_all_zero_groups_decode_to_zero_with_zero_scales(n):
    p, m, v, _ = random_state(n, seed=1)
    m[:32], v[:32] = 0.0, 0.0
    hi, err, mq, ms, vq, vs = state = encoded(p, m, v)
    p2, m2, v2 = (torch.full((n,), float("nan")) for _ in range(3))
    compact.compact_decode(*state, p2, m2, v2)
    assert ms[0].item() == 0.0 and vs[0].item() == 0.0
    assert bool((m2[:32] == 0).all()) and bool((v2[:32] == 0).all()) and not bool(m2.isnan().any())


def test_nonzero_v_never_decodes_to_zero_even_beside_a_large_one_or_as_a_denormal():
    v = torch.zeros(96)
    v[0], v[1:31] = 1.0, torch.logspace(-30, -10, 30)  # tiny beside a large one in one group
    v[32], v[33:40] = 2.0**-149, 2.0**-140  # denormals, alone in their group
    v[64:96] = torch.tensor(1e-38) * torch.rand(32, generator=torch.Generator().manual_seed(0))
    v[70] = 0.0
    _, _, _, _, vq, vs = state = encoded(torch.zeros(96), torch.zeros(96), v)
    decoded = [torch.empty(96) for _ in range(3)]
    compact.compact_decode(*state, *decoded)
    assert bool(((decoded[2] > 0) == (v > 0)).all())
    assert bool(((vq > 0) == (v > 0)).all())


def test_sqrt_v_dither_is_the_documented_uint32_hash():
    m = torch.tensor([0.0, -1.5, 3.0e-7, 2.0**-149] + [0.25] * 30 + [1.0], dtype=torch.float64)
    s = torch.tensor([0.0, 2.0, 1.0e-3, 5.0] + [0.5] * 30 + [7.0], dtype=torch.float64)

    def bits(x):
        return struct.unpack("I", struct.pack("f", x))[0]

    def by_hand(mf, sf, lane):
        h = bits(sf) ^ ((bits(mf) * 0x9E3779B1) & 0xFFFFFFFF) ^ ((lane * 0x632BE5AB) & 0xFFFFFFFF)
        h ^= h >> 16
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x846CA68B) & 0xFFFFFFFF
        h ^= h >> 16
        return (h >> 8) / 2.0**24

    want = [by_hand(float(a), float(b), i % G) for i, (a, b) in enumerate(zip(m, s))]
    assert compact.sqrt_v_dither(m, s).tolist() == want
    assert len(set(want[4:32])) == 28  # equal values at different places in a group: different dithers


def test_sqrt_v_rounds_without_bias():
    # groups with amax 255 (scale 1): every other s = 10.3 rounds up with probability 0.3
    n = 32 * 2000
    s = torch.full((n,), 10.3, dtype=torch.float64)
    s[::32] = 255.0
    m = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q, scale = compact.encode_exp_avg_sq(s * s, m)
    assert set(scale.float().tolist()) == {1.0}
    rest = q[torch.arange(n) % 32 != 0].double()
    assert set(rest.tolist()) == {10.0, 11.0}
    assert abs(float(rest.mean()) - 10.3) < 0.01  # nearest gives 10 everywhere
    assert bool((q[::32] == 255).all())


def test_v_follows_its_decay_under_zero_gradients():
    # beta2 = 0.999 shrinks v by 0.1% a step, far below half a step of the 8-bit code and of the
    # bf16 scale's spacing: rounded to nearest, v came back unchanged every step (stuck where it
    # was: 0.99998 of itself here; compact_ablation.py --synthetic: sqrt(v) ~10% high after 1000
    # steps); rounded without bias it decays.
    n, steps = 32 * 64, 300
    p, m, v, _ = random_state(n, seed=5)
    state = encoded(p, m, v.abs() + 1e-6)
    v0 = compact.decode_float64(*state)[2]
    for t in range(1, steps + 1):
        compact.compact_step_(*state, torch.zeros(n), **dict(HYPERS[0], step=t))
    ratio = float(compact.decode_float64(*state)[2].sum() / v0.sum())
    expected = float(torch.tensor(0.999, dtype=torch.float32)) ** steps
    assert abs(ratio - expected) < 0.03 * expected, (ratio, expected)


def test_denormal_and_tiny_moments_quantise_without_nan_or_inf():
    m = torch.tensor([2.0**-149, -(2.0**-149)] * 16 + [1e-39] * 32)
    state = encoded(torch.zeros(64), m, m.abs())
    decoded = [torch.empty(64) for _ in range(3)]
    compact.compact_decode(*state, *decoded)
    assert all(bool(torch.isfinite(t).all()) for t in decoded)
    assert state[3].float().tolist() == [2.0**-126, 2.0**-126]  # the floor keeps 1/scale finite
    assert bool(((decoded[1] - m).abs() <= 2.0**-127).all())


def test_non_finite_moments_make_their_whole_group_nan():
    m, v = torch.ones(64), torch.ones(64)
    m[5] = float("inf")
    v[40] = float("nan")
    state = encoded(torch.ones(64), m, v)
    assert math.isnan(state[3][0].item()) and state[3][1].item() > 0
    assert math.isnan(state[5][1].item()) and state[5][0].item() > 0
    assert bool((state[2][:32] == 0).all()) and bool((state[4][32:] == 0).all())
    decoded = [torch.empty(64) for _ in range(3)]
    compact.compact_decode(*state, *decoded)
    assert bool(decoded[1][:32].isnan().all()) and bool(((decoded[1][32:] - 1).abs() < 1e-3).all())
    assert bool(decoded[2][32:].isnan().all()) and bool(torch.isfinite(decoded[2][:32]).all())


def fp32_nearest(x: Fraction) -> float:
    """The fp32 value nearest to the exact rational x (ties to even), by exact comparison with the
    fp32 neighbours of float(x)."""
    bits = struct.unpack("I", struct.pack("f", float(x)))[0]
    candidates = [struct.unpack("f", struct.pack("I", b & 0xFFFFFFFF))[0] for b in (bits - 1, bits, bits + 1)]
    finite = [c for c in candidates if math.isfinite(c)]
    return min(finite, key=lambda c: (abs(Fraction(c) - x), struct.unpack("I", struct.pack("f", c))[0] & 1))


def test_fma_fp32_is_the_correctly_rounded_fp32_fma():
    rng = random.Random(5)
    a, b, c = [], [], []
    for k in range(3000):
        x = struct.unpack("f", struct.pack("f", rng.uniform(-4, 4) * 2.0 ** rng.randint(-20, 20)))[0]
        y = struct.unpack("f", struct.pack("f", rng.uniform(-4, 4)))[0]
        # every third c cancels most of x*y: the sum then needs many more bits than fp32 has
        z = -x * y * (1 + rng.uniform(-1e-6, 1e-6)) if k % 3 == 0 else rng.uniform(-4, 4) * 2.0 ** rng.randint(-30, 10)
        a.append(x), b.append(y), c.append(struct.unpack("f", struct.pack("f", z))[0])
    # double rounding: (1 + 2**-12)**2 = 1 + 2**-11 + 2**-24 is an fp32 midpoint; a tiny c decides
    # the direction, but a float64 sum would round back onto the midpoint (then ties go to even)
    for sign in (1.0, -1.0):
        for tiny in (2.0**-80, -(2.0**-80)):
            a.append(sign * (1 + 2.0**-12)), b.append(1 + 2.0**-12), c.append(sign * tiny)
    got = compact.fma_fp32(*(torch.tensor(t, dtype=torch.float64) for t in (a, b, c)))
    want = [fp32_nearest(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in zip(a, b, c)]
    assert got.tolist() == want


def float64_adam(state64, grad, hyper):
    p, m, v = (t.clone() for t in state64)
    reference.adam_step_(p, m, v, grad.double(), **hyper)
    return p, m, v


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n", [1, 31, 32, 33, 4099])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_step_matches_float64_adam_on_the_decoded_state_within_the_quantisation(precision, n, grad_dtype):
    for k, hyper in enumerate(HYPERS):
        p, m, v, g = random_state(n, seed=10 * n + k, grad_dtype=grad_dtype)
        state = encoded(p, m, v, precision)
        before = compact.decode_float64(*state)
        compact.compact_step_(*state, g, **hyper)
        hi, err, mq, ms, vq, vs = state
        after = compact.decode_float64(*state)
        p64, m64, v64 = float64_adam(before, g, hyper)
        what = f"{precision} n={n} grad={grad_dtype} hyper#{k}"
        # the fp32 update's bound (tests/_kernel_math.py), then half a quantisation step
        mags = step_magnitudes(before, g, hyper, v64)
        slack = {k: STEP_BOUND_ULPS[k] * ulp32(mags[k]) for k in mags}
        unit = master_unit(hi, compact.spec_of(precision).err_bits)
        assert bool(((after[0] - p64).abs() <= unit + slack["param"]).all()), what
        assert bool(((after[1] - m64).abs() <= per_element(ms, n) * 0.51 + slack["exp_avg"]).all()), what
        s = after[2].sqrt()
        s_slack = slack["exp_avg_sq"] / v64.sqrt().clamp(min=1e-30)  # d sqrt(v) = dv / (2 sqrt(v))
        ok = ((s - v64.sqrt()).abs() <= per_element(vs, n) * 1.01 + s_slack) | (vq == 1)
        assert bool(ok.all()), what


def test_step_is_decode_then_the_kernel_order_update_then_encode():
    n = 1000
    p, m, v, g = random_state(n, seed=4, grad_dtype=torch.bfloat16)
    hyper = HYPERS[2]  # Adam with L2
    state = encoded(p, m, v)
    p64, m64, v64 = compact.decode_float64(*state)
    c = reference.adam_coefficients(**hyper)
    p1, m1, v1, _ = compact.adam_update_fp32(p64, m64, v64, g.double(), c)
    expected = encoded(p1.float(), m1.float(), v1.float())
    compact.compact_step_(*state, g, **hyper)
    for got, want in zip(state, expected):
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.uint8 else got,
                           want.view(torch.uint8) if want.dtype != torch.uint8 else want)


def test_padding_zero_state_with_zero_gradient_stays_zero():
    state = compact.empty_state(64)
    compact.compact_step_(*state, torch.zeros(64), **HYPERS[1])
    assert all(not bool(t.view(torch.uint8).any()) for t in state)


def test_a_nan_gradient_turns_its_element_and_groups_nan_never_finite_garbage():
    p, m, v, g = random_state(64, seed=2)
    g[3] = float("nan")
    state = encoded(p, m, v)
    compact.compact_step_(*state, g, **HYPERS[0])
    decoded = compact.decode_float64(*state)
    assert math.isnan(decoded[0][3].item()) and bool(torch.isfinite(decoded[0][torch.arange(64) != 3]).all())
    assert bool(decoded[1][:32].isnan().all()) and bool(decoded[2][:32].isnan().all())
    assert bool(torch.isfinite(decoded[1][32:]).all())


def test_reference_back_end_takes_segmented_gradients_and_copies_bytes():
    backend = ReferenceHostAdam(threads=1)
    p, m, v, g = random_state(70, seed=9)
    flat, seg = encoded(p, m, v), encoded(p, m, v)
    backend.compact_step_(*flat, g, **HYPERS[1])
    backend.compact_step_(*seg, SegmentedGrad([g[:10], g[10:40].bfloat16().float(), g[40:]], [10, 30, 30]),
                          **HYPERS[1])
    # segment 1 went through bf16: only its groups may differ; the others match bitwise
    assert torch.equal(flat[0][40:], seg[0][40:])
    copy = [torch.empty_like(t) for t in flat]
    for dst, src in zip(copy, flat):
        backend.bytes_copy_(dst, src)
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))


def test_bad_inputs_name_the_argument_the_value_and_the_expectation():
    state = list(compact.empty_state(40))
    with pytest.raises(ValueError, match=r"`exp_avg_scale` has 1 elements; expected 2 \(ceil\(40/32\)\)"):
        compact.compact_step_(*state[:3], torch.zeros(1, dtype=torch.bfloat16), *state[4:], torch.zeros(40),
                              **HYPERS[0])
    bad = state.copy()
    bad[2] = torch.zeros(40, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"`exp_avg_q` is torch.uint8; expected torch.int8"):
        compact.compact_step_(*bad, torch.zeros(40), **HYPERS[0])
    with pytest.raises(TypeError, match=r"`grad` is torch.int32 on cpu; expected a float32, bfloat16 or float16"):
        compact.compact_step_(*state, torch.zeros(40, dtype=torch.int32), **HYPERS[0])
    with pytest.raises(ValueError, match=r"`param` has shape \(39,\).*40 elements"):
        compact.compact_encode_(*state, torch.zeros(39), torch.zeros(40), torch.zeros(40))
    with pytest.raises(TypeError, match=r"`dst` is torch.int8, `src` is torch.uint8"):
        compact.bytes_copy_(state[2], state[4])
