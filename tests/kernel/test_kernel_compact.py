"""GraceAdam's compact-state kernels on every ISA this CPU runs: bitwise equal to host/compact.py."""

from __future__ import annotations

import math

import pytest
import torch

from _kernel_math import HYPERS, random_state
from superoffload_hf.host import compact
from superoffload_hf.host.segmented import SegmentedGrad

PRECISIONS = ["compact", "compact32"]
# groups of 32 and their neighbours; the 8/16-lane vector widths; a gather block (2048) and the
# pool's grain (16384) of the binding, and sizes past them; the tiles of the vector paths (8 groups
# = 256 elements on AVX2, 16 groups = 512 on AVX-512) and their neighbours
SIZES = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 95, 97, 255, 256, 257, 511, 512, 513, 1025, 2047, 2048,
         2049, 3001]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def assert_same_bytes(got, want, what: str) -> None:
    names = ("master_bf16", "master_err", "exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale")
    for name, a, b in zip(names, got, want):
        if not torch.equal(byte_view(a), byte_view(b)):
            if a.shape != b.shape:
                raise AssertionError(f"{what}: {name} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
            i = int((byte_view(a) != byte_view(b)).nonzero()[0]) // a.element_size()
            raise AssertionError(f"{what}: {name} differs at {i}: {a[i].item()!r} vs {b[i].item()!r}")


def compact_state(n, seed, precision, grad_dtype=torch.float32):
    p, m, v, g = random_state(n, seed=seed, grad_dtype=grad_dtype)
    state = compact.empty_state(n, precision)
    compact.compact_encode_(*state, p, m, v)
    return state, g


def clone(state):
    return [t.clone() for t in state]


def reference_step(state, g, hyper):
    out = clone(state)
    compact.compact_step_(*out, g, **hyper)
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_step_is_bitwise_the_reference_at_group_and_vector_edges(cpp_adam, isa, precision, grad_dtype):
    adam = cpp_adam(isa)
    for n in SIZES:
        for k, hyper in enumerate(HYPERS):
            state, g = compact_state(n, 1000 * n + k, precision, grad_dtype)
            got = clone(state)
            adam.compact_step_(*got, g, **hyper)
            assert_same_bytes(got, reference_step(state, g, hyper), f"isa={isa} {precision} n={n} {grad_dtype} #{k}")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fifty_steps_stay_bitwise_the_reference(cpp_adam, isa, precision):
    adam = cpp_adam(isa)
    n = 1000
    state, _ = compact_state(n, 3, precision)
    ref = clone(state)
    gen = torch.Generator().manual_seed(4)
    for step in range(1, 51):
        g = (torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 1, (n,), generator=gen)).bfloat16()
        hyper = dict(step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=step % 2 == 0)
        adam.compact_step_(*state, g, **hyper)
        compact.compact_step_(*ref, g, **hyper)
        assert_same_bytes(state, ref, f"isa={isa} {precision} step {step}")


def test_step_on_the_pool_across_chunks_is_bitwise_the_reference(cpp_adam, isa):
    n = 3 * 16384 + 45
    state, g = compact_state(n, 5, "compact")
    got = clone(state)
    cpp_adam(isa, threads=2).compact_step_(*got, g, **HYPERS[1])
    assert_same_bytes(got, reference_step(state, g, HYPERS[1]), f"isa={isa} n={n} 2 threads")


def test_step_equals_kernel_decode_then_the_fp32_kernel_step_then_encode(cpp_adam, isa):
    # ties the fused step to the fp32 GraceAdam it extends: the same update, bit for bit
    adam = cpp_adam(isa)
    for k, hyper in enumerate(HYPERS):
        n = 517
        state, g = compact_state(n, 70 + k, "compact32", torch.bfloat16)
        p, m, v = (torch.empty(n) for _ in range(3))
        adam.compact_decode(*state, p, m, v)
        adam.adam_step_(p, m, v, g, **hyper)
        want = compact.empty_state(n, "compact32")
        adam.compact_encode_(*want, p, m, v)
        got = clone(state)
        adam.compact_step_(*got, g, **hyper)
        assert_same_bytes(got, want, f"isa={isa} hyper #{k}")


def test_all_zero_groups_stay_zero_and_decode_to_zero(cpp_adam, isa):
    n = 100
    state, g = compact_state(n, 6, "compact")
    p, m, v = (torch.empty(n) for _ in range(3))
    compact.compact_decode(*state, p, m, v)
    m[32:64], v[32:64], g[32:64] = 0.0, 0.0, 0.0  # a group with no gradient yet
    p[96:], m[96:], v[96:], g[96:] = 0.0, 0.0, 0.0, 0.0  # padding at the end of a partial group
    compact.compact_encode_(*state, p, m, v)
    got = clone(state)
    cpp_adam(isa).compact_step_(*got, g, **HYPERS[0])
    assert_same_bytes(got, reference_step(state, g, HYPERS[0]), f"isa={isa}")
    assert got[3][1].item() == 0.0 and got[5][1].item() == 0.0
    out = [torch.full((n,), math.nan) for _ in range(3)]
    cpp_adam(isa).compact_decode(*got, *out)
    assert bool((out[1][32:64] == 0).all()) and bool((out[2][32:64] == 0).all())
    padding = compact.empty_state(64)
    cpp_adam(isa).compact_step_(*padding, torch.zeros(64), **HYPERS[1])
    assert all(not bool(byte_view(t).any()) for t in padding), "padding must step to zero"


def special_state(n, precision):
    """Denormal, tiny, huge and signed-zero weights and moments."""
    gen = torch.Generator().manual_seed(11)
    p = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-40, 38, (n,), generator=gen).float()
    p[::7] = torch.tensor(2.0**-149) * torch.randint(-300, 300, (len(p[::7]),), generator=gen)  # denormals
    p[::11] = -0.0
    p[5] = 3.38e38  # rounds to bf16 inf
    m = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-44, 0, (n,), generator=gen).float()
    v = torch.rand(n, generator=gen) * 10.0 ** torch.randint(-45, 0, (n,), generator=gen).float()
    m[64:96] = torch.tensor(2.0**-149) * torch.randint(-5, 5, (32,), generator=gen)
    v[64:96] = torch.tensor(2.0**-149) * torch.randint(0, 5, (32,), generator=gen)
    state = compact.empty_state(n, precision)
    compact.compact_encode_(*state, p, m, v)
    return state, (p, m, v)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_denormal_and_extreme_values_encode_decode_and_step_as_the_reference(cpp_adam, isa, precision):
    adam = cpp_adam(isa)
    n = 333
    state, (p, m, v) = special_state(n, precision)
    got = compact.empty_state(n, precision)
    adam.compact_encode_(*got, p, m, v)
    assert_same_bytes(got, state, f"isa={isa} encode")
    out_k = [torch.empty(n) for _ in range(3)]
    out_r = [torch.empty(n) for _ in range(3)]
    adam.compact_decode(*state, *out_k)
    compact.compact_decode(*state, *out_r)
    for a, b in zip(out_k, out_r):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)) or bool(((a == b) | (a.isnan() & b.isnan())).all())
    gen = torch.Generator().manual_seed(12)
    g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-45, 3, (n,), generator=gen).float()
    for hyper in HYPERS:
        want = reference_step(state, g, hyper)
        got = clone(state)
        adam.compact_step_(*got, g, **hyper)
        assert_same_bytes(got, want, f"isa={isa} {precision} special step")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_gradients_turn_their_element_and_groups_non_finite_as_the_reference(cpp_adam, isa, bad):
    # as the fp32 path, whose p, m, v turn NaN/inf where such a gradient lands (and the engine
    # restores a speculated bucket's pre-step bytes when validation finds it)
    n = 70
    state, g = compact_state(n, 8, "compact")
    g[3], g[40] = bad, bad
    got = clone(state)
    cpp_adam(isa).compact_step_(*got, g, **HYPERS[1])
    assert_same_bytes(got, reference_step(state, g, HYPERS[1]), f"isa={isa} grad {bad}")
    p, m, v = (torch.empty(n) for _ in range(3))
    cpp_adam(isa).compact_decode(*got, p, m, v)
    assert not math.isfinite(p[3].item()) and not math.isfinite(p[40].item())
    assert bool(torch.isfinite(p[torch.arange(n) % 37 != 3]).all())
    assert bool(m[:64].isnan().all()) and bool(v[:64].isnan().all()) and bool(torch.isfinite(m[64:]).all())


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_group_inside_a_tile_leaves_the_tiles_other_groups_finite(cpp_adam, isa, bad):
    # the vector paths compute a tile's scales together (lane j = group j): groups 6 and 21 (in the
    # first and second tile on every path) go non-finite, their neighbours keep finite scales
    n = 1060
    state, g = compact_state(n, 9, "compact")
    g[200], g[700] = bad, bad
    got = clone(state)
    cpp_adam(isa).compact_step_(*got, g, **HYPERS[1])
    assert_same_bytes(got, reference_step(state, g, HYPERS[1]), f"isa={isa} grad {bad}")
    bad_groups = torch.zeros(compact.scale_numel(n), dtype=torch.bool)
    bad_groups[[6, 21]] = True
    for scale in (got[3], got[5]):
        assert bool(scale.float()[bad_groups].isnan().all()) and bool(torch.isfinite(scale.float()[~bad_groups]).all())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_encode_and_decode_are_bitwise_the_reference(cpp_adam, isa, precision):
    adam = cpp_adam(isa, threads=2)
    for n in (1, 31, 33, 40000):
        p, m, v, _ = random_state(n, seed=n)
        want = compact.empty_state(n, precision)
        compact.compact_encode_(*want, p, m, v)
        got = compact.empty_state(n, precision)
        adam.compact_encode_(*got, p, m, v)
        assert_same_bytes(got, want, f"isa={isa} encode n={n}")
        adam.compact_encode_(*got, p.double(), m.double(), v.double())  # float64 in: rounded to fp32 first
        assert_same_bytes(got, want, f"isa={isa} encode float64 n={n}")
        out = [torch.empty(n) for _ in range(3)]
        adam.compact_decode(*got, *out)
        for a, b in zip(out, compact.decode_float64(*got)):
            assert torch.equal(a.double(), b)
        out64 = [torch.empty(n, dtype=torch.float64) for _ in range(3)]
        adam.compact_decode(*got, *out64)
        assert all(torch.equal(a, b.double()) for a, b in zip(out64, out))


def test_segmented_gradients_equal_the_flat_gradient(cpp_adam, isa):
    adam = cpp_adam(isa, threads=2)
    # a segment boundary inside a group, segments of mixed dtypes, one long segment across the
    # pool's chunks and the gather blocks, an empty segment
    numels = [10, 45, 0, 2048 * 3 + 7, 5, 40000]
    n = sum(numels)
    state, _ = compact_state(n, 9, "compact")
    gen = torch.Generator().manual_seed(10)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32, torch.bfloat16]
    segments = [torch.randn(k, generator=gen).to(dt) for k, dt in zip(numels, dtypes)]
    flat = torch.cat([s.float() for s in segments])
    want = clone(state)
    adam.compact_step_(*want, flat, **HYPERS[2])
    got = clone(state)
    adam.compact_step_(*got, SegmentedGrad([s.view(-1) for s in segments], numels), **HYPERS[2])
    assert_same_bytes(got, want, f"isa={isa} segmented")
    assert_same_bytes(got, reference_step(state, flat, HYPERS[2]), f"isa={isa} segmented vs reference")


def test_bytes_copy_copies_every_dtype_bit_for_bit(cpp_adam):
    adam = cpp_adam("scalar", threads=2)
    state, _ = compact_state(300_001, 13, "compact32")
    for src in state:
        dst = torch.empty_like(src)
        adam.bytes_copy_(dst, src)
        assert torch.equal(byte_view(dst), byte_view(src))
    with pytest.raises(TypeError, match=r"`dst` is torch.int8.*`src` is torch.uint8.*same dtype"):
        adam.bytes_copy_(state[2], state[4])
    with pytest.raises(ValueError, match=r"`dst` has 3 elements, `src` has 300001"):
        adam.bytes_copy_(torch.empty(3, dtype=torch.bfloat16), state[0])
    with pytest.raises(ValueError, match=r"`src` must be contiguous"):
        adam.bytes_copy_(torch.empty(5), torch.empty(10)[::2])


def test_binding_checks_name_the_argument_the_value_and_the_expectation(cpp_adam):
    adam = cpp_adam("scalar")
    state = list(compact.empty_state(40))
    g = torch.zeros(40)
    cases = [
        (3, torch.zeros(1, dtype=torch.bfloat16), ValueError, r"`exp_avg_scale` has 1 elements; expected 2 \(ceil\(40 / 32\)"),
        (5, torch.zeros(3, dtype=torch.bfloat16), ValueError, r"`exp_avg_sq_scale` has 3 elements; expected 2"),
        (2, torch.zeros(40, dtype=torch.uint8), TypeError, r"`exp_avg_q` must be torch.int8, got torch.uint8"),
        (1, torch.zeros(40, dtype=torch.int32), TypeError, r"`master_err` must be torch.int8 \(compact\) or torch.int16"),
        (0, torch.zeros(80, dtype=torch.bfloat16)[::2], ValueError, r"`master_bf16` must be a flat contiguous"),
        (4, torch.zeros(41, dtype=torch.uint8), ValueError, r"`exp_avg_sq_q` has 41 elements; expected 40"),
    ]
    for index, bad, error, message in cases:
        args = state.copy()
        args[index] = bad
        with pytest.raises(error, match=message):
            adam.compact_step_(*args, g, **HYPERS[0])
    with pytest.raises(TypeError, match=r"`grad` must be float32, bfloat16 or float16, got torch.float64"):
        adam.compact_step_(*state, g.double(), **HYPERS[0])
    with pytest.raises(ValueError, match=r"`grad` has 39 elements, `param` has 40"):
        adam.compact_step_(*state, torch.zeros(39), **HYPERS[0])
    with pytest.raises(ValueError, match=r"`exp_avg_q` and `exp_avg_sq_q` share memory"):
        adam.compact_step_(*state[:2], state[4].view(torch.int8), state[3], state[4], state[5], g, **HYPERS[0])
    with pytest.raises(TypeError, match=r"`param` must be float32, got torch.float16"):
        adam.compact_encode_(*state, torch.zeros(40, dtype=torch.float16), g, g.clone())
    untouched = [t.clone() for t in state]
    with pytest.raises(ValueError, match=r"`step` is 0"):
        adam.compact_step_(*state, torch.ones(40), **{**HYPERS[0], "step": 0})
    assert_same_bytes(state, untouched, "a failed check writes nothing")
