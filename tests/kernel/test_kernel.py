"""GraceAdam step: every ISA path against the float64 math, against each other, and against torch.optim."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import pytest
import torch

from _kernel_math import (EDGE_SIZES, HYPERS, assert_bitwise_equal, assert_step_within_bound, clone_all,
                          expected_step, random_state)

LOWP_CYCLE = (None, torch.bfloat16, torch.float16)


def run_step(adam, state, grad, hyper, lowp_dtype=None):
    """One kernel step on copies of `state`; returns (param, exp_avg, exp_avg_sq, param_lowp)."""
    p, m, v = clone_all(state)
    lowp = None if lowp_dtype is None else torch.full_like(p, float("nan"), dtype=lowp_dtype)
    adam.adam_step_(p, m, v, grad, param_lowp=lowp, **hyper)
    return p, m, v, lowp


def assert_lowp_is_torch_cast(param, lowp, what):
    if lowp is not None:
        assert_bitwise_equal(lowp, param.to(lowp.dtype), f"{what} param_lowp vs torch's cast")


@pytest.mark.parametrize("n", EDGE_SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_step_matches_float64_math_at_vector_edges(cpp_adam, isa, n, grad_dtype):
    adam = cpp_adam(isa)
    for k, hyper in enumerate(HYPERS):
        p, m, v, g = random_state(n, seed=100 * n + k, grad_dtype=grad_dtype)
        *after, lowp = run_step(adam, (p, m, v), g, hyper, LOWP_CYCLE[k % 3])
        what = f"isa={isa} n={n} grad={grad_dtype} hyper#{k}"
        assert_step_within_bound((p, m, v), after, g, hyper, what)
        assert_lowp_is_torch_cast(after[0], lowp, what)


@functools.lru_cache(maxsize=2)
def million_element_case(grad_dtype, k):
    """A random state of ~1e6 elements and its exact step (shared by the ISA paths)."""
    p, m, v, g = random_state(1_000_003, seed=k, grad_dtype=grad_dtype)
    return (p, m, v), g, expected_step((p, m, v), g, HYPERS[k])


@pytest.mark.parametrize("grad_dtype,k", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_step_matches_float64_math_on_a_million_elements(cpp_adam, isa, grad_dtype, k):
    state, g, expected = million_element_case(grad_dtype, k)
    *after, lowp = run_step(cpp_adam(isa, threads=2), state, g, HYPERS[k], LOWP_CYCLE[k])
    what = f"isa={isa} n={g.numel()} grad={grad_dtype} hyper#{k}"
    assert_step_within_bound(state, after, g, HYPERS[k], what, expected)
    assert_lowp_is_torch_cast(after[0], lowp, what)


@pytest.mark.parametrize("adamw", [True, False])
def test_fifty_consecutive_steps_each_match_float64_math(cpp_adam, isa, adamw):
    adam = cpp_adam(isa)
    n = 4099
    state = list(random_state(n, seed=7)[:3])
    gen = torch.Generator().manual_seed(8)
    for step in range(1, 51):
        g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 1, (n,), generator=gen)
        hyper = dict(step=step, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adamw=adamw,
                     bias_correction=True, grad_scale=0.5)
        *after, lowp = run_step(adam, state, g, hyper, torch.bfloat16)
        what = f"isa={isa} adamw={adamw} step={step}"
        assert_step_within_bound(state, after, g, hyper, what)
        assert_lowp_is_torch_cast(after[0], lowp, what)
        state = after


@pytest.mark.parametrize("n", [1, 15, 16, 17, 129, 16384 * 2 + 77])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_all_isa_paths_agree_bitwise(cpp_adam, supported_isas, n, grad_dtype):
    p, m, v, g = random_state(n, seed=n, grad_dtype=grad_dtype)
    if n > 8:  # special values in the state and gradient must propagate the same way everywhere
        p[3], m[4], v[5], g[6] = float("inf"), float("nan"), float("inf"), float("-inf")
        p[n - 1], v[n - 2] = 1e-42, -1.0
    for k, hyper in enumerate(HYPERS):
        lowp_dtype = LOWP_CYCLE[k % 3]
        results = {isa: run_step(cpp_adam(isa), (p, m, v), g, hyper, lowp_dtype) for isa in supported_isas}
        for isa in supported_isas:
            for name, got, want in zip(("param", "exp_avg", "exp_avg_sq", "param_lowp"), results[isa],
                                       results["scalar"]):
                if want is not None:
                    assert_bitwise_equal(got, want, f"{isa} vs scalar, n={n} hyper#{k} {name}")


def special_values(lowp_dtype) -> torch.Tensor:
    """fp32 values around every rounding hazard of a cast to `lowp_dtype`, plus random bit patterns."""
    f32 = lambda b: torch.tensor(b, dtype=torch.int64).to(torch.int32).view(torch.float32)  # noqa: E731
    if lowp_dtype == torch.float16:
        edges = [65504.0, 65519.99, 65520.0, 65520.01, 2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001,
                 3 * 2.0**-26, 2.0**-26, 5.96e-8, 6.1e-5, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2049.0, 2051.0]
    else:
        edges = [3.3895e38, 3.4028e38, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1e-40, 1.17549435e-38, 257.0, 259.0]
    edges = torch.tensor(edges, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    random_bits = f32(torch.randint(-(2**31), 2**31, (4093,), generator=gen).tolist())
    random_bits = random_bits[~random_bits.isnan()]
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1.0, -1.0])
    return torch.cat([edges, -edges, (edges * 1.0000001), specials, random_bits])


@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
def test_lowp_copy_is_round_to_nearest_even_like_torch(cpp_adam, isa, lowp_dtype):
    # lr = 0 and zero moments and gradient leave param exactly as it is: the lowp copy is its cast.
    param = special_values(lowp_dtype)
    zeros = torch.zeros_like(param)
    hyper = dict(HYPERS[0], lr=0.0)
    after_p, _, _, lowp = run_step(cpp_adam(isa), (param, zeros, zeros), zeros, hyper, lowp_dtype)
    assert_bitwise_equal(after_p, param, f"isa={isa} param with lr=0")
    assert_bitwise_equal(lowp, param.to(lowp_dtype), f"isa={isa} {lowp_dtype} copy vs torch")


@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
def test_lowp_copy_of_nan_is_a_quiet_nan(cpp_adam, isa, lowp_dtype):
    nan_bits = torch.tensor([0x7FC00000, 0x7F800001, -0x00400000, 0x7FFFFFFF] * 5, dtype=torch.int32)
    param = nan_bits.view(torch.float32)
    zeros = torch.zeros_like(param)
    _, _, _, lowp = run_step(cpp_adam(isa), (param, zeros, zeros), zeros, dict(HYPERS[0], lr=0.0), lowp_dtype)
    expected = 0x7FC0 if lowp_dtype == torch.bfloat16 else 0x7E00
    assert lowp.isnan().all()
    assert ((lowp.view(torch.int16).int() & 0x7FFF) == expected).all(), lowp.view(torch.int16)


@pytest.mark.parametrize("op", ["step", "rollback"])
def test_thread_counts_one_two_three_give_identical_results(cpp_adam, isa, op):
    n = 3 * 16384 + 1001  # splits unevenly over 2 and 3 threads, with a vector tail
    p, m, v, g = random_state(n, seed=11, grad_dtype=torch.bfloat16)
    results = []
    for threads in (1, 2, 3):
        adam = cpp_adam(isa, threads=threads)
        assert adam.threads == threads
        state = clone_all((p, m, v))
        lowp = torch.empty(n, dtype=torch.bfloat16)
        getattr(adam, f"adam_{op}_")(*state, g, param_lowp=lowp, **HYPERS[2])
        results.append(state + [lowp])
    for threads, result in zip((2, 3), results[1:]):
        for name, got, want in zip(("param", "exp_avg", "exp_avg_sq", "param_lowp"), result, results[0]):
            assert_bitwise_equal(got, want, f"{op} with {threads} threads vs 1: {name}")


def run_torch_optim(optim_cls, params0, grads, lr, betas, eps, weight_decay):
    param = torch.nn.Parameter(params0.clone())
    opt = optim_cls([param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    state = opt.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("optim_cls", [torch.optim.AdamW, torch.optim.Adam])
def test_hundred_steps_match_torch_optim(cpp_adam, isa, optim_cls):
    n, lr, betas, eps, weight_decay = 1037, 1e-3, (0.9, 0.999), 1e-8, 0.02
    gen = torch.Generator().manual_seed(5)
    params0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) * 0.1 for _ in range(100)]
    want = run_torch_optim(optim_cls, params0, grads, lr, betas, eps, weight_decay)
    adam = cpp_adam(isa)
    p, m, v = params0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, start=1):
        adam.adam_step_(p, m, v, g, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                        weight_decay=weight_decay, adamw=optim_cls is torch.optim.AdamW)
    # 100 steps of fp32 rounding, done in a different order: a few ulps of drift.
    torch.testing.assert_close(p, want[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(m, want[1], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(v, want[2], rtol=1e-5, atol=1e-10)


def test_forked_child_gets_its_own_thread_pool(cpp_adam):
    # A fork copies the pool object but none of its worker threads: the child must start its own
    # pool instead of waiting forever on workers that do not exist there.
    adam = cpp_adam("scalar", threads=2)
    p, m, v, g = random_state(3 * 16384, seed=2)
    adam.adam_step_(*clone_all((p, m, v)), g, **HYPERS[1])  # the parent's pool is up and used
    want = clone_all((p, m, v))
    adam.adam_step_(*want, g, **HYPERS[1])
    got = clone_all((p, m, v))
    pid = os.fork()
    if pid == 0:  # child: exit 0 only if the step ran on its own pool and matched
        try:  # no torch ops here: torch's OpenMP pool is not usable in a forked child
            adam.adam_step_(*got, g, **HYPERS[1])
            same = all(a.numpy().tobytes() == b.numpy().tobytes() for a, b in zip(got, want))
            os._exit(0 if same and adam.threads == 2 else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the kernel's thread pool")


def test_a_call_returns_without_waiting_for_a_worker_that_never_started(cpp_adam, grace_adam_extension):
    # On a busy machine a pool worker can wait a scheduler slice for a core after the call is
    # published (issue 30 item 6): the caller claims every chunk itself meanwhile and must not
    # then wait for that worker to wake up only to find no work left.
    adam = cpp_adam("scalar", threads=2)
    p, m, v, g = random_state(8 * 16384, seed=3)
    want, got = clone_all((p, m, v)), clone_all((p, m, v))
    adam.adam_step_(*want, g, **HYPERS[1])
    done = threading.Event()
    grace_adam_extension.hold_pool_workers(True)
    try:
        caller = threading.Thread(target=lambda: (adam.adam_step_(*got, g, **HYPERS[1]), done.set()), daemon=True)
        caller.start()
        finished = done.wait(30)  # not a timing: the held worker never takes part until released
    finally:
        grace_adam_extension.hold_pool_workers(False)
        caller.join()
    assert finished, "the call waited for a pool worker that had not started"
    for a, b in zip(got, want):  # the caller alone ran the same chunks: bitwise the same
        assert torch.equal(a, b)
