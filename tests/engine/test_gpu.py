"""The CUDA paths of the engine: side streams, events, pinned host buffers, device-side casts,
device-resident buckets stepped on the GPU. Skipped without CUDA.

benchmarks/gpu_check.sh runs this file with pytest when the GPU image has it, and directly
(`python tests/engine/test_gpu.py`, the small runner at the bottom) when it does not.
SUPEROFFLOAD_GPU_TEST_DEVICE=cpu runs the same checks on the CPU (a dry run of the test logic).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

try:
    import pytest
except ImportError:  # the GPU image may lack pytest
    pytest = None

from superoffload_hf import SuperOffloadAdamW

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: run as a script, it is not on sys.path
import _gpu_checks  # noqa: E402
from superoffload_hf.testing.engine_parts import parts  # noqa: E402

DEVICE = os.environ.get("SUPEROFFLOAD_GPU_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
LR = 1e-3
STEPS = 6
# Per step: no clipping, a threshold never reached, one the first bucket already exceeds (known
# before speculating), and "mild" = 0.9 x the reference norm (known only at the end: rollbacks).
CLIPS = [None, 1e6, 1e-2, "mild", 1e6, "mild"]

if pytest is not None:
    pytestmark = [
        pytest.mark.gpu,
        pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ]


def tiny_llama(dtype=torch.float32, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.to(device=DEVICE, dtype=dtype)


def with_params_in(model, dtype):
    """Cast the parameters only, as the optimizer does (buffers such as RoPE's stay fp32)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def ids_for(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (2, 32), generator=g).to(DEVICE)


def config(**changes) -> dict:
    return {"bucket_size_mb": 0.05, "device_buckets": 0, "host_threads": 2, **changes}


def offload_run(model, opt, steps=STEPS, thresholds=None):
    """Our loop; `thresholds` (per step) from a reference run, else "mild" means 1.0."""
    norms = []
    for step in range(steps):
        clip = CLIPS[step % len(CLIPS)]
        opt.max_grad_norm = thresholds[step] if thresholds else (1.0 if clip == "mild" else clip)
        loss = model(input_ids=ids_for(step), labels=ids_for(step)).loss
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    opt.synchronize()  # the last host updates reach the parameters in stream order
    return norms


def reference_mixed_run(model_lowp, steps=STEPS):
    """torch's mixed-precision loop: fp32 masters stepped by torch.optim.AdamW with the upcast
    low-precision gradients, clip_grad_norm_ on the masters, masters copied into the model."""
    params = list(model_lowp.parameters())
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, foreach=False)
    norms, thresholds = [], []
    for step in range(steps):
        norm, threshold = reference_step(model_lowp, masters, opt, step)
        norms.append(norm)
        thresholds.append(threshold)
    return norms, thresholds, masters


def reference_step(model_lowp, masters, opt, step) -> tuple[float, float]:
    params = list(model_lowp.parameters())
    model_lowp(input_ids=ids_for(step), labels=ids_for(step)).loss.backward()
    for m, p in zip(masters, params):
        m.grad, p.grad = p.grad.float(), None
    norm = float(torch.nn.utils.clip_grad_norm_(masters, math.inf))  # measures, never clips
    clip = CLIPS[step % len(CLIPS)]
    threshold = 0.9 * norm if clip == "mild" else clip
    torch.nn.utils.clip_grad_norm_(masters, threshold or math.inf)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for m, p in zip(masters, params):
            p.copy_(m)
    return norm, threshold


def reference_step_from(opt, model, ref_model, initial_masters, step):
    """One torch step taken from exactly our state (weights, masters, moments, step counts)."""
    state = opt.state_dict()["state"]
    with torch.no_grad():
        for q, p in zip(ref_model.parameters(), model.parameters()):
            q.copy_(p)
    masters = [torch.nn.Parameter((state[i]["master_param"] if i in state else m0).to(DEVICE).clone())
               for i, m0 in enumerate(initial_masters)]
    ref_opt = torch.optim.AdamW(masters, lr=LR, foreach=False)
    for i, m in enumerate(masters):
        if i in state:
            ref_opt.state[m] = {"step": torch.tensor(float(state[i]["step"])),
                                "exp_avg": state[i]["exp_avg"].to(DEVICE).clone(),
                                "exp_avg_sq": state[i]["exp_avg_sq"].to(DEVICE).clone()}
    norm, threshold = reference_step(ref_model, masters, ref_opt, step)
    return norm, threshold, masters


def masters_of(opt) -> list[torch.Tensor]:
    state = opt.state_dict()["state"]
    return [state[i]["master_param"] for i in sorted(state)]


def assert_all_close(got, want, rtol, atol, what):
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.detach().cpu().float(), b.detach().cpu().float(), rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"{what} {i}: {m}")


def test_fp32_on_the_device_matches_torch_adamw_with_clipping():
    for speculation in ("on", "off"):
        model, ref = tiny_llama(), tiny_llama()
        cfg = config(device_dtype="fp32", speculation=speculation, rollback="snapshot")
        with SuperOffloadAdamW(model.parameters(), lr=LR, config=cfg) as opt:
            ref_norms, thresholds, masters = reference_mixed_run(ref)
            norms = offload_run(model, opt, thresholds=thresholds)
            assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(norms, ref_norms)), (norms, ref_norms)
            assert_all_close(list(model.parameters()), masters, 1e-4, 1e-6, f"speculation {speculation}: param")
            if speculation == "on":
                c = opt.counters
                assert c.speculative_steps > 0 and c.rollbacks > 0 and c.replays > 0, c.as_dict()


def test_inverse_rollback_on_the_device_stays_near_torch_adamw():
    model, ref = tiny_llama(), tiny_llama()
    with SuperOffloadAdamW(model.parameters(), lr=LR, config=config(device_dtype="fp32", speculation="on")) as opt:
        _, thresholds, masters = reference_mixed_run(ref)
        offload_run(model, opt, thresholds=thresholds)
        # a rollback + heavily clipped replay keeps only the rollback's absolute error bound
        assert_all_close(list(model.parameters()), masters, 1e-3, 2e-5, "param")
        assert opt.counters.rollbacks > 0


def test_bf16_each_step_matches_a_torch_mixed_precision_step():
    for speculation, cast in (("on", "device"), ("off", "host"), ("on", "host")):
        model, ref = tiny_llama(), with_params_in(tiny_llama(), torch.bfloat16)
        initial_masters = [p.detach().clone() for p in model.parameters()]
        cfg = config(device_dtype="bf16", speculation=speculation, cast=cast, rollback="snapshot")
        with SuperOffloadAdamW(model.parameters(), lr=LR, config=cfg) as opt:
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
            for step in range(STEPS):
                where = f"speculation {speculation}, cast {cast}, step {step}"
                want_norm, threshold, want = reference_step_from(opt, model, ref, initial_masters, step)
                opt.max_grad_norm = threshold
                model(input_ids=ids_for(step), labels=ids_for(step)).loss.backward()
                opt.step()
                opt.zero_grad()
                assert math.isclose(opt.last_grad_norm, want_norm, rel_tol=1e-4), (where, opt.last_grad_norm, want_norm)
                got = masters_of(opt)
                assert_all_close(got, want, 1e-4, 1e-6, f"{where}: master")
                opt.synchronize()
                for p, m in zip(model.parameters(), got):  # the model holds the rounded masters
                    assert torch.equal(p.detach().cpu(), m.to(torch.bfloat16)), where


def test_speculation_with_snapshot_rollback_changes_nothing_on_the_device():
    runs = []
    for speculation in ("on", "off"):
        model = tiny_llama()
        cfg = config(device_dtype="bf16", speculation=speculation, rollback="snapshot", device_buckets=1)
        with SuperOffloadAdamW(model.parameters(), lr=LR, config=cfg) as opt:
            offload_run(model, opt)
            runs.append(masters_of(opt))
    assert_all_close(runs[0], runs[1], 1e-5, 1e-7, "on vs off master")


def test_device_resident_buckets_are_stepped_on_the_device():
    model, ref = tiny_llama(), tiny_llama()
    cfg = config(device_dtype="fp32", device_buckets=2, speculation="on", rollback="snapshot")
    with SuperOffloadAdamW(model.parameters(), lr=LR, config=cfg) as opt:
        device_runtimes = [rt for rt in parts(opt).runtimes if rt.bucket.device_resident]
        assert len(device_runtimes) == 2
        assert all(rt.bufs.master.device.type == torch.device(DEVICE).type for rt in device_runtimes)
        _, thresholds, masters = reference_mixed_run(ref)
        offload_run(model, opt, thresholds=thresholds)
        assert_all_close(list(model.parameters()), masters, 1e-4, 1e-6, "param")


def test_host_buffers_are_pinned_as_the_cast_policy_says_and_copies_use_side_streams():
    """Each cast policy pins what crosses the link (cast "device": the fp32 master; cast "host":
    the bf16 copy and the landing buffer, not the master), every host<->device copy reads or
    writes page-locked host memory (a pageable non-blocking copy blocks the calling thread, and
    set_sync_debug_mode does not see it), and the copies run on two side streams."""
    for dtype, cast, micro_batches in (("bf16", "device", 1), ("bf16", "host", 1), ("fp32", "host", 2)):
        where = f"{dtype}, cast {cast}, {micro_batches} micro-batch(es)"
        model = tiny_llama()
        cfg = config(device_dtype=dtype, cast=cast, gradient_accumulation_steps=micro_batches)
        with SuperOffloadAdamW(model.parameters(), lr=LR, config=cfg) as opt:
            engine = parts(opt)
            host = [rt for rt in engine.runtimes if not rt.bucket.device_resident]
            assert host and all(rt.bufs.master.device.type == "cpu" for rt in host), where
            recorder = _gpu_checks.SeamRecorder(engine.runtime)
            try:
                for step in range(2):
                    for _ in range(micro_batches):
                        model(input_ids=ids_for(step), labels=ids_for(step)).loss.backward()
                    opt.step()
                    opt.zero_grad()
                opt.synchronize()
            finally:
                recorder.restore()
            if ON_CUDA:
                assert any(_gpu_checks.expected_host_pinning(engine).values()), where
                assert not _gpu_checks.pinning_mismatches(engine, _gpu_checks.cuda_is_pinned), where
                assert not _gpu_checks.copy_streams_problems(engine), where
                assert recorder.copies, where
                pageable = _gpu_checks.pageable_copies(recorder.copies, _gpu_checks.cuda_is_host,
                                                       _gpu_checks.cuda_is_pinned)
                assert not pageable, (where, pageable[:3])
                assert engine.step_returns_early
                assert all(isinstance(rt.h2d_event, torch.Event) for rt in host), where
            if ON_CUDA or dtype != "fp32":  # fp32 on the CPU: the parameters are the masters, nothing moves
                assert opt.counters.bytes_d2h > 0 and opt.counters.bytes_h2d > 0, where


def test_the_next_forward_sees_the_updated_weights():
    """step() returns before the last host updates land (on CUDA); the forward waits per bucket.
    Its output must equal a forward after a full synchronize."""
    model = tiny_llama()
    with SuperOffloadAdamW(model.parameters(), lr=LR, config=config(device_dtype="fp32", speculation="on")) as opt:
        offload_run(model, opt, steps=3)
        model(input_ids=ids_for(9), labels=ids_for(9)).loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            logits_after_step = model(input_ids=ids_for(10)).logits.clone()
            opt.synchronize()
            logits_synchronized = model(input_ids=ids_for(10)).logits
        assert torch.equal(logits_after_step, logits_synchronized)


def test_fp16_loss_scaling_on_the_device():
    model = tiny_llama()
    cfg = config(device_dtype="fp16", loss_scale_init=2.0**12)
    with SuperOffloadAdamW(model.parameters(), lr=LR, config=cfg) as opt:
        norms = offload_run(model, opt, steps=4)
        assert all(math.isfinite(n) for n in norms) and opt.counters.skips == 0
        opt.scale_loss(model(input_ids=ids_for(0), labels=ids_for(0)).loss * 1e6).backward()
        opt.step()
        opt.zero_grad()
        assert opt.last_step_skipped and opt.loss_scale == 2.0**11


def test_tied_embeddings_on_the_device():
    model, ref = tiny_llama(tie=True), tiny_llama(tie=True)
    cfg = config(device_dtype="fp32", speculation="on", rollback="snapshot")
    with SuperOffloadAdamW(model.parameters(), lr=LR, config=cfg) as opt:
        _, thresholds, masters = reference_mixed_run(ref)
        offload_run(model, opt, thresholds=thresholds)
        assert_all_close(list(model.parameters()), masters, 1e-4, 1e-6, "param")


def test_the_steady_state_step_path_never_synchronizes_the_device():
    """With no device-resident bucket, forward + backward + step() + zero_grad() after the first
    steps must not block the host on the device (torch.cuda.set_sync_debug_mode reports any
    synchronizing call on the training thread; the worker's event waits are its own thread's)."""
    import warnings

    model = tiny_llama()
    cfg = config(device_dtype="bf16", device_buckets=0, speculation="on", cast="device")
    with SuperOffloadAdamW(model.parameters(), lr=LR, config=cfg) as opt:
        offload_run(model, opt, steps=2)  # the first step learns the plan (it synchronizes)
        ids = ids_for(7)
        if ON_CUDA:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(2):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
        finally:
            if ON_CUDA:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        assert not syncs, f"the step path synchronized the device {len(syncs)} times: {syncs[:3]}"


def _run_without_pytest() -> int:
    if ON_CUDA and not torch.cuda.is_available():
        print("SKIP: no CUDA GPU")
        return 0
    failed = 0
    for name, fn in sorted((n, f) for n, f in globals().items() if n.startswith("test_")):
        try:
            fn()
            print(f"PASS {name}")
        except Exception as error:  # report every test, then fail
            failed += 1
            print(f"FAIL {name}: {type(error).__name__}: {error}")
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(_run_without_pytest())
