"""GraceAdam input checks: each bad input raises a clear error and leaves every buffer untouched."""

from __future__ import annotations

import pytest
import torch

from _kernel_math import HYPERS, clone_all, random_state
from superoffload_hf.host import kernel

N = 37


def good_buffers():
    p, m, v, g = random_state(N, seed=1)
    return {"param": p, "exp_avg": m, "exp_avg_sq": v, "grad": g, "param_lowp": torch.zeros(N, dtype=torch.bfloat16)}


def strided(dtype=torch.float32):
    return torch.zeros(2 * N, dtype=dtype)[::2]


# (case id, buffer to replace, replacement, exception type, words the message must contain)
BAD_BUFFERS = [
    ("strided-param", "param", lambda: strided(), ValueError, ["`param`", "contiguous", "strides"]),
    ("strided-grad", "grad", lambda: strided(), ValueError, ["`grad`", "contiguous"]),
    ("strided-lowp", "param_lowp", lambda: strided(torch.bfloat16), ValueError, ["`param_lowp`", "contiguous"]),
    ("float64-param", "param", lambda: torch.zeros(N, dtype=torch.float64), TypeError, ["`param`", "float32", "torch.float64"]),
    ("bf16-exp-avg", "exp_avg", lambda: torch.zeros(N, dtype=torch.bfloat16), TypeError, ["`exp_avg`", "float32"]),
    ("int32-grad", "grad", lambda: torch.zeros(N, dtype=torch.int32), TypeError, ["`grad`", "float16", "torch.int32"]),
    ("float64-grad", "grad", lambda: torch.zeros(N, dtype=torch.float64), TypeError, ["`grad`", "bfloat16", "torch.float64"]),
    ("fp32-lowp", "param_lowp", lambda: torch.zeros(N), TypeError, ["`param_lowp`", "float16", "torch.float32"]),
    ("meta-exp-avg-sq", "exp_avg_sq", lambda: torch.zeros(N, device="meta"), TypeError, ["`exp_avg_sq`", "CPU", "meta"]),
    ("meta-grad", "grad", lambda: torch.zeros(N, device="meta"), TypeError, ["`grad`", "CPU", "meta"]),
    ("2d-param", "param", lambda: torch.zeros(N, 1), ValueError, ["`param`", "1-D", "[37, 1]"]),
    ("2d-grad", "grad", lambda: torch.zeros(1, N), ValueError, ["`grad`", "1-D"]),
    ("short-exp-avg", "exp_avg", lambda: torch.zeros(N - 1), ValueError, ["`exp_avg`", "36", "37"]),
    ("long-grad", "grad", lambda: torch.zeros(N + 1), ValueError, ["`grad`", "38", "37"]),
    ("short-lowp", "param_lowp", lambda: torch.zeros(N - 1, dtype=torch.bfloat16), ValueError, ["`param_lowp`", "36"]),
]


def assert_untouched(buffers, before, what):
    for name, t in buffers.items():
        if t is not None and t.device.type == "cpu":
            assert torch.equal(t, before[name]), f"{what}: `{name}` was modified by a call that raised"


@pytest.mark.parametrize("op", ["adam_step_", "adam_rollback_"])
@pytest.mark.parametrize("case", BAD_BUFFERS, ids=[c[0] for c in BAD_BUFFERS])
def test_bad_buffer_raises_clear_error_and_changes_nothing(cpp_adam, op, case):
    _, name, make, error, words = case
    buffers = good_buffers()
    buffers[name] = make()
    before = {k: t.clone() for k, t in buffers.items() if t.device.type == "cpu"}
    lowp = buffers.pop("param_lowp")
    with pytest.raises(error) as raised:
        getattr(cpp_adam("scalar"), op)(*buffers.values(), param_lowp=lowp, **HYPERS[2])
    for word in words:
        assert word in str(raised.value), f"message {str(raised.value)!r} lacks {word!r}"
    assert_untouched(dict(buffers, param_lowp=lowp), before, op)


@pytest.mark.parametrize("step", [0, -3])
def test_step_below_one_raises_in_python_and_in_cpp(cpp_adam, grace_adam_extension, step):
    buffers = good_buffers()
    before = {k: t.clone() for k, t in buffers.items()}
    lowp = buffers.pop("param_lowp")
    hyper = dict(HYPERS[1], step=step)
    with pytest.raises(ValueError, match="`step` is"):
        cpp_adam("scalar").adam_step_(*buffers.values(), param_lowp=lowp, **hyper)
    args = [hyper[k] for k in ("step", "lr", "beta1", "beta2", "eps", "weight_decay", "adamw",
                               "bias_correction", "grad_scale")]
    with pytest.raises(ValueError, match="`step` is"):  # the binding checks it too
        grace_adam_extension.adam_step_(*buffers.values(), lowp, *args, 0)
    assert_untouched(dict(buffers, param_lowp=lowp), before, "step < 1")


def test_buffers_that_share_memory_are_rejected(cpp_adam):
    p, m, v, g = random_state(N, seed=2)
    before = clone_all((p, m, v, g))
    with pytest.raises(ValueError, match="share memory"):
        cpp_adam("scalar").adam_step_(p, p, v, g, **HYPERS[0])
    for got, want in zip((p, m, v, g), before):
        assert torch.equal(got, want)


def test_unsupported_or_unknown_isa_code_is_rejected_by_the_binding(grace_adam_extension):
    p, m, v, g = random_state(N, seed=3)
    args = (p, m, v, g, None, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0)
    with pytest.raises(ValueError, match="`isa` is 9"):
        grace_adam_extension.adam_step_(*args, 9)
    unsupported = [code for code in kernel.ISA_CODES.values() if not grace_adam_extension.isa_supported(code)]
    if unsupported:
        with pytest.raises(ValueError, match="does not support"):
            grace_adam_extension.adam_step_(*args, unsupported[0])


@pytest.mark.parametrize("grad", [strided(), torch.zeros(N, dtype=torch.float64), torch.zeros(N, 1),
                                  torch.zeros(N, device="meta")], ids=["strided", "float64", "2d", "meta"])
def test_sum_squares_rejects_bad_gradients(cpp_adam, grad):
    with pytest.raises((TypeError, ValueError), match="`grad`"):
        cpp_adam("scalar").sum_squares(grad)


def test_empty_buffers_are_a_no_op(cpp_adam, isa):
    empty = [torch.empty(0) for _ in range(4)]
    assert cpp_adam(isa).adam_step_(*empty, param_lowp=torch.empty(0, dtype=torch.float16), **HYPERS[1]) is None
    assert cpp_adam(isa).adam_rollback_(*empty, **HYPERS[1]) is None
    assert cpp_adam(isa).sum_squares(torch.empty(0)) == 0.0


@pytest.mark.parametrize("threads", [0, -1, 2.5, True])
def test_bad_thread_count_is_rejected(cpp_adam, threads):
    with pytest.raises(ValueError, match="`threads` is"):
        cpp_adam("scalar").set_num_threads(threads)


@pytest.mark.parametrize("name,value", [("lr", None), ("beta2", "0.999"), ("grad_scale", [1.0]), ("step", 1.0)])
def test_bad_hyperparameter_is_named_in_the_error_by_both_back_ends(cpp_adam, name, value):
    buffers = good_buffers()
    lowp = buffers.pop("param_lowp")
    for adam in (cpp_adam("scalar"), kernel.ReferenceHostAdam(threads=1)):
        with pytest.raises((TypeError, ValueError), match=f"`{name}` is"):
            adam.adam_step_(*buffers.values(), param_lowp=lowp, **dict(HYPERS[1], **{name: value}))


def test_tensor_learning_rate_is_accepted(cpp_adam):
    with_tensor, with_float = good_buffers(), good_buffers()
    lowp_t, lowp_f = with_tensor.pop("param_lowp"), with_float.pop("param_lowp")
    cpp_adam("scalar").adam_step_(*with_tensor.values(), param_lowp=lowp_t, **dict(HYPERS[1], lr=torch.tensor(1e-3)))
    cpp_adam("scalar").adam_step_(*with_float.values(), param_lowp=lowp_f, **dict(HYPERS[1], lr=1e-3))
    for name in ("param", "exp_avg", "exp_avg_sq"):  # a one-element tensor lr is the same as its float
        assert torch.equal(with_tensor[name], with_float[name]), name
    assert torch.equal(lowp_t, lowp_f)
