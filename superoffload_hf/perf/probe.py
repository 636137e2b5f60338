"""Measure this machine (and, given a recipe, its model) and derive the plan the cost model
(superoffload_hf.plan.cost_model) chooses from the numbers: `probe(...) -> ProbeReport`. The
`superoffload probe` command that prints it is superoffload_hf/cli.py's `probe_command`; the
engine measures page-locking with `measure_pinning` (engine/state/pin_method.py).

Measured, each through the device seam (superoffload_hf.device.make_runtime) and the host Adam
back end the engine uses (superoffload_hf.host.kernel.get_host_adam):

* copy bandwidth host->device and device->host by transfer size, page-locked and pageable;
* page-locking by cudaHostAlloc against cudaHostRegister (torch's `pinned_use_cuda_host_register`),
  where the runtime has the choice: GB/s pinned and the host->device bandwidth from each;
* host Adam rate (elements/s of one 30-byte-per-element pass: fp32 step + bf16 copy) by thread
  count, alone and while another thread copies host memory (what the engine's copies and the
  training thread do meanwhile);
* the compact host Adam rate at the engine's thread count (host/compact.py state: decode,
  update, encode in one pass), and the state precision with its stored bytes per parameter
  (the recipe's `state_precision`, fp32 without a recipe);
* device Adam rate (torch AdamW, fused where the device supports it, on fp32 buffers);
* with a recipe: the model's forward and backward time for one micro-batch, and when each
  parameter's gradient is complete during backward (the ready profile), from hooks that wait
  for the device at each gradient (a pass timed apart from the plain one, which gives the times).

On a machine without an accelerator the CPU is the device: the same code, small numbers. The
whole probe takes well under 2 minutes (`--quick`: a few seconds, for tests).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from superoffload_hf.plan.cost_model import Bandwidth, Machine, Plan, Workload, choose_plan

KB, MB = 2**10, 2**20
TRANSFER_SIZES = (64 * KB, 1 * MB, 8 * MB, 32 * MB, 128 * MB)
QUICK_TRANSFER_SIZES = (64 * KB, 1 * MB, 8 * MB)
ADAM_NUMEL = 8 * MB // 4 * 4  # 8M elements: one 32 MB bucket
QUICK_ADAM_NUMEL = 1 * MB
POINT_SECONDS = 0.15  # time spent on one measured point
QUICK_POINT_SECONDS = 0.03
PIN_BYTES = 1 << 30  # page-locked once per pinning method
QUICK_PIN_BYTES = 8 * MB
PIN_METHODS = (("cudaHostAlloc", False), ("cudaHostRegister", True))


@dataclass
class ProbeReport:
    device: str
    host_adam: str
    copies: dict = field(default_factory=dict)
    """{"h2d_pinned": {bytes: GB/s}, "d2h_pinned": ..., "h2d_pageable": ..., "d2h_pageable": ...}"""
    host_adam_rate: dict = field(default_factory=dict)
    """{threads: elements/s} alone."""
    host_adam_rate_busy: dict = field(default_factory=dict)
    """{threads: elements/s} while another thread copies host memory."""
    pinning: dict = field(default_factory=dict)
    """{method: {"pin_gbps", "h2d_gbps"}, "faster": method} ({} where the runtime has no choice)."""
    engine_threads: int = 1
    host_adam_compact_rate: float = 0.0
    """elements/s of the compact step (state_precision "compact") at `engine_threads`, alone."""
    state_precision: str = "fp32"
    state_bytes_per_param: float = 12.0
    """Stored host state per parameter at `state_precision` (host/compact.py CompactSpec)."""
    device_adam_rate: float = 0.0
    device_adam: str = ""
    device_free_bytes: int = 0
    workload: Optional[dict] = None
    plan: Optional[dict] = None
    plan_text: str = ""
    seconds: float = 0.0

    def machine(self, lowp_bytes: int = 2) -> Machine:
        """The cost model's view of the measured machine."""
        pinned = "pinned" if self.device != "cpu" else "pageable"
        t = self.engine_threads
        return Machine(
            name=self.device,
            h2d=Bandwidth(tuple(self.copies[f"h2d_{pinned}"].items())),
            d2h=Bandwidth(tuple(self.copies[f"d2h_{pinned}"].items())),
            host_adam_rate=self.host_adam_rate[t], host_adam_rate_busy=self.host_adam_rate_busy[t],
            device_adam_rate=self.device_adam_rate, device_free_bytes=self.device_free_bytes,
            host_is_device=self.device == "cpu", lowp_bytes=lowp_bytes,
        )

    def format(self) -> str:
        lines = [f"superoffload probe: device {self.device}; {self.host_adam}; {self.seconds:.1f} s"]
        sizes = sorted({s for table in self.copies.values() for s in table})
        lines.append("  copies, GB/s      " + "".join(f"{_size(s):>9}" for s in sizes))
        for name, table in self.copies.items():
            lines.append(f"    {name:<15}" + "".join(f"{table.get(s, float('nan')):>9.2f}" for s in sizes))
        methods = [m for m, _ in PIN_METHODS if m in self.pinning]
        if methods:
            lines.append("  page-locking: " + "; ".join(
                f"{m} {self.pinning[m]['pin_gbps']:.2f} GB/s pinned, h2d {self.pinning[m]['h2d_gbps']:.2f} GB/s"
                for m in methods) + f"; faster: {self.pinning['faster']}")
        lines.append("  host Adam, Gelem/s by threads (alone / with host copies running)")
        for t in sorted(self.host_adam_rate):
            mark = "  <- the engine's pool" if t == self.engine_threads else ""
            lines.append(f"    {t:>3} threads  {self.host_adam_rate[t] / 1e9:7.3f} / "
                         f"{self.host_adam_rate_busy[t] / 1e9:7.3f}{mark}")
        lines.append(f"  compact host Adam {self.host_adam_compact_rate / 1e9:.3f} Gelem/s at {self.engine_threads} "
                     f"threads; host state {self.state_precision}, {self.state_bytes_per_param:.3f} B/param stored")
        lines.append(f"  device Adam ({self.device_adam}): {self.device_adam_rate / 1e9:.3f} Gelem/s; "
                     f"device memory free {self.device_free_bytes / 2**30:.1f} GiB")
        if self.workload:
            w = self.workload
            lines.append(f"  model: {w['num_params'] / 1e6:.2f}M parameters, {w['tokens_per_step']:,} tokens a step: "
                         f"forward {w['forward_s'] * 1e3:.2f} ms, backward {w['backward_s'] * 1e3:.2f} ms")
        lines.append(self.plan_text or "  (give --recipe R.yaml for the plan these numbers imply for a model)")
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes // MB}M" if nbytes >= MB else f"{nbytes // KB}K"


# ---- timing helpers -------------------------------------------------------------------------------


def _timed(fn, runtime, point_seconds: float, trials: int = 3) -> float:
    """Median seconds of one call of `fn`, timed over back-to-back calls ended by an event."""
    def run(reps: int) -> float:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        event = runtime.new_event()
        event.record(runtime.current_stream())
        event.synchronize()
        return (time.perf_counter() - start) / reps

    first = run(1)  # warm-up (first touch, allocator, kernel caches)
    reps = int(min(200, max(1, point_seconds / trials / max(first, 1e-6))))
    return statistics.median(run(reps) for _ in range(trials))


def measure_copies(runtime, sizes: Sequence[int], point_seconds: float) -> dict:
    out = {}
    for pinned in (True, False):
        for direction in ("h2d", "d2h"):
            table = {}
            for nbytes in sizes:
                numel = nbytes // 4
                host = runtime.host_empty(numel, torch.float32, pinned).fill_(1.0)
                dev = runtime.device_empty(numel, torch.float32).fill_(2.0)
                dst, src = (dev, host) if direction == "h2d" else (host, dev)
                seconds = _timed(lambda: runtime.copy_(dst, src), runtime, point_seconds)
                table[nbytes] = nbytes / seconds / 1e9
                del host, dev, dst, src
            out[f"{direction}_{'pinned' if pinned else 'pageable'}"] = table
    return out


def measure_pinning(runtime, nbytes: int, threads: int, point_seconds: float) -> dict:
    """Page-lock `nbytes` by each method (a fresh block: the host allocator's cache emptied
    first) and copy it to the device; {} where the runtime has no choice of method. "faster": the
    method that pins faster without costing over 5% of the other's copy bandwidth."""
    out = {}
    try:
        for method, register in PIN_METHODS:
            if not runtime.host_register(register, threads):
                return {}
            runtime.host_empty_cache()
            start = time.perf_counter()
            host = runtime.host_empty(nbytes // 4, torch.float32, pinned=True)
            pin_s = max(time.perf_counter() - start, 1e-9)
            host.fill_(1.0)
            dev = runtime.device_empty(nbytes // 4, torch.float32)
            copy_s = _timed(lambda: runtime.copy_(dev, host), runtime, point_seconds)
            out[method] = {"pin_gbps": nbytes / pin_s / 1e9, "h2d_gbps": nbytes / copy_s / 1e9}
            del host, dev
            runtime.host_empty_cache()
    finally:
        runtime.host_register(False, threads)  # torch's default again
    alloc, register = out["cudaHostAlloc"], out["cudaHostRegister"]
    faster = (register["pin_gbps"] > alloc["pin_gbps"] and register["h2d_gbps"] >= 0.95 * alloc["h2d_gbps"])
    out["faster"] = "cudaHostRegister" if faster else "cudaHostAlloc"
    return out


def _adam_buffers(numel: int):
    g = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=g)
    return (param, torch.zeros(numel), torch.zeros(numel), torch.randn(numel, generator=g) * 1e-3,
            torch.empty(numel, dtype=torch.bfloat16))


def measure_host_adam(adam, numel: int, thread_counts: Sequence[int], point_seconds: float,
                      runtime) -> tuple[dict, dict]:
    """{threads: elements/s} alone and with a host-memory copy loop running in another thread."""
    param, m, v, grad, lowp = _adam_buffers(numel)
    step = [0]

    def one_step():
        step[0] += 1
        adam.adam_step_(param, m, v, grad, step=step[0], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.01, adamw=True, param_lowp=lowp)

    alone, busy = {}, {}
    for threads in thread_counts:
        adam.set_num_threads(threads)
        alone[threads] = numel / _timed(one_step, runtime, point_seconds)
        with _HostCopyLoad(numel):
            busy[threads] = numel / _timed(one_step, runtime, point_seconds)
    return alone, busy


def measure_compact_adam(adam, numel: int, point_seconds: float, runtime) -> float:
    """elements/s of the back end's compact_step_ on `numel` elements ("compact" state, fp32 gradient)."""
    from superoffload_hf.host.compact import compact_encode_, empty_state

    param, m, v, grad, _ = _adam_buffers(numel)
    state = empty_state(numel, "compact")
    compact_encode_(*state, param, m, v)
    step = [0]

    def one_step():
        step[0] += 1
        adam.compact_step_(*state, grad, step=step[0], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.01, adamw=True)

    return numel / _timed(one_step, runtime, point_seconds)


class _HostCopyLoad:
    """Another thread copying host memory (torch releases the GIL in copy_): what the engine's
    gradient landings and the training thread put on the host while the Adam runs."""

    def __init__(self, numel: int):
        self.src, self.dst = torch.ones(numel), torch.empty(numel)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.dst.copy_(self.src)
            time.sleep(0.0005)  # a copy, then a short gap: the engine's copies come and go

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def measure_device_adam(runtime, numel: int, point_seconds: float) -> tuple[float, str]:
    param = runtime.device_empty(numel, torch.float32).normal_()
    param.grad = runtime.device_empty(numel, torch.float32).normal_().mul_(1e-3)
    param.requires_grad_(True)
    for kind in ("fused", "foreach"):
        try:
            opt = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, **{kind: True})
            seconds = _timed(opt.step, runtime, point_seconds)
            return numel / seconds, f"torch AdamW {kind}"
        except (RuntimeError, ValueError, TypeError):
            continue
    raise RuntimeError(f"torch.optim.AdamW runs neither fused nor foreach on {runtime.device}.")


# ---- the model of a recipe ------------------------------------------------------------------------


def build_recipe_model(recipe, device: torch.device):
    """A random init of the recipe's model, built on `device` in the recipe's dtype (no weights
    are downloaded; a hub model needs only its config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if recipe.model.config is not None:
        values = dict(recipe.model.config)
        model_type = values.pop("model_type", "llama")
        if recipe.tokenizer.shipped:
            values.setdefault("vocab_size", recipe.tokenizer.vocab_size)
        config = AutoConfig.for_model(model_type, **values)
    else:
        config = AutoConfig.from_pretrained(recipe.model.name_or_path)
    config.use_cache = False
    extra = {"attn_implementation": recipe.model.attn_implementation} if recipe.model.attn_implementation else {}
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, recipe.model_dtype), **extra)


def measure_workload(recipe, runtime, trials: int = 3) -> Workload:
    model = build_recipe_model(recipe, runtime.device)
    t = recipe.training
    if t.get("activation_checkpointing") or t.get("gradient_checkpointing"):  # the recipe names it either way
        kwargs = t.get("activation_checkpointing_kwargs") or t.get("gradient_checkpointing_kwargs")
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24; the old name warns there
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    batch = int(recipe.training.get("per_device_train_batch_size", 8))
    accumulation = int(recipe.training.get("gradient_accumulation_steps", 1))
    seq = recipe.data.seq_len
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=runtime.device)
    params = [p for p in model.parameters() if p.requires_grad]
    num_params = sum(p.numel() for p in params)

    def sync() -> float:
        event = runtime.new_event()
        event.record(runtime.current_stream())
        event.synchronize()
        return time.perf_counter()

    forward, backward = [], []
    for _ in range(trials + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        t0 = sync()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = sync()
        loss.backward()
        t2 = sync()
        forward.append(t1 - t0)
        backward.append(t2 - t1)
    forward_s, backward_s = statistics.median(forward[1:]), statistics.median(backward[1:])

    ready: dict[int, float] = {}  # parameter -> when its gradient was complete (first firing)

    def hook(index: int):
        def mark(param) -> None:
            if index not in ready:
                ready[index] = sync()  # waits for the device: this gradient is complete now
        return mark

    handles = [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(params)]
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    start = sync()
    loss.backward()
    end = sync()
    for h in handles:
        h.remove()
    span = max(end - start, 1e-9)
    profile, done = [], 0
    for i in sorted(ready, key=ready.get):
        done += params[i].numel()
        profile.append((done / num_params, min(1.0, (ready[i] - start) / span)))
    del model
    return Workload(num_params=num_params, forward_s=accumulation * forward_s + (accumulation - 1) * backward_s,
                    backward_s=backward_s, ready_profile=tuple(profile), tokens_per_step=batch * seq * accumulation)


# ---- the probe ------------------------------------------------------------------------------------


def default_device() -> torch.device:
    if torch.accelerator.is_available():
        return torch.device(torch.accelerator.current_accelerator().type, 0)
    return torch.device("cpu")


def thread_counts(maximum: int) -> list[int]:
    counts, t = [], 1
    while t < maximum:
        counts.append(t)
        t *= 2
    return counts + [maximum]


def probe(device: Optional[torch.device] = None, recipe=None, *, quick: bool = False,
          threads: Optional[int] = None) -> ProbeReport:
    from superoffload_hf.device import make_runtime
    from superoffload_hf.host.kernel import default_threads, get_host_adam

    started = time.perf_counter()
    runtime = make_runtime(device or default_device())
    engine_threads = threads or default_threads()
    adam = get_host_adam("auto", threads=engine_threads)
    point = QUICK_POINT_SECONDS if quick else POINT_SECONDS
    numel = QUICK_ADAM_NUMEL if quick else ADAM_NUMEL
    report = ProbeReport(device=runtime.name, host_adam=adam.describe(), engine_threads=engine_threads)
    # The model first, while nothing else has run in this process (on a CPU device, worker
    # threads of the micro-benchmarks below may still be winding down for a while).
    workload = measure_workload(recipe, runtime, trials=1 if quick else 3) if recipe is not None else None
    report.copies = measure_copies(runtime, QUICK_TRANSFER_SIZES if quick else TRANSFER_SIZES, point)
    report.pinning = measure_pinning(runtime, QUICK_PIN_BYTES if quick else PIN_BYTES, engine_threads, point)
    try:
        report.host_adam_rate, report.host_adam_rate_busy = measure_host_adam(
            adam, numel, thread_counts(engine_threads), point, make_runtime(torch.device("cpu")))
    finally:
        adam.set_num_threads(engine_threads)
    report.host_adam_compact_rate = measure_compact_adam(adam, numel, point, make_runtime(torch.device("cpu")))
    if recipe is not None and recipe.superoffload:
        report.state_precision = recipe.superoffload.get("state_precision", "fp32")
    from superoffload_hf.host.compact import spec_of

    report.state_bytes_per_param = spec_of(report.state_precision).bytes_per_param
    report.device_adam_rate, report.device_adam = measure_device_adam(runtime, numel, point)
    report.device_free_bytes = int(runtime.memory_info()[0])
    if workload is not None:
        lowp_bytes = torch.empty((), dtype=getattr(torch, recipe.model_dtype)).element_size()
        plan = choose_plan(report.machine(lowp_bytes), workload)
        report.workload = dataclasses.asdict(workload)
        report.plan = _plan_dict(plan)
        report.plan_text = plan.format()
    report.seconds = time.perf_counter() - started
    return report


def _plan_dict(plan: Plan) -> dict:
    out = dataclasses.asdict(plan)
    out["prediction"]["step_s"] = plan.prediction.step_s
    out["prediction"]["device_idle_fraction"] = plan.prediction.device_idle_fraction
    return out
