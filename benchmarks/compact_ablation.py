"""Which part of the compact format costs quality? Ablations in a pure-torch emulation.

    python benchmarks/compact_ablation.py --variants fp32,compact,m8,v8 --steps 1000 --seeds 0,1,2

Each variant is an AdamW (`EmulatedStateAdamW`) on the bf16 model of the tiny recipe (stock
Trainer path, `superoffload: false`, the same batches and init per seed as compact_quality.py's
bf16-rtn baseline) that keeps its own state in one of the formats below and writes the bf16
device weight rounded to nearest from its master. The emulation is fp32 torch arithmetic (not
the kernels' bitwise order), groups of `group` consecutive elements of each flattened tensor.

State knobs (a variant is a dict of them, VARIANTS):
  master: fp32 | err8 (bf16 + int8 error term, host/compact.py's encode) | err16 | bf16 (round
          to nearest: the bf16-rtn baseline)
  m:      fp32 | lin8 (int8 q * scale, scale = amax/127) | comp8 (FlashOptim-style compander
          2x/(1+|x|) of x/amax, int8)
  v:      fp32 | sqrt8 (uint8 q * scale of sqrt(v), scale = amax/255, q >= 1 where v > 0)
  round:  nearest | stochastic (the moments' encode; the master always rounds to nearest)
  scale:  bf16up (the least bf16 >= amax/Q, as the format) | fp32 (amax/Q)
  group:  elements per scale (32)
  kernel: None | fp32 | compact: instead of the emulation, GraceAdam itself (adam_step_ or
          compact_step_ of host/kernel.py on one thread) steps each parameter's own buffers, the
          format bit for bit as the product stores it, under the same stock Trainer path
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compact_quality  # noqa: E402

from superoffload_hf.host import compact  # noqa: E402

BASE = dict(master="fp32", m="fp32", v="fp32", round="nearest", vround=None, scale="bf16up", group=32, kernel=None)
VARIANTS = {
    "fp32": {},
    "bf16": dict(master="bf16"),
    "err8": dict(master="err8"),
    "m8": dict(m="lin8"),
    "v8": dict(v="sqrt8"),
    "compact": dict(master="err8", m="lin8", v="sqrt8"),
    "compact-sr": dict(master="err8", m="lin8", v="sqrt8", round="stochastic"),
    "v8-sr": dict(v="sqrt8", round="stochastic"),
    "m8-sr": dict(m="lin8", round="stochastic"),
    "mc8": dict(m="comp8"),
    "v8-g8": dict(v="sqrt8", group=8),
    "v8-fp32scale": dict(v="sqrt8", scale="fp32"),
    "m8-fp32scale": dict(m="lin8", scale="fp32"),
    "compact-fp32scale": dict(master="err8", m="lin8", v="sqrt8", scale="fp32"),
    "compact-vsr": dict(master="err8", m="lin8", v="sqrt8", vround="stochastic"),
    "err8-v8sr": dict(master="err8", v="sqrt8", vround="stochastic"),
    "m8-v8sr": dict(m="lin8", v="sqrt8", vround="stochastic"),
    "compact-mc-vsr": dict(master="err8", m="comp8", v="sqrt8", vround="stochastic"),
    # the product's kernels themselves (GraceAdam adam_step_ / compact_step_ on each parameter)
    "kernel-fp32": dict(kernel="fp32"),
    "kernel-compact": dict(kernel="compact"),
}


def _round(x: torch.Tensor, mode: str, gen: torch.Generator) -> torch.Tensor:
    if mode == "nearest":
        return torch.round(x)
    return torch.floor(x + torch.rand(x.shape, generator=gen, dtype=x.dtype))


def _scale(amax: torch.Tensor, levels: int, mode: str) -> torch.Tensor:
    s = amax / levels
    if mode == "bf16up":
        bits = s.view(torch.int32)
        s = (((bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int32)) << 16).view(torch.float32)
    return s


def _groups(x: torch.Tensor, group: int) -> tuple:
    n = x.numel()
    pad = (-n) % group
    return torch.nn.functional.pad(x.reshape(-1), (0, pad)).view(-1, group), n


def quantise_m(m: torch.Tensor, kind: str, cfg: dict, gen) -> torch.Tensor:
    """m after an encode + decode of the given kind."""
    if kind == "fp32":
        return m
    g, n = _groups(m, cfg["group"])
    amax = g.abs().amax(dim=1, keepdim=True)
    if kind == "lin8":
        scale = _scale(amax, 127, cfg["scale"])
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = _round(g / safe, cfg["round"], gen).clamp(-127, 127)
        out = q * scale
    elif kind == "comp8":
        scale = _scale(amax, 1, cfg["scale"])
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        x = g / safe
        z = 2 * x / (1 + x.abs())
        q = _round(z * 127, cfg["round"], gen).clamp(-127, 127) / 127
        out = q / (2 - q.abs()) * scale
    else:
        raise ValueError(kind)
    return out.reshape(-1)[:n].view_as(m)


def quantise_v(v: torch.Tensor, kind: str, cfg: dict, gen) -> torch.Tensor:
    if kind == "fp32":
        return v
    s = v.sqrt()
    g, n = _groups(s, cfg["group"])
    amax = g.amax(dim=1, keepdim=True)
    if kind == "sqrt8":
        scale = _scale(amax, 255, cfg["scale"])
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = _round(g / safe, cfg["vround"] or cfg["round"], gen).clamp(0, 255)
        q = torch.where((g > 0) & (q < 1), torch.ones_like(q), q)
        t = q * scale
    else:
        raise ValueError(kind)
    return (t * t).reshape(-1)[:n].view_as(v)


def store_master(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The fp32 master after a store in the given format."""
    if kind == "fp32":
        return w
    if kind == "bf16":
        return w.to(torch.bfloat16).float()
    # host/compact.py's encode_master in int32 (finite weights; the reference is slow on 1M elements)
    bits_b = 7 if kind == "err8" else 15
    shift = 15 - bits_b
    hi_bits = w.to(torch.bfloat16).float().view(torch.int32)
    delta = w.view(torch.int32) - hi_bits
    if shift:
        delta = (delta + (2 ** (shift - 1) - 1) + ((delta >> shift) & 1)) >> shift
    err = delta.clamp(-(2**bits_b), 2**bits_b - 1)
    return (hi_bits + err * 2**shift).view(torch.float32)


class EmulatedStateAdamW(torch.optim.Optimizer):
    """AdamW whose state is stored (encoded and decoded) in an emulated format after each step."""

    def __init__(self, params, lr, betas, eps, weight_decay, cfg: dict, seed: int, backend=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.cfg = cfg
        self._backend = backend  # the kernel variants' host Adam (None: GraceAdam on one thread, made at step 1)
        self.gen = torch.Generator().manual_seed(1000 + seed)

    def _stepped(self):
        """(p, its state, lr, beta1, beta2, eps, weight_decay) of each parameter with a gradient,
        its step count advanced."""
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["step"] = st.get("step", 0) + 1
                yield p, st, lr, b1, b2, eps, wd

    @torch.no_grad()
    def step(self, closure=None):
        cfg = self.cfg
        if cfg["kernel"]:
            return self._kernel_step()
        for p, st, lr, b1, b2, eps, wd in self._stepped():
            if "master" not in st:
                st["master"] = p.float()
                st["m"] = torch.zeros_like(p, dtype=torch.float32)
                st["v"] = torch.zeros_like(p, dtype=torch.float32)
            t = st["step"]
            g = p.grad.float()
            m = st["m"].mul(b1).add_(g, alpha=1 - b1)
            v = st["v"].mul(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
            w = st["master"].mul(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - b1**t))
            st["master"] = store_master(w, cfg["master"])
            st["m"] = quantise_m(m, cfg["m"], cfg, self.gen)
            st["v"] = quantise_v(v, cfg["v"], cfg, self.gen)
            p.copy_(st["master"])  # bf16 device weight, round to nearest
        return None

    def _kernel_step(self):
        from superoffload_hf.host.kernel import get_host_adam

        if self._backend is None:
            self._backend = get_host_adam("cpp", threads=1)
        be, kind = self._backend, self.cfg["kernel"]
        for p, st, lr, b1, b2, eps, wd in self._stepped():
            n = p.numel()
            if "buf" not in st:
                w0, zeros = p.detach().float().reshape(-1).clone(), torch.zeros(n)
                if kind == "fp32":
                    st["buf"] = (w0, zeros, torch.zeros(n))
                else:
                    st["buf"] = compact.empty_state(n, kind)
                    be.compact_encode_(*st["buf"], w0, zeros, torch.zeros(n))
            hyper = dict(step=st["step"], lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, adamw=True)
            stepper = be.adam_step_ if kind == "fp32" else be.compact_step_
            stepper(*st["buf"], p.grad.reshape(-1).contiguous(), **hyper)
            p.copy_(st["buf"][0].view_as(p))  # fp32: rounded to nearest; compact: the master's bf16 part
        return None


def _trainer(cfg: dict, seed: int):
    from superoffload_hf import Trainer

    class _EmuTrainer(Trainer):
        def create_optimizer(self, model=None):
            if self.optimizer is None:
                groups = compact_quality.trainer_param_groups(self, self.model if model is None else model)
                self.optimizer = EmulatedStateAdamW(groups, lr=self.args.learning_rate, eps=self.args.adam_epsilon,
                                                    betas=(self.args.adam_beta1, self.args.adam_beta2),
                                                    weight_decay=self.args.weight_decay, cfg=cfg,
                                                    seed=seed)
            return self.optimizer

    return _EmuTrainer


def train_variant(name: str, seed: int, args) -> dict:
    from transformers import TrainerCallback, default_data_collator, set_seed
    import tempfile

    from superoffload_hf.train.run import build_model, build_tokenizer, build_training_arguments
    from superoffload_hf.train.data import build_dataset
    from superoffload_hf.train.recipe import load_recipe

    cfg = dict(BASE, **VARIANTS[name])
    losses = []

    class Record(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append((state.global_step, float(logs["loss"])))

    ns = argparse.Namespace(steps=args.steps, log_every=args.log_every, override=args.override)
    overrides = compact_quality.run_overrides(args.model, "bf16-rtn", seed, ns)
    with tempfile.TemporaryDirectory(prefix="compact_ablation_") as out:
        recipe = load_recipe(compact_quality.RECIPE, overrides + ["--training.output_dir", out])
        targs = build_training_arguments(recipe)
        set_seed(targs.seed)
        tok = build_tokenizer(recipe)
        model = build_model(recipe, tok)
        ds = build_dataset(recipe.data, tok)
        trainer = _trainer(cfg, seed)(model=model, args=targs, train_dataset=ds, data_collator=default_data_collator,
                                      processing_class=tok, callbacks=[Record()])
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    return {"cfg": cfg, "overrides": overrides, "steps": [s for s, _ in losses], "loss": [l for _, l in losses],
            "wall_s": round(wall, 1)}


def synthetic_tracking(names, n: int = 32 * 2000, steps: int = 1000, seed: int = 0) -> dict:
    """Moments alone, no model: a gradient stream g = sigma_i * decay(t) * (N(0, 1) + 0.3) with
    per-element scales sigma_i spread lognormally (so groups mix large and small elements) and a
    slow decay 1 / (1 + t/300), as a loss curve's gradients shrink. Each variant's m and v are
    encoded and decoded after every step; reported at some steps, against fp32 moments: the
    geometric mean of sqrt(v) / sqrt(v_fp32) and mean |m/sqrt(v)| / mean |m/sqrt(v)|_fp32."""
    torch.manual_seed(seed)
    sigma = torch.exp(torch.randn(n))
    b1, b2 = 0.9, 0.999
    out = {}
    for name in names:
        cfg = dict(BASE, **VARIANTS[name])
        gen, grads = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 2)
        m, v, mr, vr = (torch.zeros(n) for _ in range(4))
        rows = {}
        for t in range(1, steps + 1):
            g = sigma / (1 + t / 300) * (torch.randn(n, generator=grads) + 0.3)
            m, mr = m * b1 + (1 - b1) * g, mr * b1 + (1 - b1) * g
            v, vr = v * b2 + (1 - b2) * g * g, vr * b2 + (1 - b2) * g * g
            if t in (steps // 5, steps // 2, steps):
                rows[t] = {"sqrt_v_ratio": float((v.sqrt() / vr.sqrt()).log().mean().exp()),
                           "update_ratio": float((m / v.sqrt()).abs().mean() / (mr / vr.sqrt()).abs().mean())}
            m, v = quantise_m(m, cfg["m"], cfg, gen), quantise_v(v, cfg["v"], cfg, gen)
        out[name] = rows
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="fp32,compact")
    p.add_argument("--model", default="tiny-recipe", choices=list(compact_quality.MODELS))
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--final-window", type=int, default=50)
    p.add_argument("--override", action="append", default=[])
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "compact_ablation.json"))
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--synthetic", action="store_true", help="moments alone on a synthetic gradient stream (seconds)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    if args.synthetic:
        names = [v for v in args.variants.split(",") if v]
        print("| variant | cfg | " + " | ".join(f"step {t}: sqrt(v) / fp32, update / fp32" for t in
                                               (args.steps // 5, args.steps // 2, args.steps)) + " |")
        for name, rows in synthetic_tracking(names, steps=args.steps).items():
            print(f"| {name} | {VARIANTS[name]} | " + " | ".join(
                f"{r['sqrt_v_ratio']:.3f}, {r['update_ratio']:.3f}" for r in rows.values()) + " |")
        return 0
    path = Path(args.json)
    results = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    names = [v for v in args.variants.split(",") if v]
    seeds = [int(s) for s in args.seeds.split(",")]
    for seed in seeds:
        for name in names:
            key = f"{args.model}/{args.steps}/{name}/{seed}"
            ns = argparse.Namespace(steps=args.steps, log_every=args.log_every, override=args.override)
            want = compact_quality.run_overrides(args.model, "bf16-rtn", seed, ns)
            if results["runs"].get(key, {}).get("overrides") == want and results["runs"][key]["cfg"] == dict(BASE, **VARIANTS[name]):
                continue
            run = train_variant(name, seed, args)
            results["runs"][key] = run
            path.write_text(json.dumps(results, indent=1))
            print(f"{key}: final {compact_quality.final_loss(run, args.final_window):.4f} in {run['wall_s']:.0f} s",
                  flush=True)
    print(f"| variant | final loss per seed ({', '.join(map(str, seeds))}) | minus fp32, same seed |")
    for name in names:
        fin = [compact_quality.final_loss(results["runs"][f"{args.model}/{args.steps}/{name}/{s}"], args.final_window)
               for s in seeds]
        ref = [compact_quality.final_loss(results["runs"][f"{args.model}/{args.steps}/fp32/{s}"], args.final_window)
               for s in seeds] if "fp32" in names else fin
        print(f"| {name} | {' / '.join(f'{f:.4f}' for f in fin)} | "
              f"{' / '.join(f'{a - b:+.4f}' for a, b in zip(fin, ref))} (mean {statistics.fmean(fin) - statistics.fmean(ref):+.4f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
