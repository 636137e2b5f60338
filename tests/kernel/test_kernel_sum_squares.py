"""GraceAdam sum_squares: float64 accuracy, non-finite propagation, bitwise independence of threads and ISA."""

from __future__ import annotations

import math

import pytest
import torch

BLOCK = 1 << 14  # kSumSquaresBlock in grace_adam.h
SIZES = [1, 15, 16, 17, 33, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17, 1_000_003]


def random_grad(n: int, seed: int, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (torch.rand(n, generator=gen, dtype=torch.float64) * 8 - 6)
    return (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_squares_matches_float64_torch(cpp_adam, isa, n, dtype):
    grad = random_grad(n, seed=n, dtype=dtype)
    want = float(torch.dot(grad.double(), grad.double()))
    got = cpp_adam(isa).sum_squares(grad)
    assert isinstance(got, float)
    # Two float64 summation orders of n non-negative terms differ by at most ~n * 2**-53 relatively.
    assert got == pytest.approx(want, rel=max(n, 16) * 2.0**-52, abs=0.0)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_element_anywhere_propagates(cpp_adam, isa, value, dtype):
    n = 2 * BLOCK + 21  # positions: first, in a vector, across a block edge, in the tail, last
    adam = cpp_adam(isa)
    for position in (0, 5, 16, BLOCK - 1, BLOCK, 2 * BLOCK + 3, n - 1):
        grad = random_grad(n, seed=position, dtype=dtype)
        grad[position] = value
        got = adam.sum_squares(grad)
        if math.isnan(value):
            assert math.isnan(got), f"NaN at {position} gave {got}"
        else:
            assert got == math.inf, f"{value} at {position} gave {got}"


def test_inf_and_nan_together_give_nan(cpp_adam, isa):
    grad = random_grad(100, seed=1, dtype=torch.float32)
    grad[3], grad[97] = float("inf"), float("nan")
    assert math.isnan(cpp_adam(isa).sum_squares(grad))


def test_empty_gradient_sums_to_zero(cpp_adam, isa):
    assert cpp_adam(isa).sum_squares(torch.empty(0)) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_squares_is_bitwise_identical_for_one_two_three_threads_and_every_isa(cpp_adam, supported_isas, dtype):
    grad = random_grad(5 * BLOCK + 77, seed=9, dtype=dtype)
    results = {(isa, threads): cpp_adam(isa, threads=threads).sum_squares(grad)
               for isa in supported_isas for threads in (1, 2, 3)}
    assert len(set(results.values())) == 1, results
