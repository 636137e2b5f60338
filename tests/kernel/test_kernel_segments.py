"""The gradient as segments (host/segmented.py): the step and rollback give the flat entry's bits
on the concatenated gradient; the sum of squares is float64-accurate and thread-independent."""

from __future__ import annotations

import math

import pytest
import torch

from _kernel_math import HYPERS, bits, clone_all, random_state
from superoffload_hf.host import kernel
from superoffload_hf.host.segmented import SegmentedGrad

GRAIN = 1 << 14  # kStepGrain in binding.cpp
BLOCK = 1 << 14  # kSumSquaresBlock in grace_adam.h
SPLITS = [  # segment sizes: tails, grain edges, empty segments, one segment
    [1],
    [GRAIN + 1],
    [3, 0, 17, GRAIN - 1, 1, GRAIN, GRAIN + 1, 5],
    [0, 2 * GRAIN + 3, 0],
    [7] * 40 + [3 * GRAIN + 11],
]


def split(flat: torch.Tensor, sizes) -> SegmentedGrad:
    """Each segment its own storage, as autograd's gradients are."""
    return SegmentedGrad([chunk.clone() for chunk in flat.split(list(sizes))], sizes)


@pytest.mark.parametrize("sizes", SPLITS, ids=lambda s: f"{len(s)}seg{sum(s)}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hyper", HYPERS[:3])
def test_step_and_rollback_on_segments_equal_the_flat_entry_bitwise(cpp_adam, isa, sizes, threads, hyper):
    n = sum(sizes)
    *state, grad = random_state(n, seed=n + threads)
    adam = cpp_adam(isa, threads=threads)
    segmented = split(grad, sizes)
    flat_state, seg_state = clone_all(state), clone_all(state)
    flat_lowp, seg_lowp = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    adam.adam_step_(*flat_state, grad, param_lowp=flat_lowp, **hyper)
    adam.adam_step_(*seg_state, segmented, param_lowp=seg_lowp, **hyper)
    for want, got in zip(flat_state + [flat_lowp], seg_state + [seg_lowp]):
        assert torch.equal(bits(want), bits(got))
    adam.adam_rollback_(*flat_state, grad, param_lowp=flat_lowp, **hyper)
    adam.adam_rollback_(*seg_state, segmented, param_lowp=seg_lowp, **hyper)
    for want, got in zip(flat_state + [flat_lowp], seg_state + [seg_lowp]):
        assert torch.equal(bits(want), bits(got))


def test_a_slice_at_segment_boundaries_steps_that_range_only(cpp_adam, isa):
    sizes = [5, 0, GRAIN + 3, 9]
    n = sum(sizes)
    *state, grad = random_state(n, seed=3)
    segmented = split(grad, sizes)
    flat_state, seg_state = clone_all(state), clone_all(state)
    adam = cpp_adam(isa)
    lo, hi = 5, 5 + GRAIN + 3
    adam.adam_step_(*(t[lo:hi] for t in flat_state), grad[lo:hi], **HYPERS[1])
    adam.adam_step_(*(t[lo:hi] for t in seg_state), segmented[lo:hi], **HYPERS[1])
    for want, got in zip(flat_state, seg_state):
        assert torch.equal(bits(want), bits(got))
    with pytest.raises(ValueError, match="not a segment boundary"):
        segmented[1:hi]


def fsum_of_squares(grad: torch.Tensor) -> float:
    return math.fsum(x * x for x in grad.double().tolist())


@pytest.mark.parametrize("sizes", SPLITS, ids=lambda s: f"{len(s)}seg{sum(s)}")
def test_sum_squares_of_segments_is_float64_accurate(cpp_adam, isa, sizes):
    grad = random_state(sum(sizes), seed=11)[3]
    got = cpp_adam(isa).sum_squares(split(grad, sizes))
    assert got == pytest.approx(fsum_of_squares(grad), rel=1e-12, abs=0.0)


def test_sum_squares_of_segments_is_bitwise_identical_for_one_two_three_threads(cpp_adam, isa):
    sizes = SPLITS[2] + SPLITS[4]
    segmented = split(random_state(sum(sizes), seed=5)[3], sizes)
    results = {cpp_adam(isa, threads=t).sum_squares(segmented) for t in (1, 2, 3)}
    assert len(results) == 1


def test_absent_segments_count_as_zeros_in_the_sum_and_refuse_a_step(cpp_adam, isa):
    grad = random_state(40, seed=2)[3]
    whole = split(grad, [10, 20, 10])
    holed = SegmentedGrad([whole.segments[0], None, whole.segments[2]], [10, 20, 10])
    want = fsum_of_squares(grad[:10]) + fsum_of_squares(grad[30:])
    for adam in (cpp_adam(isa), kernel.ReferenceHostAdam(1)):
        assert adam.sum_squares(holed) == pytest.approx(want, rel=1e-12)
        state = random_state(40, seed=2)[:3]
        with pytest.raises(ValueError, match=r"segments \[1\] are absent"):
            adam.adam_step_(*state, holed, **HYPERS[0])


def test_reference_back_end_takes_segments_as_their_concatenation():
    sizes = SPLITS[2]
    *state, grad = random_state(sum(sizes), seed=4)
    adam = kernel.ReferenceHostAdam(1)
    flat_state, seg_state = clone_all(state), clone_all(state)
    adam.adam_step_(*flat_state, grad, **HYPERS[2])
    adam.adam_step_(*seg_state, split(grad, sizes), **HYPERS[2])
    for want, got in zip(flat_state, seg_state):
        assert torch.equal(want, got)
    assert adam.sum_squares(split(grad, sizes)) == adam.sum_squares(grad)


def test_segments_of_any_shape_are_read_as_their_elements_in_order(cpp_adam, isa):
    # autograd's gradients keep their parameter's shape; the kernel reads them as they are
    sizes = [(8, 4), (3,), (5, 2, 3)]
    numels = [math.prod(s) for s in sizes]
    *state, grad = random_state(sum(numels), seed=8)
    shaped = [chunk.clone().view(shape) for chunk, shape in zip(grad.split(numels), sizes)]
    flat_state, seg_state = clone_all(state), clone_all(state)
    adam = cpp_adam(isa)
    adam.adam_step_(*flat_state, grad, **HYPERS[1])
    adam.adam_step_(*seg_state, SegmentedGrad(shaped, numels), **HYPERS[1])
    for want, got in zip(flat_state, seg_state):
        assert torch.equal(bits(want), bits(got))
    assert adam.sum_squares(SegmentedGrad(shaped, numels)) == pytest.approx(fsum_of_squares(grad), rel=1e-12)


@pytest.mark.parametrize("case", ["too_few", "non_contiguous", "transposed", "int_dtype", "aliases_param"])
def test_bad_segments_raise_clear_errors_and_change_nothing(grace_adam_extension, case):
    n = 64
    *state, grad = random_state(n, seed=1)
    segments = list(grad.clone().split([32, 32]))
    match = {"too_few": "must cover it exactly", "non_contiguous": "must be contiguous", "transposed": "must be contiguous",
             "int_dtype": "must be float32, bfloat16 or float16", "aliases_param": "share memory"}[case]
    if case == "too_few":
        segments = segments[:1]
    elif case == "non_contiguous":
        segments[1] = torch.randn(64)[::2]
    elif case == "transposed":
        segments[1] = torch.randn(8, 4).t()
    elif case == "int_dtype":
        segments[0] = torch.zeros(32, dtype=torch.int32)
    else:
        segments[1] = state[0][:32]
    before = clone_all(state)
    adam = kernel.CppHostAdam(grace_adam_extension, "scalar")
    with pytest.raises((ValueError, TypeError), match=match):
        adam.adam_step_(*state, SegmentedGrad(segments, [s.numel() for s in segments]), **HYPERS[0])
    for want, got in zip(before, state):
        assert torch.equal(want, got)
