"""End-to-end: one Llama, one batch, one sequence length and one step count for every contender,
each with clipping at 1.0 (the Hugging Face default) and with clipping off.

    python benchmarks/e2e.py --gpu --json e2e.json     # ~1B Llama, seq 2048, 16K tokens a step, H200: < 8 min
    python benchmarks/e2e.py --smoke                    # a tiny Llama on the CPU, seconds (the test-suite runs it)

Contenders (each when importable and able to run here; otherwise its row says why):

* ours: `SuperOffloadAdamW`, speculation "auto" and "off"; `max_grad_norm` goes to the optimizer
  (it clips inside step(); nobody calls clip_grad_norm_);
* torch AdamW (fused where supported) with everything on the device, bf16 autocast over fp32
  weights, `clip_grad_norm_` before the step (when it fits in device memory);
* torchao `CPUOffloadOptimizer` (fp32 state on the CPU; it takes gradients off the device during
  backward, so it cannot clip: its clipped row says so);
* DeepSpeed ZeRO-2 and ZeRO-3 with the optimizer offloaded to the CPU (DeepSpeedCPUAdam), bf16;
* DeepSpeed SuperOffload (ZeRO-3, `super_offload: true`, its documented example settings), which
  turns its overlap off whenever `gradient_clipping` is on.

Reported per row: tokens/s (median step), TFLOPS (6 x parameters x tokens/s), MFU (against
--peak-tflops, or the device's bf16 dense peak when known), peak device memory, peak host memory
(the process's resident set, sampled), the share of a step the device waited on the host (ours),
and the final loss. Models are built from `transformers.LlamaConfig` with one seed; the data is
the same random tokens for every contender.

Targets (checked with --gpu, or --check; a miss or an unmeasurable target exits 2; --no-check
only reports): ours clipping at 1.0 >= 1.5x DeepSpeed ZeRO-Offload (ZeRO-2, clipping at 1.0);
>= DeepSpeed SuperOffload with its clipping off; the device idle <= 15% of a step; >= 80% of
torch AdamW all on the device, at >= 16K tokens a step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

OURS_AUTO, OURS_OFF = "superoffload (speculation auto)", "superoffload (speculation off)"
TORCH_DEVICE, TORCHAO = "torch AdamW (all on device)", "torchao CPUOffloadOptimizer"
DS_Z2, DS_Z3, DS_SUPER = "DeepSpeed ZeRO-2 offload", "DeepSpeed ZeRO-3 offload", "DeepSpeed SuperOffload"
CONTENDERS = (OURS_AUTO, OURS_OFF, TORCH_DEVICE, TORCHAO, DS_Z2, DS_Z3, DS_SUPER)
KEYS = dict(zip(("ours-auto", "ours-off", "torch", "torchao", "ds-zero2", "ds-zero3", "ds-superoffload"), CONTENDERS))
"""Short names for --contenders."""
CLIPS = (1.0, None)  # None: clipping off
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0}
"""bf16 dense peak by device name (the first match in torch.cuda.get_device_name())."""
LR, WEIGHT_DECAY = 3e-4, 0.01
GIB = 2**30


class Unavailable(Exception):
    """The contender cannot run here; the message is the reason shown in its row."""


@dataclass
class Row:
    contender: str
    clip: Optional[float]
    status: str = "ok"  # ok | missing | failed
    reason: str = ""
    step_s: float = math.nan
    tokens_per_s: float = math.nan
    tflops: float = math.nan
    mfu: float = math.nan
    peak_device_gib: float = math.nan
    peak_host_gib: float = math.nan
    device_idle: float = math.nan
    final_loss: float = math.nan


# ---- arguments --------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="preset: ~1B Llama, seq 2048, batch 8, bf16 on cuda; checks the targets")
    p.add_argument("--smoke", action="store_true", help="preset: a tiny Llama on the CPU (seconds)")
    p.add_argument("--device", default=None)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (ours learns its plan in the first)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="compute dtype (default: bf16 on an accelerator, fp32 on the CPU)")
    p.add_argument("--contenders", default=",".join(KEYS), help=f"comma-separated subset of {', '.join(KEYS)}")
    p.add_argument("--peak-tflops", type=float, default=None, help="for MFU (default: the device's bf16 dense peak when known)")
    p.add_argument("--json", default=None, help="write the rows and the target checks here")
    p.add_argument("--check", action="store_true", help="check the targets (on by default with --gpu)")
    p.add_argument("--no-check", action="store_true", help="report only")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 64, 128, 2, 4, 2
        args.vocab, args.seq, args.batch, args.steps, args.warmup = 256, 32, 2, 2, 1
        args.device = args.device or "cpu"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    args.check = (args.check or args.gpu) and not args.no_check
    chosen = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in KEYS]
    if unknown:
        p.error(f"--contenders: unknown {unknown}; valid: {list(KEYS)}")
    args.contenders = [KEYS[c] for c in chosen]
    if args.device == "cpu":
        torch.set_num_threads(1)  # the model and the host Adam pool share the cores
    return args


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                         attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(args.device):
        return LlamaForCausalLM(config)  # fp32; each contender casts as its method does


def batches(args, count: int):
    g = torch.Generator().manual_seed(1234)
    for _ in range(count):
        yield torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)


def autocast(args):
    if args.dtype == "bf16":
        return torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16)
    return torch.autocast(device_type="cpu", enabled=False)


# ---- contenders: each returns (step(ids) -> loss tensor, idle_seconds() or None, close()) -------


def ours(args, model, clip, speculation):
    from superoffload_hf import SuperOffloadAdamW

    opt = SuperOffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=clip,
                            config={"device_dtype": args.dtype, "speculation": speculation})

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        opt.scale_loss(loss).backward()
        opt.step()  # clips (when max_grad_norm is set), validates, commits / replays / skips
        opt.zero_grad()
        return loss

    counters = opt.counters
    return step, lambda: counters.device_wait_seconds, _Closer(opt)


class _Closer:
    """Our optimizer's close(); then, once the mode's objects are dropped, what it left behind:
    the next contender must not run beside this one's arenas (no gc.collect(): dropping is enough)."""

    def __init__(self, opt):
        self._opt, self._ledger, self._optimizer_ref = opt, opt.ledger, weakref.ref(opt)

    def __call__(self) -> None:
        opt, self._opt = self._opt, None
        opt.close()

    def left_behind(self) -> str:
        if self._optimizer_ref() is not None:
            return "the optimizer is still alive"
        return f"{self._ledger.bytes()} bytes of buffers still held" if self._ledger.bytes() else ""


def torch_on_device(args, model, clip):
    kinds = ("fused", "foreach")
    for kind in kinds:
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **{kind: True})
            break
        except (RuntimeError, ValueError):
            continue

    def step(ids):
        with autocast(args):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, None, lambda: None


def torchao_offload(args, model, clip):
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as exc:
        raise Unavailable(f"torchao not importable ({exc})") from None
    if not args.device.startswith("cuda"):
        raise Unavailable("CPUOffloadOptimizer needs a CUDA device (it offloads to the CPU from one)")
    if clip is not None:
        raise Unavailable("cannot clip: its backward hooks move each gradient to the CPU and free p.grad")
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step(ids):
        with autocast(args):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, None, lambda: None


def deepspeed_offload(args, model, clip, stage, super_offload=False):
    try:
        import deepspeed
    except ImportError as exc:
        raise Unavailable(f"deepspeed not importable ({exc}); see benchmarks/README.md") from None
    if not args.device.startswith("cuda"):
        raise Unavailable("DeepSpeed's CPU offload is measured on an accelerator; this run is on the CPU")
    _single_process_env()
    offload = {"device": "cpu", "pin_memory": True}
    if super_offload:
        offload.update(ratio=0.90, super_offload=True, cpuadam_cores_perc=0.90)  # DeepSpeedExamples' settings
    config = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": args.dtype == "bf16"}, "gradient_clipping": clip if clip is not None else 0.0,
        "zero_optimization": {"stage": stage, "offload_optimizer": offload, "overlap_comm": True,
                              "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": [0.9, 0.999],
                                                  "eps": 1e-8}},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    def close():
        engine.destroy() if hasattr(engine, "destroy") else None

    return step, None, close


def _single_process_env() -> None:
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


SETUPS: dict[str, Callable] = {
    OURS_AUTO: lambda a, m, c: ours(a, m, c, "auto"),
    OURS_OFF: lambda a, m, c: ours(a, m, c, "off"),
    TORCH_DEVICE: torch_on_device,
    TORCHAO: torchao_offload,
    DS_Z2: lambda a, m, c: deepspeed_offload(a, m, c, stage=2),
    DS_Z3: lambda a, m, c: deepspeed_offload(a, m, c, stage=3),
    DS_SUPER: lambda a, m, c: deepspeed_offload(a, m, c, stage=3, super_offload=True),
}


# ---- measuring --------------------------------------------------------------------------------


class PeakRss:
    """Samples the process's resident set every few ms (the host memory a contender holds)."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.rss())

    def __enter__(self):
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def sync(args) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()  # timing only: a step is over when its device work is


def run(args, name: str, clip: Optional[float], params: int) -> Row:
    row = Row(name, clip)
    model = step = close = idle_seconds = None
    try:
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with PeakRss() as rss:
            model = build_model(args)
            step, idle_seconds, close = SETUPS[name](args, model, clip)
            times, idles, loss = [], [], None
            for i, ids in enumerate(batches(args, args.warmup + args.steps)):
                sync(args)
                start, idle_before = time.perf_counter(), idle_seconds() if idle_seconds else 0.0
                loss = step(ids)
                sync(args)
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
                    idles.append((idle_seconds() - idle_before) if idle_seconds else math.nan)
            row.final_loss = float(loss.detach().float())
        row.step_s = statistics.median(times)
        row.tokens_per_s = args.batch * args.seq / row.step_s
        row.tflops = 6 * params * row.tokens_per_s / 1e12
        peak = args.peak_tflops or _known_peak(args)
        row.mfu = row.tflops / peak if peak else math.nan
        row.peak_host_gib = rss.peak / GIB
        row.peak_device_gib = torch.cuda.max_memory_allocated() / GIB if args.device.startswith("cuda") else math.nan
        row.device_idle = statistics.median(d / t for d, t in zip(idles, times)) if idle_seconds else math.nan
    except Unavailable as exc:
        row.status, row.reason = "missing", str(exc)
    except torch.OutOfMemoryError as exc:
        row.status, row.reason = "missing", f"does not fit in device memory ({str(exc).splitlines()[0]})"
    except Exception as exc:  # a contender that crashes is a row that says so, not a lost table
        row.status, row.reason = "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        if close is not None:
            close()
        left_behind = getattr(close, "left_behind", None)
        del model, step, close, idle_seconds
        if left_behind is not None and left_behind():
            row.status, row.reason = "failed", f"after close() and del: {left_behind()}"
    return row


def _known_peak(args) -> Optional[float]:
    if not args.device.startswith("cuda") or args.dtype != "bf16":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


# ---- targets and the table ------------------------------------------------------------------------


def targets(args, rows: list[Row]) -> list[dict]:
    """Ratios the targets are stated in: (name, value, bound, kind, ok or None when not measurable)."""
    find = {(r.contender, r.clip): r for r in rows}
    ours_clip = find.get((OURS_AUTO, 1.0))

    def ratio(name, other, bound):
        a, b = ours_clip, find.get(other)
        ok_rows = a is not None and b is not None and a.status == "ok" and b.status == "ok"
        value = a.tokens_per_s / b.tokens_per_s if ok_rows else math.nan
        why = "" if ok_rows else f"not measured: {b.reason if b is not None and b.reason else 'row missing'}"
        return dict(target=name, value=value, bound=f">= {bound}", ok=(value >= bound) if ok_rows else None, why=why)

    out = [
        ratio("ours (clip 1.0) / DeepSpeed ZeRO-Offload (clip 1.0) tokens/s", (DS_Z2, 1.0), 1.5),
        ratio("ours (clip 1.0) / DeepSpeed SuperOffload (clip off) tokens/s", (DS_SUPER, None), 1.0),
        ratio("ours (clip 1.0) / torch AdamW all on device (clip 1.0) tokens/s", (TORCH_DEVICE, 1.0), 0.8),
    ]
    idle = ours_clip.device_idle if ours_clip is not None and ours_clip.status == "ok" else math.nan
    out.append(dict(target="ours (clip 1.0) device idle share of a step", value=idle, bound="<= 0.15",
                    ok=(idle <= 0.15) if not math.isnan(idle) else None, why=""))
    tokens = args.batch * args.seq
    out.append(dict(target="tokens per step", value=float(tokens), bound=">= 16384", ok=tokens >= 16384, why=""))
    return out


def markdown(args, params: int, rows: list[Row], checks: list[dict]) -> str:
    head = (f"# e2e: {params / 1e6:.1f}M-parameter Llama ({args.layers} layers, hidden {args.hidden}), "
            f"seq {args.seq} x batch {args.batch} = {args.seq * args.batch:,} tokens a step, {args.dtype} on "
            f"{args.device}, {args.steps} measured steps after {args.warmup}")
    lines = [head, "", "| contender | clip | tokens/s | TFLOPS | MFU | peak device GiB | peak host GiB | "
             "device idle | final loss | note |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        clip = "1.0" if r.clip is not None else "off"
        if r.status != "ok":
            lines.append(f"| {r.contender} | {clip} | - | - | - | - | - | - | - | {r.status}: {r.reason} |")
            continue
        lines.append(f"| {r.contender} | {clip} | {r.tokens_per_s:,.0f} | {_f(r.tflops, '.3g')} | {_pct(r.mfu)} | "
                     f"{_f(r.peak_device_gib, '.2f')} | {_f(r.peak_host_gib, '.2f')} | {_pct(r.device_idle)} | "
                     f"{r.final_loss:.4f} | |")
    lines += ["", "| target | value | bound | result |", "|---|---:|---|---|"]
    for c in checks:
        result = {True: "met", False: "MISSED", None: f"unmeasured ({c['why']})"}[c["ok"]]
        lines.append(f"| {c['target']} | {_f(c['value'], '.3g')} | {c['bound']} | {result} |")
    return "\n".join(lines)


def _f(x: float, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1%}"


def main(argv=None) -> int:
    args = parse_args(argv)
    params = sum(p.numel() for p in build_model(argparse.Namespace(**{**vars(args), "device": "meta"})).parameters())
    rows = [run(args, name, clip, params) for clip in CLIPS for name in args.contenders]
    checks = targets(args, rows)
    text = markdown(args, params, rows, checks)
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "params": params, "rows": [asdict(r) for r in rows], "targets": checks},
                      f, indent=1, default=str)
    failed = [r for r in rows if r.status == "failed"]
    for r in failed:
        print(f"FAIL: {r.contender} (clip {r.clip}) crashed: {r.reason}", file=sys.stderr)
    if any(r.contender in (OURS_AUTO, OURS_OFF) and r.status != "ok" for r in rows):
        return 1  # our own rows must always run
    if args.check:
        missed = [c for c in checks if c["ok"] is not True]
        for c in missed:
            print(f"TARGET {'MISSED' if c['ok'] is False else 'UNMEASURED'}: {c['target']} = {_f(c['value'], '.3g')} "
                  f"(want {c['bound']}) {c['why']}", file=sys.stderr)
        if missed:
            return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
