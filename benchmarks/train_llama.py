"""End-to-end training benchmark: a randomly initialised Llama-style model, SuperOffloadAdamW,
speculation on and off, the same data for both.

    python benchmarks/train_llama.py --out results/          # ~1B Llama on CUDA, bf16
    python benchmarks/train_llama.py --tiny --out /tmp/r     # a CPU smoke check (seconds)

Clipping is on (--max-grad-norm) but high by default: a randomly initialised model's gradient
norm stays above 1.0, and the engine would then see after the first bucket of every step that the
step must be clipped and not speculate at all, so "on" and "off" would time the same thing; a
high threshold times the steady state of training (clipping checked, rarely triggered). Run with
--max-grad-norm 1.0 to time the always-clipping regime.

`--max-grad-norm` takes a comma-separated list (gpu_check.sh runs 1.0, Hugging Face's default,
and 1e3); every speculation mode runs at every threshold.

Reports per mode: step time (median of the measured steps), tokens/s, peak device memory, peak
host resident memory, the device's idle time per step (measured with device events:
`counters.device_wait_seconds`), the training thread's blocking waits, the cost model's predicted
step time, and the optimizer's counters; writes results.json and results.md to --out when each
mode ends (a later mode that is refused, fails or is killed keeps the earlier modes' results). A
mode that raises is recorded with its error and the next mode runs. Exits non-zero when a mode
failed, a loss is not finite or the modes' losses disagree by more than --loss-rtol (speculation
must not change what is learned).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch

H200_BF16_TFLOPS = 989.0  # NVIDIA's H200 bf16 dense peak (no sparsity), the MFU denominator
PEAK_TFLOPS = {"H200": H200_BF16_TFLOPS, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json and results.md")
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke check)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available, cpu with --tiny)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="measured steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps (the first one learns the plan)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--speculation", default="on,off", help="comma-separated modes to run")
    p.add_argument("--device-buckets", default="auto")
    p.add_argument("--bucket-mb", default="auto")
    p.add_argument("--cast", default="auto", choices=["auto", "device", "host"])
    p.add_argument("--rollback", default="inverse", choices=["inverse", "snapshot"])
    p.add_argument("--host-kernel", default="auto", choices=["auto", "cpp", "reference"],
                   help="the host Adam (config `host_kernel`; cpp: GraceAdam or an error, never the reference)")
    p.add_argument("--host-memory-budget", default=None,
                   help="config `host_memory_budget` (e.g. 100GB): the host memory this process may use")
    p.add_argument("--max-grad-norm", default="1e3", help="comma-separated clipping thresholds to run")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--loss-rtol", type=float, default=2e-2)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help=f"for MFU (default: the bf16 dense peak of a known CUDA device, e.g. H200 {H200_BF16_TFLOPS:g})")
    p.add_argument("--timeline-dir", default=None,
                   help="write the first mode's step timeline (trace.json, timeline.png with matplotlib) here")
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 64, 128, 2, 4, 2
        args.vocab, args.seq, args.batch = 256, 32, 2
        args.device = args.device or "cpu"
        args.dtype = "fp32" if args.device == "cpu" and args.dtype == "bf16" else args.dtype
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cpu":
        torch.set_num_threads(1)  # the model and the host Adam pool share the cores: don't oversubscribe
    return args


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config)  # fp32: the optimizer keeps these as masters, casts the model
    return model


def batches(args, count: int):
    g = torch.Generator().manual_seed(1234)
    for _ in range(count):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        yield ids.to(args.device)


def sync(args) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()  # benchmark timing only: measure finished work


def peak_tflops(args) -> float:
    """The bf16 dense peak MFU is measured against: --peak-tflops, else the known CUDA device's."""
    if args.peak_tflops:
        return args.peak_tflops
    if not args.device.startswith("cuda") or args.dtype != "bf16":
        return math.nan
    name = torch.cuda.get_device_name()
    return next((v for k, v in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), math.nan)


def predicted_gib(opt) -> dict:
    """The dry run's figures (plan/memory.py footprint: the arithmetic that sized the buffers)
    by place: device state (activations and the model's own gradients not included) and host."""
    rows = opt._engine.footprint()
    by_place = {place: sum(r.nbytes for r in rows if r.place == place) / 2**30 for place in ("device", "pinned", "host")}
    return {"predicted_device_state_gib": by_place["device"],
            "predicted_host_gib": by_place["pinned"] + by_place["host"], "predicted_pinned_gib": by_place["pinned"]}


def _warm_matplotlib() -> None:
    """Draw once before the first mode: matplotlib's first savefig imports its backend, and that
    import keeps the frames it ran under, which would keep the mode's optimizer alive after its
    close() (the timeline is drawn there) and fail the left-behind check below."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    fig.savefig(io.BytesIO(), format="png")
    plt.close(fig)


def run_mode(args, speculation: str, max_grad_norm: float, timeline_dir=None) -> dict:
    from superoffload_hf import SuperOffloadAdamW

    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    config = {"device_dtype": args.dtype, "speculation": speculation, "rollback": args.rollback,
              "cast": args.cast, "host_kernel": args.host_kernel, "host_memory_budget": args.host_memory_budget, "device_buckets": _auto_or_int(args.device_buckets),
              "bucket_size_mb": _auto_or_float(args.bucket_mb)}
    if timeline_dir is not None:
        config.update(timeline_dir=str(timeline_dir), timeline_steps=(args.warmup, args.warmup + 1))
    opt = SuperOffloadAdamW(model.parameters(), lr=args.lr, max_grad_norm=max_grad_norm, config=config)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    losses, norms, times, waits, thread_waits = [], [], [], [], []
    with opt:
        for step, ids in enumerate(batches(args, args.warmup + args.steps)):
            sync(args)
            start, wait_before = time.perf_counter(), opt.counters.device_wait_seconds
            thread_before = opt.counters.thread_wait_seconds
            loss = model(input_ids=ids, labels=ids).loss
            opt.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))  # a host sync: after step(), so it does not hide overlap
            norms.append(opt.last_grad_norm)
            sync(args)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
                waits.append(opt.counters.device_wait_seconds - wait_before)
                thread_waits.append(opt.counters.thread_wait_seconds - thread_before)
        result = {
            "speculation": speculation,
            "max_grad_norm": max_grad_norm,
            "thread_wait_seconds_per_step": statistics.mean(thread_waits),
            "predicted_step_seconds": opt.counters.predicted_step_seconds,
            "peak_host_rss_gib": _peak_rss_gib(),
            "params": n_params,
            "step_seconds": statistics.median(times),
            "tokens_per_second": args.batch * args.seq / statistics.median(times),
            # MFU = 6 x parameters x tokens/s / the bf16 dense peak (peak_tflops; NaN when unknown)
            "peak_tflops": peak_tflops(args),
            "mfu": 6 * n_params * args.batch * args.seq / statistics.median(times) / (peak_tflops(args) * 1e12),
            **predicted_gib(opt),
            "device_wait_seconds_per_step": statistics.mean(waits),
            "peak_device_memory_gib": _peak_gib(args),
            "losses": losses,
            "grad_norms": norms,  # before clipping: above --max-grad-norm means a clipped step
            "counters": opt.counters.as_dict(),
            "buckets": len(opt.plan.buckets),
            "device_buckets": opt.plan.num_device_buckets,
            "summary": opt.summary(),
            "host_adam": opt._engine.adam.describe(),
        }
    ledger, optimizer_ref = opt.ledger, weakref.ref(opt)
    del opt, model
    # the next mode must not run beside this one's arenas (no gc.collect(): dropping is enough)
    result["left_behind"] = ("the optimizer is still alive" if optimizer_ref() is not None
                             else f"{ledger.bytes()} bytes of buffers still held" if ledger.bytes() else "")
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def check(results: list[dict], rtol: float) -> list[str]:
    problems = []
    for r in results:
        if not all(math.isfinite(x) for x in r["losses"]):
            problems.append(f"speculation {r['speculation']}: non-finite loss in {r['losses']}")
        unclipped = any(n <= r["max_grad_norm"] for n in r["grad_norms"][1:])
        if r["speculation"] == "on" and unclipped and r["counters"]["speculative_steps"] == 0:
            problems.append("speculation on: steps below --max-grad-norm, yet no step was speculative")
    for r in results:
        if r["left_behind"]:
            problems.append(f"speculation {r['speculation']}: after close() and del, {r['left_behind']}")
    for threshold in sorted({r["max_grad_norm"] for r in results}):
        problems += _same_losses([r for r in results if r["max_grad_norm"] == threshold], rtol)
    return problems


def _same_losses(results: list[dict], rtol: float) -> list[str]:
    problems = []
    for r in results[1:]:
        for step, (a, b) in enumerate(zip(results[0]["losses"], r["losses"])):
            if abs(a - b) > rtol * abs(b):
                problems.append(f"step {step}: loss {a} (speculation {results[0]['speculation']}) vs "
                                f"{b} (speculation {r['speculation']}) differ by more than rtol {rtol}")
    return problems


def markdown(args, results: list[dict]) -> str:
    head = (f"{results[0]['params'] / 1e9:.2f}B-parameter Llama, {args.layers} layers, hidden {args.hidden}, "
            f"seq {args.seq} x batch {args.batch}, {args.dtype} on {args.device}")
    rows = ["| speculation | max_grad_norm | step (s) | predicted (s) | tokens/s | MFU | peak device GiB "
            "(dry run: state) | peak host RSS GiB (dry run) | device idle/step (s) | thread wait/step (s) | "
            "spec. steps | rollbacks | replays | skips | buckets (device) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r["counters"]
        rows.append(f"| {r['speculation']} | {r['max_grad_norm']:g} | {r['step_seconds']:.3f} | "
                    f"{r['predicted_step_seconds']:.3f} | {r['tokens_per_second']:.0f} | {_pct(r['mfu'])} | "
                    f"{r['peak_device_memory_gib']:.2f} ({r['predicted_device_state_gib']:.3f}) | "
                    f"{r['peak_host_rss_gib']:.2f} ({r['predicted_host_gib']:.3f}) | "
                    f"{r['device_wait_seconds_per_step']:.3f} | {r['thread_wait_seconds_per_step']:.3f} | "
                    f"{c['speculative_steps']} | {c['rollbacks']} | {c['replays']} | {c['skips']} | "
                    f"{r['buckets']} ({r['device_buckets']}) |")
    mfu = f"MFU = 6 x parameters x tokens/s / {results[0]['peak_tflops']:g} TFLOPS (bf16 dense peak)"
    return "\n".join([f"# train_llama: {head}", "", *rows, "", mfu, "", f"`{results[0]['summary']}`", ""])


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    thresholds = [float(x) for x in str(args.max_grad_norm).split(",")]
    runs = [(mode.strip(), threshold) for threshold in thresholds for mode in args.speculation.split(",")]
    results, failures = [], []
    if args.timeline_dir is not None:
        _warm_matplotlib()
    for i, (mode, threshold) in enumerate(runs):
        try:
            results.append(run_mode(args, mode, threshold, args.timeline_dir if i == 0 else None))
        except Exception as exc:  # a refused or failed mode is a result too; the next mode still runs
            failures.append({"speculation": mode, "max_grad_norm": threshold,
                             "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})
            print(f"FAIL: speculation {mode}, max_grad_norm {threshold:g}: {failures[-1]['error']}", flush=True)
        else:
            print(f"train_llama: speculation {mode}, max_grad_norm {threshold:g}: "
                  f"{results[-1]['tokens_per_second']:.0f} tokens/s", flush=True)
        write_results(out, args, results, failures, runs[i + 1:])
    problems = write_results(out, args, results, failures, [])
    if results:
        print(markdown(args, results))
    for problem in problems[len(failures):]:  # (each failed mode printed its FAIL line when it failed)
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


def write_results(out: Path, args, results: list[dict], failures: list[dict], pending: list) -> list[str]:
    """results.json and results.md as they stand (rewritten after every mode); the problems."""
    problems = [f"speculation {f['speculation']}, max_grad_norm {f['max_grad_norm']:g} failed: {f['error']}"
                for f in failures] + check(results, args.loss_rtol)
    pending = [{"speculation": m, "max_grad_norm": t} for m, t in pending]
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results, "failures": failures,
                                                  "pending": pending, "problems": problems}, indent=2))
    text = markdown(args, results) if results else "# train_llama: no mode finished"
    text += "".join(f"\nFAIL: {p}" for p in problems)
    text += "".join(f"\nnot run yet: speculation {p['speculation']}, max_grad_norm {p['max_grad_norm']:g}"
                    for p in pending)
    (out / "results.md").write_text(text + "\n")
    return problems


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1%}"


def _peak_gib(args) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else 0.0


def _peak_rss_gib() -> float:
    """The process's peak resident memory (the host state is in it), from /proc (Linux)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    return 0.0


def _auto_or_int(value: str):
    return value if value == "auto" else int(value)


def _auto_or_float(value: str):
    return value if value == "auto" else float(value)


if __name__ == "__main__":
    sys.exit(main())
