"""Host Adam benchmark: our kernel against torch AdamW, DeepSpeed CPU Adam and a roofline.

    python benchmarks/adam.py                       # 64M and 8M (one 32 MB bucket) parameters
    python benchmarks/adam.py --sizes 64M --reps 11 --threads 2 --json adam.json

Every contender does the same work on the same buffers: one AdamW step on fp32 master weights
and moments with an fp32 gradient, plus the bf16 copy of the updated weights (ours fuses the
copy into the step; the others run `param_lowp.copy_(param)` after it). The roofline is a
kernel with the same access pattern and no arithmetic to speak of (benchmarks/roofline.cpp):
what memory bandwidth allows. GB/s counts the bytes the work must move once, 30 per parameter
with an fp32 gradient (read p, g, m, v: 16; write p, m, v: 12, and the bf16 copy: 2), 28 with a
bf16 gradient, whatever a contender moves in fact (the unfused ones move p twice).

Before timing, each contender takes one step on fresh buffers and is checked against the float64
reference (superoffload_hf.host.reference) element by element, and its bf16 copy against its own
fp32 result bit for bit. Contenders are then interleaved (a rotating order per repetition)
and medians are reported.

Two more tables follow (our kernel's ISA is printed in every row):

* interleaved with a torch op: our step timed alone, and timed right after a large `torch.add` on
  other tensors (torch's intra-op pool, which the engine's main thread uses for its own work).
  torch's OpenMP workers (libgomp) keep spinning for a few ms after each parallel region and take
  cores from our threads; the target is that our step keeps >= 90% of its isolated speed there.
  Our pool hands out small chunks from a shared counter, so a thread that gets its core late does
  less of the work. The spinning itself stops only from outside, before torch starts: run with
  OMP_WAIT_POLICY=PASSIVE (or GOMP_SPINCOUNT=0), or with torch at one thread (`accelerate launch`
  sets OMP_NUM_THREADS=1: no OpenMP workers, nothing spins). The header prints these settings.
* gradient accumulation: `grad_accumulate_` (dst fp32 += bf16 src on our pool) against torch's
  `dst.add_(src)`, at one thread and at --threads, after checking both agree bit for bit.

The compact host state (issue 17, superoffload_hf/host/compact.py) gets its own table, timed in
the same interleaved rounds as the rows above: `compact_step_` with an fp32 and a bf16 gradient
(and compact32 with a bf16 gradient) beside our fp32 step with the same gradient at the same
thread count. Bytes moved per parameter: read hi 2 + err 1 (2) + m 1 + sqrt(v) 1 + scales 4/32,
write the same, plus the gradient (4 or 2): 14.25 B (fp32 grad) / 12.25 B (bf16 grad), compact32
2 B more. Its own roofline is those bytes at the bandwidth the roofline row measures (30 B per
parameter in the roofline's time). Targets: >= 1.8x our fp32 step, >= 85% of its own roofline.
Before timing, each compact contender's step is checked bit for bit against host/compact.py.

Exit status: 0 when everything is correct and the targets are met; 1 when a contender computes
a wrong result or our kernel is the PyTorch reference fallback (unless --allow-reference);
2 when a performance target is missed at the largest size (--target-sizes to choose, --no-targets
to only report).
Run it in a virtual environment with deepspeed installed to get the DeepSpeed row
(see benchmarks/README.md); without deepspeed the row is skipped with the reason printed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from superoffload_hf.host import compact, reference  # noqa: E402
from superoffload_hf.host.kernel import get_host_adam  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
FIRST_STEP = 5  # checks run step 5 from a non-zero state, so bias correction is exercised
CHECK_ULPS = 4  # fp32 vs the float64 reference: a few roundings of the magnitudes combined
# DeepSpeed derives its bias corrections in fp32 (1 - beta2**t loses digits for small t): at step 5
# its parameter update is up to ~3e-6 off, relative to the update (a 0.1% error in lr is 1e-3).
DEEPSPEED_UPDATE_RTOL = 1e-5
CHECK_SIZE = (1 << 20) + 37  # odd tail: no contender gets a size that is a multiple of its vector width
# Between timed calls the main thread spins this long: OpenMP workers (torch, DeepSpeed, the
# roofline) busy-wait a few ms after a parallel region, and the next contender must not share the
# cores with them. Spinning rather than sleeping keeps this CPU awake (a VM's idle vCPU is slow to wake).
PAUSE_S = 0.025
BYTES_READ_FP32_GRAD = 16  # p, g, m, v (fp32)
BYTES_WRITTEN = 14  # p, m, v (fp32) + the bf16 copy
TORCH_BASELINE = "torch AdamW fused + copy"
ROOFLINE = "roofline (same traffic, no math)"
TARGET_PCT_ROOFLINE = 90.0
TARGET_VS_TORCH = 1.15
TARGET_VS_DEEPSPEED = 1.25
OURS = "ours (fused bf16 copy)"
OURS_BF16_GRAD = "ours, bf16 grad"
DEEPSPEED = "DeepSpeedCPUAdam + copy"
TARGET_PCT_OF_ISOLATED = 90.0  # our step right after a torch op, vs alone
TORCH_OP_ELEMENTS = 1 << 24  # the torch op before each interleaved step: c = a + b over 64 MB each
TARGET_COMPACT_VS_FP32 = 1.8
TARGET_COMPACT_PCT_OWN_ROOFLINE = 85.0


# ---- buffers ---------------------------------------------------------------------------------


@dataclass
class Buffers:
    """One flat set of host Adam buffers, shared by every contender of a size."""

    param_fp32: torch.Tensor
    exp_avg_fp32: torch.Tensor
    exp_avg_sq_fp32: torch.Tensor
    grad_fp32: torch.Tensor
    grad_bf16: torch.Tensor
    param_bf16: torch.Tensor


def make_buffers(n: int, seed: int) -> Buffers:
    gen = torch.Generator().manual_seed(seed)
    grad_fp32 = torch.randn(n, generator=gen).mul_(1e-2)
    return Buffers(
        param_fp32=torch.randn(n, generator=gen),
        exp_avg_fp32=torch.randn(n, generator=gen).mul_(1e-2),
        exp_avg_sq_fp32=torch.rand(n, generator=gen).mul_(1e-4).add_(1e-6),
        grad_fp32=grad_fp32,
        # grad_bf16 is exactly grad_fp32 rounded, so both gradients describe the same step.
        grad_bf16=grad_fp32.to(torch.bfloat16),
        param_bf16=torch.zeros(n, dtype=torch.bfloat16),
    )


def bytes_per_param(grad_dtype: torch.dtype) -> int:
    return BYTES_READ_FP32_GRAD - 4 + grad_dtype.itemsize + BYTES_WRITTEN


# ---- contenders: each builds a step function on a Buffers -------------------------------------


@dataclass
class Contender:
    name: str
    grad_dtype: torch.dtype
    build: Callable[[Buffers], Callable[[], None]]
    is_roofline: bool = False
    # DeepSpeed rounds beta1/beta2 to fp32 before computing 1 - beta (1 - 0.999f is 1.3e-5 below
    # 0.001): its reference step uses the fp32-rounded betas, everything else in float64.
    betas_fp32: bool = False
    update_rtol: float = 0.0  # extra tolerance on param, relative to the size of the update
    compact: Optional[str] = None  # the state precision of a compact contender ("compact", "compact32")

    @property
    def bytes_per_param(self) -> float:
        if self.compact is None:
            return bytes_per_param(self.grad_dtype)
        return compact_bytes_per_param(self.compact, self.grad_dtype)


def compact_bytes_per_param(precision: str, grad_dtype: torch.dtype) -> float:
    """Bytes one compact step must move per parameter: the stored state read and written once,
    and the gradient read."""
    return 2 * compact.spec_of(precision).bytes_per_param + grad_dtype.itemsize


def ours(adam, grad_dtype: torch.dtype) -> Callable[[Buffers], Callable[[], None]]:
    def build(b: Buffers) -> Callable[[], None]:
        grad = b.grad_fp32 if grad_dtype == torch.float32 else b.grad_bf16
        counter = iter(range(FIRST_STEP, 1 << 62))

        def step() -> None:
            adam.adam_step_(b.param_fp32, b.exp_avg_fp32, b.exp_avg_sq_fp32, grad, step=next(counter),
                            adamw=True, param_lowp=b.param_bf16, **HYPER)

        return step

    return build


def ours_compact(adam, precision: str, grad_dtype: torch.dtype) -> Callable[[Buffers], Callable[[], None]]:
    """Our compact step on compact buffers encoded from `b`'s fp32 state (its own copy)."""
    def build(b: Buffers) -> Callable[[], None]:
        state = compact.empty_state(b.param_fp32.numel(), precision)
        adam.compact_encode_(*state, b.param_fp32, b.exp_avg_fp32, b.exp_avg_sq_fp32)
        grad = b.grad_fp32 if grad_dtype == torch.float32 else b.grad_bf16
        counter = iter(range(FIRST_STEP, 1 << 62))

        def step() -> None:
            adam.compact_step_(*state, grad, step=next(counter), adamw=True, **HYPER)

        step.state = state  # for the correctness check
        return step

    return build


def parameter_with_state(b: Buffers, step_state) -> tuple[torch.nn.Parameter, dict]:
    """A Parameter sharing `b`'s storage, its gradient, and optimizer state holding `b`'s moments."""
    param = torch.nn.Parameter(b.param_fp32, requires_grad=True)
    param.grad = b.grad_fp32
    return param, {"step": step_state, "exp_avg": b.exp_avg_fp32, "exp_avg_sq": b.exp_avg_sq_fp32}


def torch_adamw(**impl) -> Callable[[Buffers], Callable[[], None]]:
    def build(b: Buffers) -> Callable[[], None]:
        # The state is injected so the step starts from `b`'s moments at step FIRST_STEP.
        param, state = parameter_with_state(b, torch.tensor(float(FIRST_STEP - 1)))
        opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], **impl)
        opt.state[param] = state

        def step() -> None:
            opt.step()
            b.param_bf16.copy_(b.param_fp32)

        return step

    return build


def deepspeed_adam(cpu_adam_cls) -> Callable[[Buffers], Callable[[], None]]:
    def build(b: Buffers) -> Callable[[], None]:
        param, state = parameter_with_state(b, FIRST_STEP - 1)
        opt = cpu_adam_cls([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                           weight_decay=HYPER["weight_decay"], adamw_mode=True, bias_correction=True)
        opt.state[param] = state

        def step() -> None:
            opt.step()
            b.param_bf16.copy_(b.param_fp32)

        return step

    return build


def roofline(ext, threads: int, streaming: bool) -> Callable[[Buffers], Callable[[], None]]:
    def build(b: Buffers) -> Callable[[], None]:
        def step() -> None:
            ext.traffic(b.param_fp32, b.exp_avg_fp32, b.exp_avg_sq_fp32, b.grad_fp32, b.param_bf16,
                        threads, streaming)

        return step

    return build


# ---- building the optional contenders ----------------------------------------------------------


def cache_dir() -> Path:
    root = os.environ.get("SUPEROFFLOAD_CACHE_DIR") or Path.home() / ".cache" / "superoffload_hf"
    path = Path(root) / "bench_roofline"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_roofline():
    from torch.utils.cpp_extension import load

    arch = "-mcpu=native" if platform.machine() in ("aarch64", "arm64") else "-march=native"
    return load(name="superoffload_bench_roofline", sources=[str(Path(__file__).with_name("roofline.cpp"))],
                extra_cflags=["-O3", arch, "-fopenmp", "-ffp-contract=off"], extra_ldflags=["-fopenmp"],
                build_directory=str(cache_dir()), verbose=False)


def load_deepspeed() -> tuple[Optional[type], str]:
    """DeepSpeedCPUAdam, or None and the reason it is unavailable."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed looks for a GPU accelerator
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])  # JIT-builds its C++ op on first use
    except Exception as exc:  # ImportError, or the op failing to build
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return DeepSpeedCPUAdam, ""


def load_ours(threads: int, allow_reference: bool, isa: Optional[str] = None):
    mode = "auto" if allow_reference else "cpp"
    try:
        adam = get_host_adam(mode, threads=threads, isa=isa)
    except Exception as exc:  # the kernel build failing: say so in one line, exit 1
        sys.exit(f"FAIL: get_host_adam({mode!r}) raised {type(exc).__name__}: {exc}\n"
                 "Fix the kernel build, or pass --allow-reference to time the reference.")
    if adam.name != "cpp" and not allow_reference:
        sys.exit(f"FAIL: get_host_adam('cpp') returned the {adam.name!r} back end, not the C++ kernel; "
                 "fix the kernel build, or pass --allow-reference to time the reference.")
    adam.set_num_threads(threads)
    return adam


def contenders(args, adam, ext, ds_cls) -> list[Contender]:
    tag = "" if adam.name == "cpp" else f" [{adam.name} FALLBACK]"
    out = [
        Contender(OURS + tag, torch.float32, ours(adam, torch.float32)),
        Contender(OURS_BF16_GRAD + tag, torch.bfloat16, ours(adam, torch.bfloat16)),
        Contender(f"ours compact{tag}", torch.float32, ours_compact(adam, "compact", torch.float32),
                  compact="compact"),
        Contender(f"ours compact, bf16 grad{tag}", torch.bfloat16, ours_compact(adam, "compact", torch.bfloat16),
                  compact="compact"),
        Contender(f"ours compact32, bf16 grad{tag}", torch.bfloat16, ours_compact(adam, "compact32", torch.bfloat16),
                  compact="compact32"),
        Contender(TORCH_BASELINE, torch.float32, torch_adamw(fused=True)),
        Contender("torch AdamW foreach + copy", torch.float32, torch_adamw(foreach=True)),
    ]
    if args.single_tensor:
        out.append(Contender("torch AdamW for-loop + copy", torch.float32, torch_adamw(foreach=False)))
    if ds_cls is not None:
        out.append(Contender(DEEPSPEED, torch.float32, deepspeed_adam(ds_cls), betas_fp32=True,
                             update_rtol=DEEPSPEED_UPDATE_RTOL))
    out.append(Contender(ROOFLINE, torch.float32, roofline(ext, args.threads, False), is_roofline=True))
    if ext.has_streaming():
        out.append(Contender("roofline, streaming bf16 store", torch.float32, roofline(ext, args.threads, True),
                             is_roofline=True))
    return out


# ---- correctness ------------------------------------------------------------------------------


def expected_adam(b: Buffers, c: Contender) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The float64 reference step from `b`: per state tensor, (result, allowed |error|): CHECK_ULPS
    fp32 ulp of the magnitude the update combines (cancellation can make the result smaller)."""
    p0, m0, v0 = (t.to(torch.float64) for t in (b.param_fp32, b.exp_avg_fp32, b.exp_avg_sq_fp32))
    g = (b.grad_fp32 if c.grad_dtype == torch.float32 else b.grad_bf16).to(torch.float64)
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    hyper = dict(HYPER)
    if c.betas_fp32:
        hyper.update({k: float(torch.tensor(hyper[k], dtype=torch.float32)) for k in ("beta1", "beta2")})
    reference.adam_step_(p, m, v, g, step=FIRST_STEP, adamw=True, **hyper)
    b1, b2 = hyper["beta1"], hyper["beta2"]
    bound = lambda magnitude: CHECK_ULPS * ulp_fp32(magnitude) * (magnitude > 0)  # noqa: E731
    return {"param": (p, bound(p0.abs() + (p - p0).abs()) + c.update_rtol * (p - p0).abs()),
            "exp_avg": (m, bound(b1 * m0.abs() + (1 - b1) * g.abs())),
            "exp_avg_sq": (v, bound(b2 * v0 + (1 - b2) * g * g))}


def expected_roofline(b: Buffers) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The roofline's results, exact (kTiny in roofline.cpp is 2**-20: g*tiny is exact)."""
    tiny, g = 2.0**-20, b.grad_fp32
    exact = lambda t: (t.to(torch.float64), torch.zeros_like(t, dtype=torch.float64))  # noqa: E731
    return {"param": exact(b.param_fp32 + g * tiny), "exp_avg": exact(b.exp_avg_fp32 + g * tiny),
            "exp_avg_sq": exact(b.exp_avg_sq_fp32 + (g * g) * tiny)}


def ulp_fp32(x: torch.Tensor) -> torch.Tensor:
    """The fp32 ulp of magnitudes `x` (float64): 2**(floor(log2 x) - 23), at least 2**-149."""
    _, exponent = torch.frexp(x.clamp(min=2.0**-126))
    return torch.ldexp(torch.ones_like(x), exponent - 24)


def mismatch(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> Optional[str]:
    """None when every |got - want| <= bound (element by element)."""
    error = (got.to(torch.float64) - want).abs()
    bad = ~(error <= bound)  # NaN counts as bad
    if not bool(bad.any()):
        return None
    i = int(torch.argmax(torch.where(bad, error / bound.clamp(min=2.0**-149), 0.0).nan_to_num(float("inf"))))
    return (f"{name}: {int(bad.sum())} of {got.numel()} elements off by more than the bound; "
            f"worst at [{i}]: got {float(got[i])!r}, expected {float(want[i])!r}, bound {float(bound[i]):.3g}")


def bf16_truncate(x: torch.Tensor) -> torch.Tensor:
    return (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def check_compact_contender(c: Contender, seed: int) -> Optional[str]:
    """One compact step on fresh buffers, bit for bit against host/compact.py's reference."""
    b = make_buffers(CHECK_SIZE, seed)
    step = c.build(b)
    want = [t.clone() for t in step.state]
    grad = b.grad_fp32 if c.grad_dtype == torch.float32 else b.grad_bf16
    compact.compact_step_(*want, grad, step=FIRST_STEP, adamw=True, **HYPER)
    step()
    names = ("master_bf16", "master_err", "exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale")
    bad = [name for name, got, ref in zip(names, step.state, want)
           if not torch.equal(got.view(torch.uint8), ref.view(torch.uint8))]
    return None if not bad else f"{', '.join(bad)} differ from host/compact.py's compact_step_"


def check_contender(c: Contender, seed: int) -> Optional[str]:
    """One step on fresh buffers; None when it matches the reference, else what is wrong."""
    if c.compact is not None:
        return check_compact_contender(c, seed)
    b = make_buffers(CHECK_SIZE, seed)
    expected = expected_roofline(b) if c.is_roofline else expected_adam(b, c)
    c.build(b)()
    got = {"param": b.param_fp32, "exp_avg": b.exp_avg_fp32, "exp_avg_sq": b.exp_avg_sq_fp32}
    problems = [mismatch(name, got[name], *expected[name]) for name in got]
    want_lowp = bf16_truncate(b.param_fp32) if c.is_roofline else b.param_fp32.to(torch.bfloat16)
    lowp_bad = int((b.param_bf16.view(torch.int16) != want_lowp.view(torch.int16)).sum())
    if lowp_bad:
        problems.append(f"param_lowp: {lowp_bad} of {b.param_bf16.numel()} elements are not the bf16 copy "
                        f"of param ({'truncated' if c.is_roofline else 'rounded to nearest even'})")
    problems = [p for p in problems if p is not None]
    return "\n".join(problems) if problems else None


def check_all(cs: list[Contender], seed: int) -> bool:
    ok = True
    for c in cs:
        problem = check_contender(c, seed)
        print(f"check  {c.name:<36} {'ok' if problem is None else 'MISMATCH'}")
        if problem is not None:
            print("       " + problem.replace("\n", "\n       "))
            ok = False
    return ok


# ---- timing -----------------------------------------------------------------------------------


def spin_until(deadline: float) -> None:
    while time.perf_counter() < deadline:
        pass


def time_interleaved(steps: dict[str, Callable[[], None]], reps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each step function; repetition r runs them in an order rotated by r."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    seconds = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            spin_until(time.perf_counter() + PAUSE_S)
            start = time.perf_counter()
            steps[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def measure_size(cs: list[Contender], n: int, args) -> list[dict]:
    b = make_buffers(n, args.seed)
    steps = {c.name: c.build(b) for c in cs}
    seconds = time_interleaved(steps, args.reps, args.warmup)
    del steps, b
    gc.collect()
    rows = [row(c, n, seconds[c.name]) for c in cs]
    base = next(r["median_ms"] for r in rows if r["contender"] == TORCH_BASELINE)
    roof = next(r["median_ms"] for r in rows if r["contender"] == ROOFLINE)
    roof_bytes = bytes_per_param(torch.float32)  # the roofline moves what our fp32 step moves
    for r in rows:
        r["vs_torch_fused"] = base / r["median_ms"]
        r["pct_of_roofline"] = 100.0 * roof / r["median_ms"]
        if r["compact"] is not None:
            fp32 = next(x for x in rows if x["compact"] is None and x["contender"].startswith("ours")
                        and x["grad"] == r["grad"])
            r["vs_ours_fp32"] = fp32["median_ms"] / r["median_ms"]
            r["vs_ours_fp32_of"] = fp32["contender"]
            r["own_roofline_ms"] = roof * r["bytes_per_param"] / roof_bytes
            r["pct_of_own_roofline"] = 100.0 * r["own_roofline_ms"] / r["median_ms"]
    return rows


def row(c: Contender, n: int, seconds: list[float]) -> dict:
    median = statistics.median(seconds)
    return {"size": n, "contender": c.name, "grad": str(c.grad_dtype).removeprefix("torch."),
            "bytes_per_param": c.bytes_per_param, "median_ms": median * 1e3, "compact": c.compact,
            "all_ms": [s * 1e3 for s in seconds], "params_per_s": n / median,
            "gb_per_s": n * c.bytes_per_param / median / 1e9}


# ---- our step interleaved with a torch op -------------------------------------------------------


def torch_op(n: int) -> Callable[[], None]:
    """A large elementwise torch op on tensors of its own: it runs on torch's intra-op (OpenMP) pool."""
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)

    def run() -> None:
        torch.add(a, b, out=c)

    return run


def measure_interleaved(adam, n: int, args) -> dict:
    """Medians of our step alone and right after torch_op, each call preceded by the usual pause."""
    b = make_buffers(n, args.seed)
    step = ours(adam, torch.float32)(b)
    before = torch_op(TORCH_OP_ELEMENTS)
    for _ in range(args.warmup):
        before()
        step()
    alone, after_op = [], []
    for r in range(args.reps):
        for interleaved in ((False, True) if r % 2 == 0 else (True, False)):
            spin_until(time.perf_counter() + PAUSE_S)
            if interleaved:
                before()  # untimed: what is timed is our step on the cores torch's pool just left
            start = time.perf_counter()
            step()
            (after_op if interleaved else alone).append(time.perf_counter() - start)
    del b, step, before
    gc.collect()
    alone_ms, after_ms = statistics.median(alone) * 1e3, statistics.median(after_op) * 1e3
    return {"size": n, "isa": adam.isa, "threads": adam.threads, "alone_ms": alone_ms, "after_torch_op_ms": after_ms,
            "pct_of_isolated": 100.0 * alone_ms / after_ms,
            "all_alone_ms": [t * 1e3 for t in alone], "all_after_torch_op_ms": [t * 1e3 for t in after_op]}


def interleaved_table(rows: list[dict]) -> str:
    lines = ["| params | isa | threads | ours alone ms | ours right after a torch op ms | % of isolated speed |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {size_label(r['size'])} | {r['isa']} | {r['threads']} | {r['alone_ms']:.2f} "
                     f"| {r['after_torch_op_ms']:.2f} | {r['pct_of_isolated']:.0f}% |")
    return "\n".join(lines)


# ---- gradient accumulation: ours vs torch add_ ---------------------------------------------------


def check_grad_accumulate(adam, seed: int) -> Optional[str]:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(CHECK_SIZE, generator=gen).to(torch.bfloat16)
    ours_dst = torch.randn(CHECK_SIZE, generator=gen)
    torch_dst = ours_dst.clone()
    adam.grad_accumulate_(ours_dst, src)
    torch_dst.add_(src)
    differ = int((ours_dst.view(torch.int32) != torch_dst.view(torch.int32)).sum())
    return None if differ == 0 else f"grad_accumulate_: {differ} of {CHECK_SIZE} elements differ from torch's add_"


def measure_grad_accumulate(adam, n: int, args) -> list[dict]:
    """dst (fp32) += src (bf16): ours and torch's add_, each at 1 thread and at args.threads."""
    gen = torch.Generator().manual_seed(args.seed)
    dst, src = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    rows = []
    for threads in sorted({1, args.threads}):
        adam.set_num_threads(threads)
        torch.set_num_threads(threads)
        steps = {"ours grad_accumulate_": lambda: adam.grad_accumulate_(dst, src), "torch add_": lambda: dst.add_(src)}
        seconds = time_interleaved(steps, args.reps, args.warmup)
        for name, secs in seconds.items():
            median = statistics.median(secs)
            rows.append({"size": n, "contender": name, "threads": threads, "isa": adam.isa if name.startswith("ours") else "torch",
                         "median_ms": median * 1e3, "gb_per_s": n * 10 / median / 1e9})  # read 4+2, write 4
    adam.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    return rows


def grad_accumulate_table(rows: list[dict]) -> str:
    lines = ["| params | contender | isa | threads | median ms | GB/s (10 B/param) | vs torch add_ |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = next(x["median_ms"] for x in rows if x["size"] == r["size"] and x["threads"] == r["threads"]
                    and x["contender"] == "torch add_")
        lines.append(f"| {size_label(r['size'])} | {r['contender']} | {r['isa']} | {r['threads']} | {r['median_ms']:.2f} "
                     f"| {r['gb_per_s']:.2f} | {base / r['median_ms']:.2f}x |")
    return "\n".join(lines)


# ---- report -------------------------------------------------------------------------------------


def size_label(n: int) -> str:
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return f"{n:,}"


def compact_table(rows: list[dict], threads: int) -> str:
    lines = ["| params | contender | isa | threads | grad | B/param moved | median ms | GB/s "
             "| x ours fp32 (same grad) | own roofline ms | % of own roofline |",
             "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {size_label(r['size'])} | {r['contender']} | {r.get('isa', '-')} | {threads} | {r['grad']} "
                     f"| {r['bytes_per_param']:g} | {r['median_ms']:.2f} | {r['gb_per_s']:.2f} "
                     f"| {r['vs_ours_fp32']:.2f}x | {r['own_roofline_ms']:.2f} | {r['pct_of_own_roofline']:.0f}% |")
    return "\n".join(lines)


def compact_misses(rows: list[dict], target_sizes: list[int]) -> list[str]:
    misses = []
    for r in rows:
        if r["compact"] != "compact":
            continue
        for what, got, want, unit in (("x ours fp32", r["vs_ours_fp32"], TARGET_COMPACT_VS_FP32, "x"),
                                      ("% of own roofline", r["pct_of_own_roofline"], TARGET_COMPACT_PCT_OWN_ROOFLINE, "%")):
            enforced = r["size"] in target_sizes
            verdict = "met" if got >= want else ("MISSED" if enforced else "below (not enforced at this size)")
            print(f"target {size_label(r['size']):>4}: {r['contender']} {what:<18} {got:7.2f}{unit}  (>= {want}{unit})  "
                  f"{verdict}")
            if got < want and enforced:
                misses.append(f"{size_label(r['size'])} {r['contender']} {what}: {got:.2f}{unit} < {want}{unit}")
    return misses


def markdown_table(rows: list[dict]) -> str:
    lines = ["| params | contender | isa | grad | B/param | median ms | min-max ms | Mparam/s | GB/s "
             "| vs torch fused+copy | % of roofline |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {size_label(r['size'])} | {r['contender']} | {r.get('isa', '-')} | {r['grad']} | {r['bytes_per_param']} "
                     f"| {r['median_ms']:.2f} | {min(r['all_ms']):.1f}-{max(r['all_ms']):.1f} "
                     f"| {r['params_per_s'] / 1e6:.0f} | {r['gb_per_s']:.2f} "
                     f"| {r['vs_torch_fused']:.2f}x | {r['pct_of_roofline']:.0f}% |")
    return "\n".join(lines)


def interleaved_misses(rows: list[dict], target_sizes: list[int]) -> list[str]:
    misses = []
    for r in rows:
        got, enforced = r["pct_of_isolated"], r["size"] in target_sizes
        verdict = "met" if got >= TARGET_PCT_OF_ISOLATED else ("MISSED" if enforced else "below (not enforced at this size)")
        print(f"target {size_label(r['size']):>4}: {'% of isolated speed':<20} {got:7.2f}%  "
              f"(>= {TARGET_PCT_OF_ISOLATED}%, right after a torch op, isa {r['isa']})  {verdict}")
        if got < TARGET_PCT_OF_ISOLATED and enforced:
            misses.append(f"{size_label(r['size'])} right after a torch op: {got:.1f}% < {TARGET_PCT_OF_ISOLATED}% of isolated")
    return misses


def target_misses(rows: list[dict], target_sizes: list[int]) -> list[str]:
    """The targets of the host Adam issue for ours (fp32 grad) vs the roofline and the baselines:
    printed for every size, missed ones returned for the sizes in `target_sizes`."""
    misses = []
    for n in sorted({r["size"] for r in rows}, reverse=True):
        by_name = {r["contender"]: r for r in rows if r["size"] == n}
        mine = by_name.get(OURS)
        if mine is None:
            continue
        checks = [("% of roofline", mine["pct_of_roofline"], TARGET_PCT_ROOFLINE, "%"),
                  ("x torch fused+copy", mine["vs_torch_fused"], TARGET_VS_TORCH, "x")]
        if DEEPSPEED in by_name:
            checks.append(("x DeepSpeed+copy", by_name[DEEPSPEED]["median_ms"] / mine["median_ms"],
                           TARGET_VS_DEEPSPEED, "x"))
        for what, got, want, unit in checks:
            verdict = "met" if got >= want else ("MISSED" if n in target_sizes else "below (not enforced at this size)")
            print(f"target {size_label(n):>4}: {what:<20} {got:7.2f}{unit}  (>= {want}{unit})  {verdict}")
            if got < want and n in target_sizes:
                misses.append(f"{size_label(n)} {what}: {got:.2f}{unit} < {want}{unit}")
    return misses


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores_in_affinity_mask": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_average": os.getloadavg()}


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    value = int(text[:-1]) if scale != 1 else int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive, e.g. 64M or 8M")
    return value * scale


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64M,8M", help="comma-separated parameter counts (K/M/G = 2**10/20/30); "
                    "default 64M and 8M (one 32 MB bucket)")
    ap.add_argument("--reps", type=int, default=11, help="timed repetitions per contender (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds before timing")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for every contender (default: the cores of this process's affinity mask)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--isa", default=None, help="our kernel's instruction set (scalar, avx2, avx512, neon, sve; "
                    "default: the best this CPU supports)")
    ap.add_argument("--only", choices=["all", "adam", "interleaved", "grad"], default="all",
                    help="run only one of the three tables (default: all)")
    ap.add_argument("--single-tensor", action="store_true", help="also time torch AdamW(foreach=False) (slow)")
    ap.add_argument("--allow-reference", action="store_true",
                    help="time the PyTorch reference when the C++ kernel cannot be built, instead of failing")
    ap.add_argument("--target-sizes", default=None,
                    help="sizes at which a missed target fails the run (default: the largest of --sizes; "
                    "smaller sizes take a few ms, which a shared machine's noise swamps)")
    ap.add_argument("--no-targets", action="store_true", help="report the targets but do not fail on a miss")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.target_sizes = ([parse_size(s) for s in args.target_sizes.split(",")] if args.target_sizes
                         else [max(args.sizes)])
    if not set(args.target_sizes) <= set(args.sizes):
        ap.error(f"--target-sizes {args.target_sizes} must be among --sizes {args.sizes}")
    if args.threads < 1 or args.reps < 1 or args.warmup < 0:
        ap.error(f"--threads {args.threads} / --reps {args.reps} must be >= 1 and --warmup {args.warmup} >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # torch's optimizers, the copies, and DeepSpeed's OpenMP team
    adam = load_ours(args.threads, args.allow_reference, args.isa)
    ext = load_roofline() if args.only in ("all", "adam") else None
    ds_cls, ds_reason = load_deepspeed()
    info = machine()
    print(f"# host Adam benchmark  {info['date']}  {info['cpu']}  threads={args.threads} "
          f"(affinity {info['cores_in_affinity_mask']})  torch {info['torch']}  load {info['load_average'][0]:.2f}")
    print(f"# ours: {adam.name} back end, isa={adam.isa}, threads={adam.threads}")
    print("# torch intra-op pool: " + ", ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in
                                                ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")))
    print(f"# bytes per parameter: read p,g,m,v = 4+4+4+4, write p,m,v + bf16 copy = 4+4+4+2: 30 B "
          f"(28 B with a bf16 gradient); GB/s = params * B/param / median time")
    if ds_cls is None:
        print(f"# DeepSpeedCPUAdam row skipped: deepspeed is not usable here ({ds_reason}); "
              "benchmarks/README.md says how to run with it")
    else:
        import deepspeed

        print(f"# DeepSpeedCPUAdam from deepspeed {deepspeed.__version__}")
    rows, interleaved, grad_rows, misses, tables = [], [], [], [], []
    if args.only in ("all", "adam"):
        cs = contenders(args, adam, ext, ds_cls)
        if not check_all(cs, args.seed):
            print("FAIL: a contender does not compute the reference result (see above); no timing done.")
            return 1
        for n in args.sizes:
            rows += measure_size(cs, n, args)
        for r in rows:
            r["isa"] = adam.isa if r["contender"].startswith("ours") else "-"
        fp32_rows = [r for r in rows if r["compact"] is None]
        compact_rows = [r for r in rows if r["compact"] is not None]
        tables.append(markdown_table(fp32_rows))
        print(tables[-1])
        misses += target_misses(fp32_rows, args.target_sizes)
        tables.append(compact_table(compact_rows, args.threads))
        print(tables[-1])
        misses += compact_misses(compact_rows, args.target_sizes)
    if args.only in ("all", "interleaved"):
        interleaved = [measure_interleaved(adam, n, args) for n in args.sizes]
        tables.append(interleaved_table(interleaved))
        print(tables[-1])
        misses += interleaved_misses(interleaved, args.target_sizes)
    if args.only in ("all", "grad"):
        problem = check_grad_accumulate(adam, args.seed)
        print(f"check  {'ours grad_accumulate_ vs torch add_':<36} {'ok' if problem is None else 'MISMATCH'}")
        if problem is not None:
            print("       " + problem)
            return 1
        for n in args.sizes:
            grad_rows += measure_grad_accumulate(adam, n, args)
        tables.append(grad_accumulate_table(grad_rows))
        print(tables[-1])
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "threads": args.threads, "reps": args.reps, "isa": adam.isa,
                                         "bytes_per_param": "16 read + 14 written (28 with a bf16 gradient)",
                                         "deepspeed": ds_reason or "used", "rows": rows,
                                         "interleaved_rows": interleaved, "grad_accumulate_rows": grad_rows,
                                         "target_misses": misses, "table": "\n\n".join(tables)}, indent=2))
    if adam.name != "cpp":
        print("NOTE: 'ours' is the PyTorch reference fallback (--allow-reference); its targets are not meaningful.")
    if misses and not args.no_targets:
        print("FAIL: performance targets missed: " + "; ".join(misses) + " (pass --no-targets to only report)")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
