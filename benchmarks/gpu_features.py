"""The features built since the last GPU review, each on the device against its CPU reference
(gpu_check.sh runs one per stage, plain and under the CUDA stream sanitizer):

    python benchmarks/gpu_features.py flow --out DIR                # on CUDA
    SUPEROFFLOAD_SIM_DEVICE=1 python benchmarks/gpu_features.py flow --rehearse --out DIR

  flow                weight-flow on a model made not to fit: the run sets a device budget of a
                      quarter of the weights (CUDA: torch.cuda.set_per_process_memory_fraction;
                      the simulated device: its device budget) that stationary weights exceed;
                      reference: stationary weights on the CPU device (tests/engine/test_weight_flow.py)
  activation_offload  gradient checkpointing with each block's input offloaded to pinned host
                      memory, at a long sequence; reference: no offload on the CPU device
                      (tests/parallel/test_gpu_activation_offload.py)
  tiling              the tiled loss and tiled MLP at a long sequence, small chunks; reference:
                      untiled on the CPU device (tests/parallel/test_tiling.py)
  compact             compact host state (bf16 device weights); reference: the same on the CPU
                      device (tests/engine/test_weight_flow.py's compact case)
  trainer             the HF Trainer with superoffload, bf16 and gradient checkpointing;
                      reference: the same Trainer run on the CPU device (tests/integrations/test_trainer.py)

Each runs a few optimizer steps with `host_kernel: cpp` (GraceAdam, never the reference Adam) and
reports the steps that ran, the largest difference from its reference (parameters element by
element after the last step, and every loss), tokens/s, the device's idle time per step
(`counters.device_wait_seconds`), and the peak device memory against the dry run's device
footprint (plan/memory.py; activations not in it). With --rehearse (tiny sizes, the CPU as the
device, the simulated asynchronous device when SUPEROFFLOAD_SIM_DEVICE=1) the comparison is
bitwise except for tiling (the chunks change the summation order: rtol 1e-5, atol 1e-5); on
CUDA it is within a tolerance (the device's kernels are not the CPU's). --no-reference runs the
device run alone (under the CUDA stream sanitizer: its stage checks the streams, the plain stage
the numbers). Writes FEATURE.json and FEATURE.md to --out; exits 1, printing FAIL lines, when a
comparison or a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

FEATURES = ("flow", "activation_offload", "tiling", "compact", "trainer")
SIM_ENV_VAR = "SUPEROFFLOAD_SIM_DEVICE"


@dataclass
class Shape:
    layers: int
    hidden: int
    vocab: int
    seq: int
    batch: int = 1
    steps: int = 3


# (rehearsal, CUDA) sizes. The CUDA ones are first guesses, not yet measured: each must build,
# pin, train on the device and again on the CPU (the reference: eager attention at seq 4096 is
# 4096^2 scores a head and layer) within its stage's cap
SHAPES = {
    "flow": (Shape(16, 32, 64, 16, 2), Shape(16, 1024, 32000, 512)),
    "activation_offload": (Shape(4, 32, 128, 128), Shape(8, 256, 256, 4096)),
    "tiling": (Shape(2, 32, 128, 64), Shape(4, 512, 32000, 4096)),
    "compact": (Shape(4, 32, 128, 16, 2), Shape(16, 1024, 32000, 512)),
    "trainer": (Shape(2, 32, 128, 16, 4), Shape(8, 512, 32000, 512, 4)),
}


@dataclass
class Run:
    """One training run's numbers: what the comparison reads and what the report shows."""
    losses: list = field(default_factory=list)
    params: dict = field(default_factory=dict)
    seconds: list = field(default_factory=list)
    device_waits: list = field(default_factory=list)
    peak_device_bytes: int | None = None
    predicted_device_bytes: int = 0
    host_adam: str = ""
    notes: list = field(default_factory=list)


def build_model(shape: Shape, device: str, checkpointing: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=2 * shape.hidden,
                         num_hidden_layers=shape.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=shape.seq, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model.to(device)


def batch(shape: Shape, step: int, device: str) -> dict:
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


@contextlib.contextmanager
def on_cpu_device():
    """The reference runs on the plain CPU device, not the simulated one."""
    saved = os.environ.pop(SIM_ENV_VAR, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[SIM_ENV_VAR] = saved


REFERENCE = True  # False (--no-reference): the CPU reference is not run


def reference(run_it) -> Run | None:
    """The CPU reference: `run_it()` on the plain CPU device (None under --no-reference)."""
    if not REFERENCE:
        return None
    with on_cpu_device():
        return run_it()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()  # timing only: measure finished work


def read(model) -> dict:
    model.state_dict(keep_vars=True)  # waits for the copy-backs still on their way
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def predicted_device_bytes(opt) -> int:
    return sum(r.nbytes for r in opt._engine.footprint() if r.place == "device")


def train(model, opt, shape: Shape, device: str, run: Run) -> Run:
    """`shape.steps` steps of forward, backward, opt.step(): the losses, and the step times and
    device waits of every step after the first. The parameters are read after close() (under
    flow, reading them while open would fetch every unit to the device at once)."""
    for step in range(shape.steps):
        sync(device)
        start, wait = time.perf_counter(), opt.counters.device_wait_seconds
        loss = model(**batch(shape, step, device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.losses.append(float(loss.detach()))
        sync(device)
        if step > 0:
            run.seconds.append(time.perf_counter() - start)
            run.device_waits.append(opt.counters.device_wait_seconds - wait)
    run.peak_device_bytes = opt.device_memory_peak()
    run.predicted_device_bytes = predicted_device_bytes(opt)
    run.host_adam = kernel_name(opt)
    return run


def kernel_name(opt) -> str:
    return f"host Adam {opt._engine.adam.name}/{opt._engine.adam.isa}"


def optimizer(module, config: dict, **kwargs):
    from superoffload_hf import SuperOffloadAdamW

    return SuperOffloadAdamW(module.parameters(), lr=1e-3, weight_decay=1e-2, max_grad_norm=1.0,
                             config={"host_kernel": "cpp", "device_buckets": 0, "bucket_size_mb": kwargs.pop("bucket_mb", 4),
                                     **config}, **kwargs)


def engine_run(shape: Shape, device: str, config: dict, prepare=None, checkpointing: bool = False) -> Run:
    model = build_model(shape, device, checkpointing)
    run = Run()
    extra = prepare(model, run) if prepare is not None else None
    with optimizer(model, config, model=model) as opt:
        train(model, opt, shape, device, run)
    run.params = read(model)
    if extra is not None:
        extra(run)
    return run


# ---- the features --------------------------------------------------------------------------------


@contextlib.contextmanager
def device_budget(budget_bytes: int, device: str):
    """The device memory the run may use: the simulated device's budget, or CUDA's allocator cap."""
    if device.startswith("cuda"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total))
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        return
    from superoffload_hf.testing.sim import SimRuntime

    SimRuntime.reset_shared(device_budget_bytes=budget_bytes)
    try:
        yield
    finally:
        SimRuntime.reset_shared()


def flow(shape: Shape, device: str, rehearse: bool) -> tuple[Run, Run]:
    config = {"device_dtype": "fp32", "speculation": "on", "bucket_mb": 0.01 if rehearse else 16}
    bucket_mb = config.pop("bucket_mb")

    def stationary_on_cpu() -> Run:
        want = Run()
        model = build_model(shape, "cpu")
        with optimizer(model, {**config, "weights": "stationary"}, bucket_mb=bucket_mb, model=model) as opt:
            train(model, opt, shape, "cpu", want)
        want.params = read(model)
        return want

    want = reference(stationary_on_cpu)
    weight_bytes = sum(p.numel() * 4 for p in build_model(shape, "meta").parameters())
    # a quarter of the weights (as tests/engine/test_weight_flow.py); on CUDA, whose allocator cap counts
    # the activations and logits too, half of them plus 256 MiB: still less than the weights
    budget = weight_bytes // 4 if rehearse else weight_bytes // 2 + (256 << 20)
    if budget >= weight_bytes:
        raise ValueError(f"the flow model's {weight_bytes} bytes of weights fit its device budget of {budget}: "
                         "make the model larger (SHAPES in benchmarks/gpu_features.py)")
    got = Run(notes=[f"device budget {budget / 2**20:.1f} MiB < {weight_bytes / 2**20:.1f} MiB of weights"])
    with device_budget(budget, device):
        model = build_model(shape, device)
        with optimizer(model, {**config, "weights": "flow"}, bucket_mb=bucket_mb, model=model) as opt:
            train(model, opt, shape, device, got)
            got.notes.append(f"{opt.counters.weight_fetches} unit fetches, {opt.counters.bytes_fetched / 2**20:.1f} MiB")
            if opt.counters.weight_fetches == 0:
                got.notes.append("FAIL: no unit was fetched: the weights did not flow")
        got.params = read(model)
    if got.peak_device_bytes is not None and got.peak_device_bytes > budget:
        got.notes.append(f"FAIL: peak device memory {got.peak_device_bytes} bytes over the budget {budget}")
    return got, want


def activation_offload(shape: Shape, device: str, rehearse: bool) -> tuple[Run, Run]:
    from superoffload_hf.device import make_runtime
    from superoffload_hf.parallel.activation_offload import apply_activation_offload

    config = {"device_dtype": "fp32", "speculation": "on"}
    want = reference(lambda: engine_run(shape, "cpu", config, checkpointing=True))

    def offload(model, run):
        hooks = apply_activation_offload(model, make_runtime(torch.device(device)))

        def done(run):
            run.notes.append(f"{hooks.bytes_fetched / 2**20:.1f} MiB of block inputs fetched back")
            expected = shape.steps * (shape.layers - 1) * shape.batch * shape.seq * shape.hidden * 4
            if hooks.bytes_fetched != expected:
                run.notes.append(f"FAIL: {hooks.bytes_fetched} bytes fetched back, expected {expected}")
            hooks.remove()
        return done

    return engine_run(shape, device, config, offload, checkpointing=True), want


def tiling(shape: Shape, device: str, rehearse: bool) -> tuple[Run, Run]:
    from superoffload_hf.parallel.tiled_loss import apply_tiled_loss
    from superoffload_hf.parallel.tiled_mlp import apply_tiled_mlp

    config = {"device_dtype": "fp32", "speculation": "on"}
    want = reference(lambda: engine_run(shape, "cpu", config))
    chunk_loss, chunk_mlp = (7, 5) if rehearse else (1024, 2048)

    def tile(model, run):
        apply_tiled_mlp(apply_tiled_loss(model, chunk_tokens=chunk_loss), chunk_tokens=chunk_mlp)
        run.notes.append(f"tiled loss {chunk_loss} tokens, tiled MLP {chunk_mlp} tokens a chunk")

    return engine_run(shape, device, config, tile), want


def compact(shape: Shape, device: str, rehearse: bool) -> tuple[Run, Run]:
    config = {"device_dtype": "bf16", "state_precision": "compact", "speculation": "on"}
    want = reference(lambda: engine_run(shape, "cpu", config))
    return engine_run(shape, device, config), want


def trainer(shape: Shape, device: str, rehearse: bool) -> tuple[Run, Run]:
    want = reference(lambda: trainer_run(shape, "cpu"))
    return trainer_run(shape, device), want


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, shape: Shape):
        self.examples = [{"input_ids": ids, "labels": ids} for ids in
                         (batch(shape, i, "cpu")["input_ids"][0] for i in range(shape.steps * shape.batch))]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


def trainer_run(shape: Shape, device: str) -> Run:
    import tempfile

    from transformers import TrainerCallback

    from superoffload_hf.integrations.callback import unwrap_optimizer
    from superoffload_hf.integrations.trainer import Trainer, TrainingArguments

    run = Run()

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sync(device)
            self.start, self.opt = time.perf_counter(), unwrap_optimizer(kwargs["optimizer"])
            self.wait = self.opt.counters.device_wait_seconds

        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            if state.global_step > 1:
                run.seconds.append(time.perf_counter() - self.start)
                run.device_waits.append(self.opt.counters.device_wait_seconds - self.wait)

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=shape.steps, per_device_train_batch_size=shape.batch, learning_rate=1e-3,
            logging_steps=1, save_strategy="no", report_to="none", use_cpu=device == "cpu", disable_tqdm=True,
            seed=0, data_seed=0, bf16=True, gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False}, superoffload=True,
            superoffload_config={"host_kernel": "cpp", "speculation": "on", "device_buckets": 0})
        trainer = Trainer(model=build_model(shape, "cpu"), args=args, train_dataset=_Dataset(shape),
                          callbacks=[Timer()])
        trainer.train()
        opt = unwrap_optimizer(trainer.optimizer)
        run.losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        run.params = read(trainer.model)
        run.peak_device_bytes = opt.device_memory_peak()
        run.predicted_device_bytes = predicted_device_bytes(opt)
        run.host_adam = kernel_name(opt)
    return run


# ---- the comparison and the report ---------------------------------------------------------------


def compare(got: Run, want: Run, rtol: float, atol: float) -> tuple[float, list[str]]:
    """The largest absolute difference over the losses and every parameter element, and what
    differs beyond (rtol, atol), element by element (torch.testing.assert_close)."""
    problems, worst = [], 0.0
    if len(got.losses) != len(want.losses):
        return math.inf, [f"{len(got.losses)} losses against the reference's {len(want.losses)}"]
    pairs = [("the losses", torch.tensor(got.losses), torch.tensor(want.losses))]
    pairs += [(name, got.params[name], value) for name, value in want.params.items()]
    for name, g, w in pairs:
        worst = max(worst, (g - w).abs().max().item() if g.numel() else 0.0)
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
        except AssertionError as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            problems.append(f"{name}: " + "; ".join(lines[:3]))
    return worst, problems


def report(feature: str, shape: Shape, device: str, got: Run, want: Run | None, rtol: float, atol: float) -> dict:
    """`want` None (--no-reference): nothing compared; the run's own checks still count."""
    worst, problems = compare(got, want, rtol, atol) if want is not None else (math.nan, [])
    problems += [n[len("FAIL: "):] for n in got.notes + (want.notes if want is not None else []) if n.startswith("FAIL: ")]
    if not got.host_adam.startswith("host Adam cpp/"):
        problems.append(f"the host Adam that ran is not GraceAdam: {got.host_adam}")
    step_s = sorted(got.seconds)[len(got.seconds) // 2] if got.seconds else math.nan
    return {"feature": feature, "device": device, "shape": vars(shape), "steps_ran": len(got.losses),
            "reference_steps_ran": len(want.losses) if want is not None else None, "passed": not problems, "problems": problems,
            "max_abs_diff": worst, "rtol": rtol, "atol": atol,
            "tokens_per_second": shape.batch * shape.seq / step_s if step_s else math.nan,
            "device_idle_seconds_per_step": sum(got.device_waits) / max(len(got.device_waits), 1),
            "peak_device_bytes": got.peak_device_bytes, "predicted_device_bytes": got.predicted_device_bytes,
            "host_adam": got.host_adam, "losses": got.losses, "reference_losses": want.losses if want is not None else None,
            "notes": [n for n in got.notes if not n.startswith("FAIL: ")]}


def markdown(r: dict) -> str:
    peak = "n/a" if r["peak_device_bytes"] is None else f"{r['peak_device_bytes'] / 2**20:.1f}"
    verdict = "PASSED" if r["passed"] else "FAILED: " + "; ".join(r["problems"])
    return (f"- {r['feature']}: {r['steps_ran']} steps ran on {r['device']} "
            f"(seq {r['shape']['seq']} x batch {r['shape']['batch']}, {r['shape']['layers']} layers), "
            + (f"max |diff| from the CPU reference {r['max_abs_diff']:.3g} (rtol {r['rtol']:g}, atol {r['atol']:g}); "
               if r["reference_steps_ran"] is not None else "not compared (no reference run: the plain stage compares); ")
            + f"{r['tokens_per_second']:.0f} tokens/s, device idle {r['device_idle_seconds_per_step']:.4f} s/step, "
            f"peak device {peak} MiB (dry run's state {r['predicted_device_bytes'] / 2**20:.1f} MiB); "
            f"{'; '.join(r['notes']) + '; ' if r['notes'] else ''}{r['host_adam']}: {verdict}")


# (rtol, atol) on CUDA against the CPU: fp32 steps (TF32 off) a few ulp apart; bf16 a bf16 ulp
CUDA_TOLERANCE = {"flow": (1e-4, 1e-5), "activation_offload": (1e-4, 1e-5), "tiling": (1e-4, 1e-5),
                  "compact": (1.6e-2, 1e-3), "trainer": (1.6e-2, 1e-3)}
# the rest bitwise; tiling's chunks sum in another order: a hundredth of a step at lr 1e-3 after 3 steps
REHEARSE_TOLERANCE = {"tiling": (1e-5, 1e-5)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("feature", choices=FEATURES)
    p.add_argument("--out", required=True, help="folder for FEATURE.json and FEATURE.md")
    p.add_argument("--rehearse", action="store_true", help="tiny sizes, the CPU as the device")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the CPU reference (under the sanitizer: its stage checks the device run's streams; "
                        "the plain stage compares the numbers)")
    args = p.parse_args(argv)
    global REFERENCE
    REFERENCE = not args.no_reference
    device = "cpu" if args.rehearse else "cuda"
    if args.rehearse:
        torch.set_num_threads(1)  # the model and the host Adam pool share the cores
    shape = SHAPES[args.feature][0 if args.rehearse else 1]
    got, want = globals()[args.feature](shape, device, args.rehearse)
    rtol, atol = (REHEARSE_TOLERANCE.get(args.feature, (0.0, 0.0)) if args.rehearse
                  else CUDA_TOLERANCE[args.feature])
    result = report(args.feature, shape, device + (" (simulated)" if os.environ.get(SIM_ENV_VAR) == "1" else ""),
                    got, want, rtol, atol)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.feature}.json").write_text(json.dumps(result, indent=2))
    (out / f"{args.feature}.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    for problem in result["problems"]:
        print(f"FAIL: {args.feature}: {problem}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
