"""benchmarks/compact_ablation.py: its emulated formats and the synthetic moment-tracking study
that found the compact quality gap (sqrt(v) rounded to nearest under a bf16 scale cannot decay)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "compact_ablation.py"


def _load():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("compact_ablation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ab = _load()


def test_emulated_master_is_the_formats_encode():
    from superoffload_hf.host import compact

    w = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 0.03
    for kind, err_dtype in (("err8", torch.int8), ("err16", torch.int16)):
        hi, err = compact.encode_master(w, err_dtype)
        assert torch.equal(ab.store_master(w, kind), compact.decode_master_bits(hi, err).view(torch.float32))
    assert torch.equal(ab.store_master(w, "bf16"), w.to(torch.bfloat16).float())


def test_emulated_sqrt_v_quantiser_matches_the_old_format_rounded_to_nearest():
    cfg = dict(ab.BASE, v="sqrt8")
    v = torch.rand(32 * 50, generator=torch.Generator().manual_seed(1)) ** 4
    t = ab.quantise_v(v, "sqrt8", cfg, None).sqrt()
    s = v.sqrt().view(-1, 32)
    scale = ab._scale(s.amax(dim=1, keepdim=True), 255, "bf16up")
    q = torch.round(s / scale).clamp(min=1)
    assert torch.allclose(t.view(-1, 32), q * scale, rtol=1e-6, atol=0)


def test_synthetic_study_shows_v_stuck_high_when_rounded_to_nearest_and_not_when_unbiased():
    rows = ab.synthetic_tracking(["v8", "v8-sr"], n=32 * 64, steps=1000)
    last = {name: r[1000] for name, r in rows.items()}
    assert last["v8"]["sqrt_v_ratio"] > 1.05 and last["v8"]["update_ratio"] < 0.95  # the gap's cause
    for name in ("v8-sr",):
        assert abs(last[name]["sqrt_v_ratio"] - 1) < 0.02, (name, last[name])


def _kernel_variant_run(kind: str, backend, steps: int = 6):
    gen = torch.Generator().manual_seed(3)
    init = [(torch.randn(n, generator=gen) * 0.05).to(torch.bfloat16) for n in (70, 33)]
    params = [torch.nn.Parameter(w.clone()) for w in init]
    grads = [[(torch.randn(p.numel(), generator=gen) * 1e-2).to(torch.bfloat16) for p in params] for _ in range(steps)]
    opt = ab.EmulatedStateAdamW(params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                                cfg=dict(ab.BASE, **ab.VARIANTS[f"kernel-{kind}"]), seed=0, backend=backend)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return init, params, grads, opt


def test_kernel_compact_variant_steps_each_parameter_as_the_compact_reference(cpp_adam):
    from superoffload_hf.host import compact

    init, params, grads, opt = _kernel_variant_run("compact", cpp_adam("scalar"))
    for i, (p, w0) in enumerate(zip(params, init)):
        n = w0.numel()
        ref = compact.empty_state(n, "compact")
        compact.compact_encode_(*ref, w0.float(), torch.zeros(n), torch.zeros(n))
        for t, step_grads in enumerate(grads, start=1):
            compact.compact_step_(*ref, step_grads[i], step=t, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                  weight_decay=0.1, adamw=True)
        for got, want in zip(opt.state[p]["buf"], ref):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(p.detach(), ref[0])  # the device weight is the master's bf16 part


def test_kernel_fp32_variant_matches_torch_adamw(cpp_adam):
    init, params, grads, opt = _kernel_variant_run("fp32", cpp_adam("scalar"))
    masters = [torch.nn.Parameter(w.float()) for w in init]
    torch_opt = torch.optim.AdamW(masters, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for step_grads in grads:
        for m, g in zip(masters, step_grads):
            m.grad = g.float()
        torch_opt.step()
    for p, m in zip(params, masters):
        torch.testing.assert_close(opt.state[p]["buf"][0], m.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), opt.state[p]["buf"][0].to(torch.bfloat16))  # rounded to nearest
