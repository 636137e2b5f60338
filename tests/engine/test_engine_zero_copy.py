"""The CPU with fp32 and one micro-batch (BufferPolicy.grad_on_demand): the host Adam reads
autograd's gradients in place. No gradient buffer at rest (12 B/param); the gradients live
until step() ends, as in torch; a parameter's second gradient in one step allocates the fp32
buffer for that step only, and the results stay torch's."""

from __future__ import annotations

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW

from _models import (assert_params_close, engine_config, micro_batches, one_torch_thread,  # noqa: F401
                     tiny_llama)
from superoffload_hf.testing.engine_parts import parts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LR = 1e-3


def pair(speculation: str = "on"):
    model, ref_model = tiny_llama(2), tiny_llama(2)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, weight_decay=0.01,
                            config=engine_config(speculation=speculation, device_buckets=0))
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    return model, opt, ref_model, ref_opt


def grad_bytes(opt) -> int:
    return parts(opt).buckets.ledger.bytes(kind="grad")


def host_runtimes(opt):
    return list(parts(opt).buckets.host())


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_the_step_reads_autograds_gradients_and_releases_them_after_step(speculation):
    model, opt, ref_model, ref_opt = pair(speculation)
    try:
        assert parts(opt).buckets.policy.grad_on_demand and grad_bytes(opt) == 0
        for step in range(3):
            batch = micro_batches(step)[0]
            model(**batch).loss.backward()
            for rt in host_runtimes(opt):
                assert rt.bufs.grad is None, "a gradient buffer was allocated for one micro-batch"
                assert all(g is not None and g.dtype == torch.float32 for g in rt.autograd_grads)
            assert grad_bytes(opt) == 0
            opt.step()
            opt.zero_grad()
            ref_model(**batch).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            for rt in host_runtimes(opt):  # released: nothing keeps autograd's tensors alive
                assert rt.autograd_grads == [None] * len(rt.bucket.slots) and rt.grad_in is None
            assert_params_close(model, ref_model, f"step {step}")
    finally:
        opt.close()


@pytest.mark.parametrize("speculation", ["on", "off"])
def test_undeclared_accumulation_allocates_the_buffer_for_that_step_only(speculation):
    """Two backwards per step with gradient_accumulation_steps 1 (the config's default)."""
    model, opt, ref_model, ref_opt = pair(speculation)
    ledger = parts(opt).buckets.ledger
    try:
        for step in range(3):
            batches = micro_batches(step, accumulation=2)
            ledger.reset_peak()
            for m, o in ((model, opt), (ref_model, ref_opt)):
                for batch in batches:
                    (m(**batch).loss / 2).backward()
                o.step()
                o.zero_grad()
            assert ledger.peak["host"] >= ledger.bytes("host") + 4 * sum(p.numel() for p in model.parameters()) * 0.9
            assert grad_bytes(opt) == 0, "the buffer of an accumulating step outlived it"
            assert_params_close(model, ref_model, f"step {step}")
    finally:
        opt.close()


def test_zero_grad_between_backward_and_step_releases_the_held_gradients():
    model, opt, _, _ = pair("on")
    try:
        model(**micro_batches(0)[0]).loss.backward()
        assert any(g is not None for rt in host_runtimes(opt) for g in rt.autograd_grads)
        opt.zero_grad()
        for rt in host_runtimes(opt):
            assert rt.autograd_grads == [None] * len(rt.bucket.slots) and rt.grad_in is None
    finally:
        opt.close()


def test_a_partial_backward_steps_only_the_parameters_with_a_gradient():
    """Absent slots are None segments: not stepped, zero in the norm."""
    model, opt, ref_model, ref_opt = pair("off")
    try:
        for m in (model, ref_model):
            m.lm_head.weight.requires_grad_(False)
        for m, o in ((model, opt), (ref_model, ref_opt)):
            m(**micro_batches(0)[0]).loss.backward()
            o.step()
            o.zero_grad()
        assert_params_close(model, ref_model, "a step without lm_head's gradient")
    finally:
        opt.close()


# ---- the hooks' lean path (Collector.on_grad) --------------------------------------------------


def count_full_path(opt, monkeypatch) -> list:
    """Record the parameter index of every gradient that goes through the full path."""
    collector = parts(opt).collector
    calls, full = [], collector.on_grad_accumulated

    def counted(p, index=None):
        calls.append(index)
        return full(p, index)

    monkeypatch.setattr(collector, "on_grad_accumulated", counted)
    return calls


@pytest.mark.parametrize("speculation", ["off", "auto", "on"])
def test_after_the_first_step_only_each_buckets_first_gradient_takes_the_full_path(speculation, monkeypatch):
    model, opt, ref_model, ref_opt = pair(speculation)
    calls = count_full_path(opt, monkeypatch)
    params = list(model.parameters())
    try:
        for step in range(4):
            calls.clear()
            batch = micro_batches(step)[0]
            model(**batch).loss.backward()
            host = host_runtimes(opt)
            if step == 0 or speculation == "on":  # learning the order / launching from the hooks
                assert len(calls) == len(params)
            else:
                assert len(calls) == len(host), (step, calls)
                assert {parts(opt).buckets.where[i][0] for i in calls} == set(host)
                with pytest.raises(RuntimeError, match="held by the SuperOffload optimizer"):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert all(g is not None for rt in host for g in rt.autograd_grads)
            opt.step()
            opt.zero_grad()
            ref_model(**batch).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert_params_close(model, ref_model, f"step {step}")
    finally:
        opt.close()


def test_two_backwards_of_one_graph_accumulate_as_torch_on_the_lean_path():
    """retain_graph: the second backward meets the held placeholders of the first, with no
    forward in between (the placeholder is cleared before autograd accumulates)."""
    model, opt, ref_model, ref_opt = pair("off")
    try:
        for step in range(3):
            batch = micro_batches(step)[0]
            for m, o in ((model, opt), (ref_model, ref_opt)):
                loss = m(**batch).loss
                loss.backward(retain_graph=True)
                (0.5 * loss).backward()
                o.step()
                o.zero_grad()
            assert_params_close(model, ref_model, f"step {step}")
    finally:
        opt.close()


def test_a_parameter_whose_data_changed_shape_falls_back_to_the_full_path():
    """The held placeholder no longer fits (assigning it raises inside backward): the full path
    takes the gradient and names the parameter and both shapes."""
    model, opt, _, _ = pair("off")
    try:
        for step in range(2):
            model(**micro_batches(step)[0]).loss.backward()
            opt.step()
            opt.zero_grad()
        model.model.norm.weight.data = torch.ones(1)  # broadcasts in the forward
        with pytest.raises(RuntimeError, match=r"gradient of 1 elements \(shape \(1,\)\), but the optimizer "
                                               r"was built when it had 32 \(shape \(32,\)\)"):
            model(**micro_batches(2)[0]).loss.backward()
    finally:
        opt.close()
