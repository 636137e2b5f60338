"""GraceAdam gradient staging: grad_copy_ (dst = float(src)) and grad_accumulate_ (dst += float(src)).

Every ISA path against torch (`dst.copy_(src)`, `dst.add_(src.float())`) bit for bit, NaN payloads
included; thread counts; input checks; the reference back end; and fp16 gradients taken directly
by adam_step_ and sum_squares.
"""

from __future__ import annotations

import pytest
import torch

from _kernel_math import HYPERS, bits, random_state
from superoffload_hf.host import kernel

SRC_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GRAIN = 1 << 14  # kGradGrain in binding.cpp: where a thread's slice starts
# Vector widths 8 (AVX2) and 16 (AVX-512) and their neighbours, thread-slice edges, and ~1e6.
SIZES = [1, 7, 8, 9, 15, 16, 17, 33, 129, GRAIN - 1, GRAIN, GRAIN + 1, 2 * GRAIN + 77, 1_000_003]
OPS = ["grad_copy_", "grad_accumulate_"]


def special_floats() -> torch.Tensor:
    """Values every conversion must get right: +-0, +-inf, quiet and signalling NaNs with payloads,
    fp32/bf16/fp16 subnormals and their boundaries, the fp16 maximum."""
    patterns = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FA5A5A5,
                0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x00010000, 0x80010000, 0x33800000, 0x387FC000,
                0x38800000, 0x477FE000, 0x3F800000, 0xBF800000, 0x7F7FFFFF, 0xFF7FFFFF]
    return torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


def special_halves(dtype) -> torch.Tensor:
    """For bf16/fp16: +-0, +-inf, quiet and signalling NaNs with payloads, subnormals, max, min normal."""
    if dtype == torch.float16:
        patterns = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x7D55, 0x0001, 0x8001, 0x03FF, 0x0400,
                    0x7BFF, 0xFBFF, 0x3C00, 0x0200]
    else:
        patterns = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7FA5, 0x0001, 0x8001, 0x007F, 0x0080,
                    0x7F7F, 0xFF7F, 0x3F80, 0x0040]
    return torch.tensor(patterns, dtype=torch.int32).to(torch.int16).view(dtype)


def random_src(n: int, dtype, seed: int) -> torch.Tensor:
    """Values over many binades with the special values sprinkled in at the start, a vector edge
    and the end (so both vector bodies and scalar tails see them)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(n, generator=gen, dtype=torch.float64) * 12 - 8)
    src = (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype)
    specials = special_floats().to(dtype) if dtype == torch.float32 else special_halves(dtype)
    for start in (0, max(0, n // 2 - 5), max(0, n - len(specials))):
        k = min(len(specials), n - start)
        src[start:start + k] = specials[:k]
    return src


def random_dst(n: int, seed: int) -> torch.Tensor:
    """fp32 accumulators, with +-0, inf, NaN and subnormals among them."""
    return random_src(n, torch.float32, seed + 1).flip(0).contiguous()


def torch_result(op: str, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    out = dst.clone()
    out.copy_(src) if op == "grad_copy_" else out.add_(src.float())
    return out


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str, nan_meets_nan=None) -> None:
    """Equal bit patterns, NaN payloads included; where `nan_meets_nan` is set a NaN only has to
    meet a NaN."""
    differ = bits(actual) != bits(expected)
    if nan_meets_nan is not None:
        differ &= ~(nan_meets_nan & actual.isnan() & expected.isnan())
    if differ.any():
        i = int(differ.nonzero()[0])
        raise AssertionError(f"{what}: {int(differ.sum())} of {actual.numel()} elements differ bitwise; first at "
                             f"{i}: bits {int(bits(actual)[i]) & 0xFFFFFFFF:#010x} vs "
                             f"{int(bits(expected)[i]) & 0xFFFFFFFF:#010x}")


def torch_nan_latitude(op: str, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Where torch's own NaN bits are not a specification: its add is fma(src, 1, dst), so with two
    NaN operands the payload it keeps is its own choice; and its fp16 -> fp32 conversion gives
    0x7fffffff for every NaN in its scalar tail but keeps the (quieted) payload in its vector body.
    The kernel always keeps the quieted payload, as F16C and Arm's fcvt do."""
    latitude = src.isnan() if src.dtype == torch.float16 else torch.zeros(src.shape, dtype=torch.bool)
    if op == "grad_accumulate_":
        latitude |= dst.isnan() & src.float().isnan()
    return latitude


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("src_dtype", SRC_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_grad_op_matches_torch_bitwise(cpp_adam, isa, op, src_dtype, n):
    src, dst = random_src(n, src_dtype, seed=n), random_dst(n, seed=n)
    want = torch_result(op, dst, src)
    got = dst.clone()
    getattr(cpp_adam(isa, threads=2 if n > GRAIN else 1), op)(got, src)
    assert_same_bits(got, want, f"{op} isa={isa} src={src_dtype} n={n}", torch_nan_latitude(op, dst, src))


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", OPS)
def test_every_16_bit_pattern_converts_like_torch(cpp_adam, isa, op, src_dtype):
    src = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(src_dtype)
    dst = torch.full((src.numel(),), 1.5)
    dst[::7] = -0.0  # -0 + +0 is +0, -0 + -0 is -0
    want = torch_result(op, dst, src)
    got = dst.clone()
    getattr(cpp_adam(isa), op)(got, src)
    assert_same_bits(got, want, f"{op} isa={isa} every {src_dtype} pattern", torch_nan_latitude(op, dst, src))


@pytest.mark.parametrize("src_dtype", SRC_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_every_isa_path_and_thread_count_agree_bitwise(cpp_adam, supported_isas, op, src_dtype):
    n = 5 * GRAIN + 77  # three threads get unequal slices with a tail each
    src, dst = random_src(n, src_dtype, seed=3), random_dst(n, seed=3)
    results = {}
    for isa in supported_isas:
        for threads in (1, 2, 3):
            got = dst.clone()
            getattr(cpp_adam(isa, threads=threads), op)(got, src)
            results[(isa, threads)] = got
    first_key, first = next(iter(results.items()))
    # NaN payloads included, except where an add had two NaN operands (grace_adam.h: which one's
    # payload survives depends on the instruction form and on the compiler's operand order).
    two_nans = dst.isnan() & src.float().isnan() if op == "grad_accumulate_" else None
    for key, got in results.items():
        assert_same_bits(got, first, f"{op} src={src_dtype}: {key} vs {first_key}", two_nans)


def test_accumulating_micro_batches_equals_torch_step_by_step(cpp_adam, isa):
    n = 3 * GRAIN + 5
    grads = [random_src(n, torch.bfloat16, seed=s) for s in range(4)]
    got, want = torch.empty(n), torch.empty(n)
    adam = cpp_adam(isa, threads=2)
    adam.grad_copy_(got, grads[0])
    want.copy_(grads[0])
    for g in grads[1:]:
        adam.grad_accumulate_(got, g)
        want.add_(g.float())
    assert_same_bits(got, want, f"isa={isa} four bf16 micro-batches", got.isnan() & want.isnan())


def test_shapes_may_differ_when_both_are_contiguous_with_one_element_count(cpp_adam):
    src = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    dst = torch.zeros(12)
    cpp_adam("scalar").grad_copy_(dst, src)
    assert torch.equal(dst, torch.arange(12, dtype=torch.float32))


@pytest.mark.parametrize("op", OPS)
def test_empty_buffers_are_a_no_op(cpp_adam, isa, op):
    assert getattr(cpp_adam(isa), op)(torch.empty(0), torch.empty(0, dtype=torch.float16)) is None


# ---- input checks, both back ends --------------------------------------------------------------

N = 37


def backends(cpp_adam):
    return {"cpp": cpp_adam("scalar"), "reference": kernel.ReferenceHostAdam(threads=1)}


def _buffers():
    return torch.arange(N, dtype=torch.float32), torch.linspace(-1, 1, N).to(torch.bfloat16)


def _shared_storage():
    storage = torch.zeros(2 * N)
    return storage[:N], storage[N // 2:N // 2 + N]  # overlapping halves, both fp32


# (case id, make (dst, src), exception type, words the message must contain)
BAD_PAIRS = [
    ("dst-bf16", lambda: (torch.zeros(N, dtype=torch.bfloat16), _buffers()[1]), TypeError, ["`dst`", "float32"]),
    ("dst-float64", lambda: (torch.zeros(N, dtype=torch.float64), _buffers()[1]), TypeError, ["`dst`", "float32"]),
    ("src-float64", lambda: (_buffers()[0], torch.zeros(N, dtype=torch.float64)), TypeError, ["`src`", "float16"]),
    ("src-int32", lambda: (_buffers()[0], torch.zeros(N, dtype=torch.int32)), TypeError, ["`src`", "bfloat16"]),
    ("strided-dst", lambda: (torch.zeros(2 * N)[::2], _buffers()[1]), ValueError, ["`dst`", "contiguous"]),
    ("strided-src", lambda: (_buffers()[0], torch.zeros(2 * N, dtype=torch.float16)[::2]), ValueError,
     ["`src`", "contiguous"]),
    ("short-src", lambda: (_buffers()[0], torch.zeros(N - 1, dtype=torch.bfloat16)), ValueError, ["`src`", "36", "37"]),
    ("long-src", lambda: (_buffers()[0], torch.zeros(N + 1)), ValueError, ["`src`", "38", "37"]),
    ("same-tensor", lambda: (lambda t: (t, t))(torch.ones(N)), ValueError, ["share memory"]),
    ("overlapping-views", _shared_storage, ValueError, ["share memory"]),
    ("meta-src", lambda: (_buffers()[0], torch.zeros(N, device="meta")), TypeError, ["`src`", "meta"]),
]


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", BAD_PAIRS, ids=[c[0] for c in BAD_PAIRS])
def test_bad_input_raises_clear_error_and_changes_nothing(cpp_adam, backend, op, case):
    _, make, error, words = case
    dst, src = make()
    before = [t.clone() for t in (dst, src) if t.device.type == "cpu"]
    with pytest.raises(error) as raised:
        getattr(backends(cpp_adam)[backend], op)(dst, src)
    for word in words:
        assert word in str(raised.value), f"{backend}: message {str(raised.value)!r} lacks {word!r}"
    after = [t for t in (dst, src) if t.device.type == "cpu"]
    for got, want in zip(after, before):
        assert torch.equal(bits(got), bits(want)), f"{backend} {op}: a buffer was modified by a call that raised"


@pytest.mark.parametrize("src_dtype", SRC_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_reference_back_end_gives_the_kernels_bits(cpp_adam, op, src_dtype):
    n = 2 * GRAIN + 77
    src, dst = random_src(n, src_dtype, seed=11), random_dst(n, seed=11)
    results = {}
    for name, adam in backends(cpp_adam).items():
        results[name] = dst.clone()
        getattr(adam, op)(results[name], src)
    assert_same_bits(results["cpp"], results["reference"], f"{op} src={src_dtype}", torch_nan_latitude(op, dst, src))


def test_both_back_ends_expose_the_same_methods():
    for method in ("adam_step_", "adam_rollback_", "sum_squares", "grad_copy_", "grad_accumulate_", "lowp_copy_",
                   "set_num_threads", "describe"):
        assert callable(getattr(kernel.CppHostAdam, method)) and callable(getattr(kernel.ReferenceHostAdam, method))


# ---- fp16 gradients straight into the step (no upcast copy) -----------------------------------


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_step_and_sum_squares_take_a_16_bit_gradient_as_its_fp32_upcast(cpp_adam, isa, grad_dtype):
    n = 2 * GRAIN + 77
    p, m, v, g32 = random_state(n, seed=5)
    g = g32.to(grad_dtype)
    adam = cpp_adam(isa, threads=2)
    direct, upcast = [t.clone() for t in (p, m, v)], [t.clone() for t in (p, m, v)]
    lowp_direct, lowp_upcast = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    adam.adam_step_(*direct, g, param_lowp=lowp_direct, **HYPERS[1])
    adam.adam_step_(*upcast, g.float(), param_lowp=lowp_upcast, **HYPERS[1])
    for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), direct, upcast):
        assert_same_bits(got, want, f"isa={isa} step {name} with a {grad_dtype} grad vs its fp32 upcast")
    assert torch.equal(bits(lowp_direct), bits(lowp_upcast))
    adam.adam_rollback_(*direct, g, **HYPERS[1])
    adam.adam_rollback_(*upcast, g.float(), **HYPERS[1])
    for got, want in zip(direct, upcast):
        assert_same_bits(got, want, f"isa={isa} rollback with a {grad_dtype} grad vs its fp32 upcast")
    assert adam.sum_squares(g) == adam.sum_squares(g.float())


def test_reference_step_takes_an_fp16_gradient(cpp_adam):
    p, m, v, g32 = random_state(1000, seed=6)
    g = g32.half()
    ref, up = [t.clone() for t in (p, m, v)], [t.clone() for t in (p, m, v)]
    kernel.ReferenceHostAdam(threads=1).adam_step_(*ref, g, **HYPERS[2])
    kernel.ReferenceHostAdam(threads=1).adam_step_(*up, g.float(), **HYPERS[2])
    for got, want in zip(ref, up):
        assert torch.equal(got, want)
    assert kernel.ReferenceHostAdam(threads=1).sum_squares(g) == float(torch.dot(g.double(), g.double()))


# ---- lowp_copy_: the fp32 -> bf16 / fp16 cast (the snapshot rollback's lowp restore) ------------

LOWP_DTYPES = [torch.bfloat16, torch.float16]


def torch_lowp_nan_latitude(src: torch.Tensor, dtype) -> torch.Tensor:
    """torch's NaN bits on the way down are not a specification (its scalar and vector paths
    differ); the kernel's store_lowp, the rounding the step's param_lowp gets, is: a NaN only
    has to meet a NaN here, and the step comparison below checks the bits."""
    return src.isnan()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", LOWP_DTYPES)
def test_lowp_copy_rounds_like_torch_bitwise(cpp_adam, dtype, n):
    src = random_src(n, torch.float32, seed=n)
    want = src.to(dtype)
    got = torch.full((n,), 7.0, dtype=dtype)
    cpp_adam("scalar", threads=2 if n > GRAIN else 1).lowp_copy_(got, src)
    assert_same_bits(got, want, f"lowp_copy_ {dtype} n={n}", torch_lowp_nan_latitude(src, dtype))
    ref = torch.full((n,), 7.0, dtype=dtype)
    kernel.ReferenceHostAdam(threads=1).lowp_copy_(ref, src)
    assert_same_bits(got, ref, f"lowp_copy_ {dtype} n={n} vs the reference", torch_lowp_nan_latitude(src, dtype))


@pytest.mark.parametrize("dtype", LOWP_DTYPES)
def test_lowp_copy_matches_the_steps_param_lowp_bitwise(cpp_adam, dtype):
    """The cast is the step's own rounding: a zero-learning-rate step's param_lowp of `p`."""
    n = 2 * GRAIN + 77
    p = random_src(n, torch.float32, seed=3)
    p = torch.where(p.isnan(), torch.zeros_like(p), p)
    m, v, g = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    from_step = torch.empty(n, dtype=dtype)
    cpp_adam("scalar").adam_step_(p, m, v, g, step=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                  adamw=True, param_lowp=from_step)
    got = torch.empty(n, dtype=dtype)
    cpp_adam("scalar").lowp_copy_(got, p)
    assert_same_bits(got, from_step, f"lowp_copy_ {dtype} vs the step's param_lowp")


@pytest.mark.parametrize("backend", ["cpp", "reference"])
@pytest.mark.parametrize("case", ["fp32 dst", "bf16 src", "length", "strided"])
def test_lowp_copy_bad_input_raises_naming_the_value(cpp_adam, backend, case):
    adam = backends(cpp_adam)[backend]
    dst, src = torch.zeros(N, dtype=torch.bfloat16), torch.arange(N, dtype=torch.float32)
    if case == "fp32 dst":
        dst, error, match = torch.zeros(N), TypeError, "`dst` must be bfloat16 or float16"
    elif case == "bf16 src":
        src, error, match = src.to(torch.bfloat16), TypeError, "`src` must be float32"
    elif case == "length":
        dst, error, match = torch.zeros(N - 1, dtype=torch.bfloat16), ValueError, f"`dst` has {N - 1} elements"
    else:
        src, error, match = torch.arange(2 * N, dtype=torch.float32)[::2], ValueError, "contiguous"
    with pytest.raises(error, match=match):
        adam.lowp_copy_(dst, src)
