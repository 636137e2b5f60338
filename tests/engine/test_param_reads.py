"""Every way a parameter is read or written outside its own module's forward waits for its
bucket: a parent reading a child's weight functionally (nn.MultiheadAttention's out_proj, a tied
`F.linear(x, self.embed.weight)`), compiled models, `state_dict()` of a compiled model and
`load_state_dict()` between step() and the next forward. Buckets of one or two parameters, so a
missing wait reads NaN poison (sim) or the weights of before the step: a wrong number."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from superoffload_hf import SuperOffloadAdamW

from _models import assert_params_close, one_torch_thread  # noqa: F401  (a fixture)
from superoffload_hf.testing.engine_parts import parts

pytestmark = [pytest.mark.usefixtures("one_torch_thread", "device_mode"), pytest.mark.timeout(300)]

LR = 1e-2
WIDTH = 16
# one or two parameters a bucket; the last one backward completes stays on the device
CONFIG = {"device_dtype": "fp32", "bucket_size_mb": 0.0001, "device_buckets": 1, "host_threads": 1}


class Attention(nn.Module):
    """nn.MultiheadAttention reads out_proj.weight functionally: out_proj's forward never runs.
    It runs first, so its in_proj_weight is the last bucket backward completes, the one kept on
    the device: the attention's own forward then waits for no copy-back at all."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.attn = nn.MultiheadAttention(WIDTH, 2, bias=False, batch_first=True)  # (a key bias has no gradient)
            self.out = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.attn(x, x, x, need_weights=False)[0]))


class TiedHead(nn.Module):
    """Fed inputs_embeds, so the embedding's forward never runs: the parent reads its weight, to
    project the input (first thing in the forward, before any wait) and as the tied head."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(8, WIDTH)
            self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(torch.tanh(x @ self.embed.weight)))
        return F.linear(h, self.embed.weight)


def batch(step: int, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 8 if isinstance(model, TiedHead) else WIDTH, generator=g), torch.randn(4, 3, 8, generator=g)


def loss_of(model, x, y) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def train(model: nn.Module, opt, steps: int, run=None) -> list[torch.Tensor]:
    """Forward, backward, step; the outputs of every forward (the forward after step() reads the
    updated weights)."""
    run = model if run is None else run
    outputs = []
    for step in range(steps):
        x, y = batch(step, model)
        out = run(x)
        outputs.append(out.detach().clone())
        F.mse_loss(out, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outputs


def reference(cls, steps: int) -> tuple[nn.Module, list[torch.Tensor]]:
    model = cls()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, train(model, opt, steps)


def offload(model: nn.Module) -> SuperOffloadAdamW:
    # TiedHead's embedding is the last bucket backward completes: kept on the host, so that its
    # copy-back is the last one the next forward's first read finds in flight
    config = dict(CONFIG, device_buckets=0) if isinstance(model, TiedHead) else dict(CONFIG)
    return SuperOffloadAdamW(model.parameters(), lr=LR, config=config)


def assert_outputs_close(got: list, want: list) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, s=step: f"forward {s}: {m}")


@pytest.mark.parametrize("cls", [Attention, TiedHead], ids=["multihead_attention", "functional_tied_weight"])
def test_a_parameter_read_by_a_parent_forward_waits_for_its_bucket(cls):
    steps = 6
    ref_model, ref_out = reference(cls, steps)
    model = cls()
    opt = offload(model)
    out = train(model, opt, steps)
    opt.synchronize()
    assert_outputs_close(out, ref_out)
    assert_params_close(model, ref_model, "after 6 steps")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_model_trains_to_the_eager_numbers(backend):
    steps = 4
    ref_model, ref_out = reference(Attention, steps)
    model = Attention()
    opt = offload(model)
    compiled = torch.compile(model, backend=backend)
    out = train(model, opt, steps, run=compiled)
    opt.synchronize()
    assert_outputs_close(out, ref_out)
    assert_params_close(model, ref_model, f"compiled ({backend}), after {steps} steps")


@pytest.mark.slow
def test_a_model_compiled_with_inductor_trains_to_the_eager_numbers():
    steps = 3
    ref_model, ref_out = reference(Attention, steps)
    model = Attention()
    opt = offload(model)
    # Inductor's C++ kernels compiled in this process: its default pool of compile worker
    # processes (each importing torch) costs more than it saves on 2 cores with a cold cache.
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        out = train(model, opt, steps, run=torch.compile(model))
    opt.synchronize()
    assert_outputs_close(out, ref_out)
    assert_params_close(model, ref_model, f"compiled (inductor), after {steps} steps", rtol=1e-4, atol=1e-5)


def test_state_dict_of_a_compiled_model_right_after_step_has_the_updated_weights():
    steps = 3
    ref_model, _ = reference(Attention, steps)
    model = Attention()
    opt = offload(model)
    compiled = torch.compile(model, backend="eager")
    train(model, opt, steps, run=compiled)
    state = {k.removeprefix("_orig_mod."): v.clone() for k, v in compiled.state_dict().items()}
    for name, want in ref_model.state_dict().items():
        torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_load_state_dict_between_step_and_the_next_forward_is_what_that_forward_reads():
    model = Attention()
    opt = offload(model)
    train(model, opt, 2)
    loaded = Attention(seed=1)
    model.load_state_dict(loaded.state_dict())  # the copy-backs of step() may still be in flight
    x, _ = batch(5, model)
    torch.testing.assert_close(model(x), loaded(x), rtol=1e-6, atol=1e-7)
    assert_params_close(model, loaded, "after load_state_dict", exact=True)



def copy_backs_issued(opt) -> list[torch.Tensor]:
    """Wait until the host jobs of the last step issued their copy-backs (the lazy simulated
    streams have not run them); the parameters they write."""
    from superoffload_hf.testing.sim import SimRuntime

    engine = parts(opt)
    for rt in engine.runtimes:
        engine.waiter.wait_idle(rt)
    assert SimRuntime.shared().pending_ops()  # (the main thread's next call into the device arms the check)
    return [p for p in engine.params if engine.buckets.runtime_of.get(p) in engine.inflight]


def test_a_parameter_write_while_its_copy_back_is_pending_is_an_error_naming_the_op(device_mode):
    if device_mode != "sim":
        pytest.skip("the simulated device's check")
    from superoffload_hf.testing.sim import SimRaceError, SimRuntime

    model = Attention()
    opt = offload(model)
    train(model, opt, 2)  # (the first step re-plans and synchronizes)
    pending = copy_backs_issued(opt)
    assert pending, "the step left no copy-back in flight"
    with pytest.raises(SimRaceError, match=r"aten\.copy_\.default .*parameter \(device\)"):
        pending[0].data.copy_(torch.zeros_like(pending[0]))  # no synchronize(): the copy-back may land after it
    with pytest.raises(SimRaceError, match=r"aten\.sum\.default .*parameter \(device\)"):
        pending[0].sum()  # a read as well
    SimRuntime.shared().errors.clear()  # (the device_mode fixture fails a test that left errors)
    opt.synchronize()


def test_a_parameter_write_after_synchronize_is_what_the_next_forward_reads():
    model = Attention()
    opt = offload(model)
    train(model, opt, 2)
    opt.synchronize()
    loaded = Attention(seed=1)
    for p, q in zip(model.parameters(), loaded.parameters()):
        p.data.copy_(q)
    x, _ = batch(5, model)
    torch.testing.assert_close(model(x), loaded(x), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_save_pretrained_of_a_compiled_model_right_after_step_writes_the_updated_weights(tmp_path):
    from safetensors.torch import load_file

    from _models import tiny_batch, tiny_llama

    def run(model, opt, forward):
        for step in range(2):
            forward(**tiny_batch(seed=step)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    ref = tiny_llama(num_layers=1)
    run(ref, torch.optim.AdamW(ref.parameters(), lr=LR), ref)
    model = tiny_llama(num_layers=1)
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=dict(CONFIG, bucket_size_mb=0.01))
    compiled = torch.compile(model, backend="eager")
    run(model, opt, compiled)
    compiled.save_pretrained(tmp_path)  # no synchronize(): the copy-backs of the last step may be in flight
    saved = load_file(str(tmp_path / "model.safetensors"))
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(saved[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_write_through_a_parameter_while_its_copy_back_is_pending_is_refused_naming_synchronize(device_mode):
    """The engine's own check (waits.py), on any device: a write through the parameter or
    `.detach()` between step() and the landing of its copy-back moves its version. Done from a
    user thread here, where the simulator's main-thread dispatch check does not look."""
    import threading

    if device_mode != "sim":
        pytest.skip("nothing is in flight after step() on the CPU device")
    model = Attention()
    opt = offload(model)
    train(model, opt, 2)
    pending = copy_backs_issued(opt)
    writer = threading.Thread(target=lambda: pending[0].detach().mul_(0.5))
    writer.start()
    writer.join()
    with pytest.raises(RuntimeError, match=r"written between optimizer\.step\(\) and the next forward.*"
                                           r"optimizer\.synchronize\(\)"):
        opt.synchronize()
    opt.synchronize()  # reported once; the optimizer goes on
    x, _ = batch(5, model)
    model(x)  # nothing left armed: the next forward runs


def test_a_retained_graph_is_refused_after_step_as_torch_optim_refuses_it():
    """step() bumps each updated parameter's autograd version as torch.optim's in-place update
    does (the engine writes through `.data`, and on the CPU the kernel writes the master the
    parameters are views of), so backward through a graph kept from before the step raises."""
    for make in (lambda m: torch.optim.AdamW(m.parameters(), lr=LR), offload):
        model = Attention()
        opt = make(model)
        x, y = batch(0, model)
        loss = loss_of(model, x, y)
        loss.backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        if hasattr(opt, "close"):
            opt.close()
