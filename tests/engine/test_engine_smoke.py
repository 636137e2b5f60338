"""Engine smoke tests on the CPU: a small MLP, a few steps against torch.optim.AdamW.

The contract-level matrix (tiny Llamas, every mode, checkpoints, races) lives in
tests/engine/test_optimizer_*.py; these are the engine's own development checks.
"""

from __future__ import annotations

import copy
import gc
import math
import threading

import pytest
import torch

from superoffload_hf import SuperOffloadAdamW, SuperOffloadConfig
from superoffload_hf.device.transfer import GRAD_RING_SLOTS
from superoffload_hf.engine.step.hooks import HeldGrad

from _models import read_params
from superoffload_hf.testing.engine_parts import parts, return_early

pytestmark = [pytest.mark.usefixtures("device_mode"), pytest.mark.timeout(120)]

LR = 1e-2
BASE = {"device_dtype": "fp32", "bucket_size_mb": 0.002, "host_threads": 1, "device_buckets": 0}


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mlp(seed: int = 0, dtype=torch.float32) -> torch.nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
            torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    return model.to(dtype)


def batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(12, 16, generator=g), torch.randn(12, 8, generator=g)


def loss_of(model, step: int, micro: int = 0):
    x, y = batch(step, micro)
    return torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)


def reference_step(model, opt, step, max_norm, accumulation=1):
    """torch: backward, clip_grad_norm_, step. max_norm "mild" clips to 0.9 of this step's norm
    (so the engine learns it must clip only after most buckets were launched). Returns the norm
    and the threshold used."""
    for micro in range(accumulation):
        (loss_of(model, step, micro) / accumulation).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))  # measures, never clips
    threshold = 0.9 * norm if max_norm == "mild" else max_norm
    torch.nn.utils.clip_grad_norm_(model.parameters(), threshold or math.inf)
    opt.step()
    opt.zero_grad()
    return norm, threshold


def offload_step(model, opt, step, max_norm, accumulation=1):
    opt.max_grad_norm = max_norm
    for micro in range(accumulation):
        (loss_of(model, step, micro) / accumulation).backward()
    opt.step()
    opt.zero_grad()
    return opt.last_grad_norm


def assert_models_close(got, want, where, exact=False):
    for (name, p), q in zip(read_params(got).items(), read_params(want).values()):
        if exact:
            assert torch.equal(p.detach(), q.detach()), f"{where}: {name} differs bitwise"
        else:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{where}: {name}: {m}")


def clip_schedule(step: int):
    return [None, 1e3, 0.05, "mild"][step % 4]


def fixed_clip(step: int):
    return [None, 1e3, 0.05, 0.5][step % 4]


def make(config=None, **opt_kw):
    model = mlp()
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config={**BASE, **(config or {})}, **opt_kw)
    return model, opt


@pytest.mark.parametrize("config", [
    {"speculation": "off"},
    {"speculation": "on", "rollback": "snapshot"},
    {"speculation": "on", "rollback": "snapshot", "device_buckets": 2},
    {"speculation": "auto", "rollback": "snapshot", "cast": "host"},
    {"speculation": "on", "rollback": "snapshot", "gradient_accumulation_steps": 3},
], ids=["off", "on", "device-buckets", "auto-cast-host", "accumulate"])
def test_every_parameter_matches_torch_adamw_after_every_step(config):
    model, opt = make(config)
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    accumulation = config.get("gradient_accumulation_steps", 1)
    with opt:
        for step in range(8):
            want, threshold = reference_step(ref, ref_opt, step, clip_schedule(step), accumulation)
            got = offload_step(model, opt, step, threshold, accumulation)
            assert got == pytest.approx(want, rel=1e-5)
            assert_models_close(model, ref, f"step {step}")
        c = opt.counters
        assert c.steps == 8 and c.skips == 0
        if config["speculation"] == "on":
            # The first step learns the plan and never speculates; the first bucket alone
            # exceeds 0.05, so those steps are known to clip before anything is speculated;
            # "mild" clipping shows only at the end: rollbacks and replays.
            assert c.speculative_steps == 5 and c.rollbacks == c.replays == 2, c.as_dict()


def test_inverse_rollback_without_clipping_is_bitwise_equal_to_no_speculation():
    (a, opt_a), (b, opt_b) = make({"speculation": "on"}), make({"speculation": "off"})
    with opt_a, opt_b:
        for step in range(5):
            offload_step(a, opt_a, step, None)
            offload_step(b, opt_b, step, None)
            assert_models_close(a, b, f"step {step}", exact=True)
        assert opt_a.counters.speculative_steps == 4 and opt_a.counters.rollbacks == 0


def test_inverse_rollback_on_a_skipped_step_restores_within_the_stated_bound():
    model, opt = make({"speculation": "on"})
    with opt:
        for step in range(3):
            offload_step(model, opt, step, None)
        before = [p.detach().clone() for p in read_params(model).values()]
        model[0].bias.register_hook(lambda g: torch.full_like(g, math.inf))  # arrives last
        offload_step(model, opt, 3, None)
        assert opt.last_step_skipped and math.isinf(opt.last_grad_norm)
        assert opt.counters.skips == 1 and opt.counters.rollbacks == 1
        for p, q in zip(read_params(model).values(), before):
            bound = 4 * 2.0**-23 * (q.abs() + 10 * LR) / (1 - LR * 1e-2)
            assert bool(((p.detach() - q).abs() <= bound).all())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cast_on_host_and_on_device_give_identical_results(dtype):
    runs = []
    for cast in ("host", "device"):
        model = mlp()
        opt = SuperOffloadAdamW(model.parameters(), lr=LR, config={**BASE, "device_dtype": dtype, "cast": cast,
                                                                   "speculation": "on", "rollback": "snapshot"})
        with opt:
            for step in range(4):
                offload_step(model, opt, step, fixed_clip(step))
            runs.append(([p.detach().clone() for p in read_params(model).values()], opt.state_dict()["state"]))
    for p, q in zip(runs[0][0], runs[1][0]):
        assert p.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
        assert torch.equal(p, q)
    for i, entry in runs[0][1].items():
        assert torch.equal(entry["master_param"], runs[1][1][i]["master_param"])


def test_bf16_device_parameters_are_the_rounded_fp32_masters():
    model = mlp()
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config={**BASE, "device_dtype": "bf16"})
    with opt:
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        offload_step(model, opt, 0, 1.0)
        masters = opt.state_dict()["state"]
        for i, p in enumerate(model.parameters()):
            assert torch.equal(p.detach(), masters[i]["master_param"].to(torch.bfloat16))


def test_fp16_loss_scale_skips_an_overflow_backs_off_and_is_checkpointed():
    model = mlp()
    config = {**BASE, "device_dtype": "fp16", "loss_scale_init": 2.0**10, "loss_scale_growth_interval": 2}
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config=config)
    with opt:
        opt.scale_loss(loss_of(model, 0)).backward()
        opt.step()
        opt.zero_grad()
        assert not opt.last_step_skipped and opt.loss_scale == 2.0**10
        opt.scale_loss(loss_of(model, 1) * 1e30).backward()  # overflows fp16 gradients
        opt.step()
        opt.zero_grad()
        assert opt.last_step_skipped and opt.loss_scale == 2.0**9
        for step in (2, 3):
            opt.scale_loss(loss_of(model, step)).backward()
            opt.step()
            opt.zero_grad()
        assert opt.loss_scale == 2.0**10  # two good steps: grown back
        assert opt.state_dict()["superoffload"]["loss_scale"]["scale"] == 2.0**10


def test_unscaled_fp16_norm_matches_the_fp32_norm():
    model, ref = mlp(dtype=torch.float16), mlp()
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config={**BASE, "device_dtype": "fp16"})
    with opt:
        opt.scale_loss(loss_of(model, 0)).backward()
        opt.step()
        loss_of(ref, 0).backward()
        want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf))
        assert opt.last_grad_norm == pytest.approx(want, rel=2e-2)


def test_clip_grad_norm_on_the_model_raises_with_the_fix_in_the_message():
    model, opt = make()
    with opt:
        loss_of(model, 0).backward()
        assert all(isinstance(p.grad, HeldGrad) for p in model.parameters())
        with pytest.raises(RuntimeError, match="pass `max_grad_norm` to the optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("config", [{"speculation": "off"}, {"speculation": "on", "rollback": "snapshot"},
                                    {"speculation": "off", "device_buckets": 2}], ids=["off", "on", "device-buckets"])
@pytest.mark.parametrize("pattern", ["retain-graph", "two-graphs"])
def test_backwards_with_no_forward_between_accumulate_as_torch(config, pattern):
    """The second backward meets the first one's placeholders (no forward cleared them):
    autograd's accumulation into a placeholder restarts p.grad from the new gradient alone."""
    model, opt = make({**config, "gradient_accumulation_steps": 2})
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    with opt:
        for step in range(3):
            for m, o in ((model, opt), (ref, ref_opt)):
                if pattern == "retain-graph":
                    loss = loss_of(m, step)
                    loss.backward(retain_graph=True)
                    (0.5 * loss).backward()
                else:
                    first, second = loss_of(m, step, 0), loss_of(m, step, 1)
                    first.backward()
                    second.backward()
                if o is opt:
                    assert all(isinstance(p.grad, HeldGrad) for p in m.parameters())
                o.step()
                o.zero_grad()
            assert_models_close(model, ref, f"step {step}")


def test_a_forward_clears_the_placeholders_and_other_uses_still_raise():
    model, opt = make({"gradient_accumulation_steps": 2})
    with opt:
        loss_of(model, 0, 0).backward()
        weight = model[0].weight
        assert isinstance(weight.grad, HeldGrad)
        for use in (lambda g: g.add_(1.0), lambda g: g + 1.0, lambda g: torch.zeros(16, 32).add_(g)):
            with pytest.raises(RuntimeError, match="held by the SuperOffload optimizer"):
                use(weight.grad)
        loss = loss_of(model, 0, 1)  # the next micro-batch's forward
        assert all(p.grad is None for p in model.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_a_parameter_without_a_gradient_is_not_updated():
    model, opt = make({"speculation": "on", "rollback": "snapshot"})
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    with opt:
        for step in range(5):
            for m in (model, ref):
                m[2].requires_grad_(step % 2 == 0)  # the LayerNorm only gets gradients on even steps
            reference_step(ref, ref_opt, step, 0.05)
            offload_step(model, opt, step, 0.05)
            assert_models_close(model, ref, f"step {step}")
        state = opt.state_dict()["state"]
        assert state[2]["step"] == state[3]["step"] == 3 and state[0]["step"] == 5


def test_a_second_backward_after_launch_is_rolled_back_and_included():
    """More micro-batches than configured: the late gradients must still count."""
    model, opt = make({"speculation": "on", "rollback": "snapshot"})
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    with opt:
        for step in range(4):
            reference_step(ref, ref_opt, step, None, accumulation=1 if step < 2 else 2)
            offload_step(model, opt, step, None, accumulation=1 if step < 2 else 2)
            assert_models_close(model, ref, f"step {step}")
        assert opt.counters.rollbacks == 2 and opt.counters.replays == 2


class SharedLayer(torch.nn.Module):
    """One Linear used in two reentrant checkpoints: its hooks fire twice per backward."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.inp, self.shared, self.out = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for _ in range(2):
            h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.out(h)


def test_a_parameter_whose_hook_fires_twice_per_backward_is_deferred_and_correct():
    model, ref = SharedLayer(), SharedLayer()
    opt = SuperOffloadAdamW(model.parameters(), lr=LR, config={**BASE, "speculation": "on", "rollback": "snapshot"})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    with opt:
        for step in range(5):
            _, threshold = reference_step(ref, ref_opt, step, clip_schedule(step))
            offload_step(model, opt, step, threshold)
            assert_models_close(model, ref, f"step {step}")
        deferred = [b for b in opt.plan.buckets if not b.speculative]
        assert sorted(i for b in deferred for i in b.param_indices) == [2, 3]  # shared.weight, shared.bias


def test_snapshot_rollback_copies_through_the_host_adams_pool_and_restores_exactly():
    """rollback "snapshot": the worker takes and restores the snapshot with the host Adam's own
    copy (its thread pool, GIL released), never torch's OpenMP team, which would spin beside the
    pool during backward; the clipped steps then match torch element by element."""
    model, opt = make({"speculation": "on", "rollback": "snapshot"})
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    adam, copies = parts(opt).adam, []
    kernel_copy = adam.grad_copy_
    adam.grad_copy_ = lambda dst, src: copies.append((dst, src)) or kernel_copy(dst, src)
    with opt:
        for step in range(4):
            _, threshold = reference_step(ref, ref_opt, step, clip_schedule(step))
            offload_step(model, opt, step, threshold)
            assert_models_close(model, ref, f"step {step}", exact=False)
        snapshots = {id(t) for rt in parts(opt).runtimes if rt.bufs._snapshot for t in rt.bufs._snapshot}
        taken = sum(id(dst) in snapshots for dst, _ in copies)
        restored = sum(id(src) in snapshots for _, src in copies)
        assert opt.counters.speculative_steps > 0 and opt.counters.rollbacks > 0
        assert taken > 0 and taken % 3 == 0  # master, exp_avg, exp_avg_sq per speculative step
        assert restored > 0 and restored % 3 == 0


def test_snapshot_rollback_restores_the_host_cast_lowp_with_the_host_adams_cast():
    """cast "host" keeps a bf16 copy of each host bucket's master: the restore recasts it with the
    host Adam's lowp_copy_ (its pool, the step's rounding), and it equals the master's rounding."""
    model, opt = make({"speculation": "on", "rollback": "snapshot", "device_dtype": "bf16", "cast": "host"})
    adam, casts = parts(opt).adam, []
    kernel_cast = adam.lowp_copy_
    adam.lowp_copy_ = lambda dst, src: casts.append(dst) or kernel_cast(dst, src)
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    with opt:
        for step in range(4):  # step 3: clipped at 0.9 of the norm, after most buckets speculated
            _, threshold = reference_step(ref, ref_opt, step, clip_schedule(step))
            offload_step(model, opt, step, threshold)
        opt.synchronize()
        assert opt.counters.rollbacks > 0 and casts
        host = [rt for rt in parts(opt).buckets.host() if rt.bufs.lowp is not None]
        assert host and any(dst is rt.bufs.lowp for rt in host for dst in casts)  # a rolled-back bucket's
        for rt in host:
            assert torch.equal(rt.bufs.lowp.view(torch.int16), rt.bufs.master.to(torch.bfloat16).view(torch.int16))


def test_zero_grad_before_step_discards_the_gradients_as_torch_does():
    model, opt = make({"speculation": "on", "rollback": "snapshot"})
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    with opt:
        for step in range(3):
            for m, o in ((model, opt), (ref, ref_opt)):
                loss_of(m, 50 + step).backward()
                o.zero_grad()
                loss_of(m, step).backward()
                o.step()
                o.zero_grad()
            assert_models_close(model, ref, f"step {step}")


def test_step_returning_early_lets_the_next_forward_wait_per_bucket():
    model, opt = make({"speculation": "on", "rollback": "snapshot"})
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    return_early(opt)  # the CUDA behaviour, on the CPU
    with opt:
        for step in range(4):
            want, threshold = reference_step(ref, ref_opt, step, clip_schedule(step))
            got = offload_step(model, opt, step, threshold)
            assert got == pytest.approx(want, rel=1e-5)
        opt.synchronize()
        assert_models_close(model, ref, "after 4 steps")


def test_step_fences_the_device_stream_before_queuing_its_copy_backs():
    """On CUDA, the copy-backs queued by step() must wait for kernels queued before step() (an
    evaluation forward between backward and step() reads the old weights): step() fences first.
    (bf16: on the CPU, fp32 parameters are the masters themselves and nothing is copied back.)"""
    model, opt = make({"speculation": "off", "device_dtype": "bf16"})
    transfer, log = parts(opt).transfer, []
    fence, to_device = transfer.fence, transfer.params_to_device
    transfer.fence = lambda: log.append("fence") or fence()
    transfer.params_to_device = lambda *args: log.append("copy") or to_device(*args)
    with opt:
        for step in range(3):
            log.append("backward")
            loss_of(model, step).backward()
            opt.step()
            opt.synchronize()  # asynchronous devices: this step's copy-backs are logged by now
            opt.zero_grad()
    steps = " ".join(log).split("backward")[1:]
    assert len(steps) == 3 and all("copy" in s and s.index("fence") < s.index("copy") for s in steps), log


def test_steps_after_the_first_allocate_no_device_buffers(device_mode):
    """Gradient rounds go through the transfer's ring of device buffers and copy-backs through
    one staging buffer: once the plan is learned (step 1), training allocates nothing on the
    device, and the ring stays at GRAD_RING_SLOTS although the plan has more host buckets."""
    model, opt = make({"speculation": "on", "device_buckets": 1, "bucket_size_mb": 0.001})
    runtime, allocations = parts(opt).runtime, []
    device_empty = runtime.device_empty
    with opt:
        for step in range(5):
            if step == 2:
                runtime.device_empty = lambda numel, dtype: allocations.append(numel) or device_empty(numel, dtype)
            offload_step(model, opt, step, fixed_clip(step))
        opt.synchronize()
        host_buckets, ring_slots = len(list(parts(opt).buckets.host())), parts(opt).transfer.ring_slots
    del runtime.device_empty
    assert allocations == []
    assert host_buckets > GRAD_RING_SLOTS >= ring_slots  # (read before close(), which frees them)
    if device_mode == "sim":
        assert ring_slots == GRAD_RING_SLOTS


def _inside(p: torch.Tensor, flat: torch.Tensor) -> bool:
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    return start <= p.data_ptr() < end


def test_on_the_cpu_fp32_parameters_are_views_of_their_masters(device_mode):
    """CPU + fp32: each host bucket's parameters live in its fp32 master buffer, after the
    re-plan of step 1 too; speculative steps, rollbacks and replays update them in place, nothing
    is copied back and no gradient crosses; every step matches torch. (The simulated device
    keeps device parameters of their own.)"""
    model, opt = make({"speculation": "on", "device_buckets": 1})
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    with opt:
        for step in range(6):
            want, threshold = reference_step(ref, ref_opt, step, clip_schedule(step))
            offload_step(model, opt, step, threshold)
            opt.synchronize()
            assert_models_close(model, ref, f"step {step}")
        aliased = [_inside(p, rt.bufs.master) for rt in parts(opt).buckets.host() for p in rt.params]
        counters = opt.counters
    assert counters.rollbacks > 0 and counters.replays > 0
    if device_mode == "cpu":
        assert all(aliased) and counters.bytes_h2d == 0 and counters.bytes_d2h == 0
    else:
        assert not any(aliased) and counters.bytes_h2d > 0 and counters.bytes_d2h > 0


def test_aliased_parameters_save_with_safetensors_as_separate_tensors(device_mode, tmp_path):
    """Each parameter has a storage of its own over its master's memory: safetensors refuses
    tensors that share a storage, and accelerate's save_model would keep only one of them."""
    from safetensors.torch import load_file, save_file

    model, opt = make({"speculation": "on"})
    with opt:
        for step in range(2):
            offload_step(model, opt, step, None)
        opt.synchronize()
        state = model.state_dict()
        assert len({t.untyped_storage().data_ptr() for t in state.values()}) == len(state)
        save_file(state, tmp_path / "model.safetensors")
        loaded = load_file(tmp_path / "model.safetensors")
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


@pytest.mark.parametrize("replace", ["data", "to_float64"])
def test_replacing_a_parameters_storage_after_construction_is_refused_at_step(device_mode, replace):
    """On the CPU with fp32 the parameters are the optimizer's masters: a parameter whose
    storage user code replaced would silently stop training, so step() refuses it by name."""
    model, opt = make({"speculation": "on"})
    with opt:
        offload_step(model, opt, 0, None)
        with torch.no_grad():
            if replace == "data":
                model[0].weight.data = model[0].weight.data.clone()
            else:
                model.to(torch.float64)
        loss_of(model, 1).backward()
        if device_mode == "sim":
            opt.step()  # separate device parameters: the copy-back writes whatever p.data is now
            return
        with pytest.raises(RuntimeError, match="no longer shares memory with the optimizer's fp32 master"):
            opt.step()
        opt.zero_grad()


def test_loading_a_state_dict_updates_aliased_parameters_in_place(device_mode):
    """load_state_dict writes the masters; on the CPU the parameters are those masters."""
    model, opt = make({"speculation": "on"})
    with opt:
        for step in range(3):
            offload_step(model, opt, step, None)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        sd = copy.deepcopy(opt.state_dict())  # state_dict() views the live state (torch convention)
        offload_step(model, opt, 3, None)
        opt.load_state_dict(sd)
        opt.synchronize()
        for name, value in model.state_dict().items():
            assert torch.equal(value, saved[name]), name


def test_state_dict_round_trip_continues_bit_identically(tmp_path):
    config = {"speculation": "on"}
    model, opt = make(config)
    for step in range(3):
        offload_step(model, opt, step, fixed_clip(step))
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    torch.save(model.state_dict(), tmp_path / "model.pt")
    resumed_model = mlp(seed=1)
    resumed_model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    resumed = SuperOffloadAdamW(resumed_model.parameters(), lr=LR, config={**BASE, **config})
    resumed.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    with opt, resumed:
        assert resumed.counters.counts() == opt.counters.counts()  # (the seconds are each process's own)
        for step in range(3, 7):
            a = offload_step(model, opt, step, fixed_clip(step))
            b = offload_step(resumed_model, resumed, step, fixed_clip(step))
            assert a == b
            assert_models_close(resumed_model, model, f"step {step}", exact=True)


def test_load_state_dict_rejects_a_checkpoint_of_another_shape():
    model, opt = make()
    with opt:
        offload_step(model, opt, 0, None)
        sd = opt.state_dict()
        sd["state"][0]["exp_avg"] = torch.zeros(3)
        with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] has shape \(3,\)"):
            opt.load_state_dict(sd)


def test_an_exception_in_the_host_worker_surfaces_in_the_training_loop():
    model, opt = make({"speculation": "off"})

    def broken(*args, **kwargs):
        raise ValueError("kernel exploded")

    parts(opt).adam.adam_step_ = broken
    loss_of(model, 0).backward()
    with pytest.raises(RuntimeError, match="host worker failed: ValueError: kernel exploded"):
        opt.step()
    with pytest.raises(RuntimeError, match="host worker failed"):
        loss_of(model, 1).backward()
    opt.close()


def worker_threads():
    return [t for t in threading.enumerate() if t.name == "superoffload-host"]


def test_close_stops_the_worker_thread_and_removes_the_hooks(device_mode):
    before = len(worker_threads())
    model, opt = make()
    assert len(worker_threads()) == before + (device_mode == "sim")  # the CPU device: jobs run inline
    opt.close()
    assert len(worker_threads()) == before
    loss_of(model, 0).backward()
    assert not isinstance(model[0].weight.grad, HeldGrad)  # plain autograd again


def test_garbage_collecting_the_optimizer_stops_its_worker():
    before = len(worker_threads())
    model, opt = make()
    offload_step(model, opt, 0, 1.0)
    del opt
    gc.collect()
    assert len(worker_threads()) == before


def test_parameters_on_two_devices_are_rejected_naming_both():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, device="meta"))]
    with pytest.raises(ValueError, match="two devices, cpu and meta"):
        SuperOffloadAdamW(params, config=BASE)


def test_adding_a_param_group_after_construction_is_refused():
    model, opt = make()
    with opt, pytest.raises(NotImplementedError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_config_can_be_a_dict_or_a_config_and_the_plan_prints():
    model = mlp()
    with SuperOffloadAdamW(model.parameters(), config=SuperOffloadConfig(**BASE)) as opt:
        text = str(opt.plan)
        assert text.startswith("BucketPlan:") and len(opt.plan.buckets) >= 4


def test_the_optimizer_names_its_host_adam_back_end_and_thread_count():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = SuperOffloadAdamW(model.parameters(), config={"device_dtype": "fp32", "host_threads": 2,
                                                        "host_kernel": "reference"})
    try:
        assert (opt.host_adam.name, opt.host_adam.threads) == ("reference", 2)
        assert "host Adam reference/none x2 threads" in opt.describe()
    finally:
        opt.close()


@pytest.mark.parametrize("how", ["copied", "dropped"])
def test_the_gradient_ring_shrinks_back_to_its_size_once_the_rounds_held_open_beyond_it_close(device_mode, how):
    """Rounds held open at once beyond GRAD_RING_SLOTS grow the ring (every slot held: none to
    wait for); each slot freed while the ring is over its size goes (issue 29 item 14), so the
    ring does not keep a step's worst case for the rest of training."""
    from superoffload_hf.device import make_runtime
    from superoffload_hf.device.transfer import Transfer

    transfer = Transfer(make_runtime(torch.device("cpu")), pin_memory=False)
    transfer.reserve(64)
    for _ in range(2):  # growing again after shrinking works the same
        rounds = [transfer.grad_slot(64, torch.float32) for _ in range(GRAD_RING_SLOTS + 3)]
        assert transfer.ring_slots == GRAD_RING_SLOTS + 3
        for grad_dev in rounds:
            grad_dev.fill_(1.0)
            if how == "copied":
                transfer.grad_to_host(grad_dev, torch.empty(64)).synchronize()
            else:
                transfer.release_grad_slot(grad_dev)
        assert transfer.ring_slots == GRAD_RING_SLOTS
