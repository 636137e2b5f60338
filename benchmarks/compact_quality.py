"""Does compact host state train as well as fp32? Loss curves of the tiny recipe and a ~20M Llama.

    python benchmarks/compact_quality.py                        # both models, 1000 steps, seeds 0,1,2
    python benchmarks/compact_quality.py --models tiny-recipe --steps 40 --seeds 0,1 --json q.json --png q.png

Every run is the tiny recipe (recipes/tiny_llama_cpu.yaml, built as `superoffload train` builds
it: shipped tokenizer and corpus, our Trainer) on the CPU with `device_dtype: bf16` (compact state
needs it; fp32 state gets the same bf16 device weights, so state precision is the only
difference), checkpoints off. The ~20M model is the same recipe with a wider, deeper
`model.config` and a smaller batch (MODELS). Contenders, all from the same bf16 init and the
same batches for one seed:

* **fp32**: `state_precision: fp32` (fp32 master, exp_avg, exp_avg_sq);
* **compact**: `state_precision: compact` (bf16 weight + int8 error term, int8 m, uint8 sqrt(v));
* **compact32**: `state_precision: compact32` (int16 error term);
* **bf16-rtn**: a baseline that is no product config: `superoffload: false` (the stock Trainer
  path on the same CPU) with `Bf16RoundToNearestAdamW` below, AdamW whose master *is* the bf16
  weight, rounded to nearest after each step (fp32 moments): what the error term buys.

Runs go seed-major (each seed runs every contender before the next seed), so the load of a
shared machine falls on all alike. Each finished run is written to the results JSON at once,
keyed by (model, contender, seed) with the settings it ran with; a later invocation reuses the
runs whose settings match and runs only the rest (a crash loses only the run in progress).

Final loss of a run: the mean of its logged losses (every `--log-every` steps, each the mean
over those steps) over the last `--final-window` steps. Target, per model, for each compact
contender: the mean over seeds of its final loss lies within the fp32 seeds' range [min, max]
or within 1% of their mean. A miss exits 2 (unless --no-check); a non-finite loss exits 1;
`--report-only` with runs missing reports the seeds complete so far and exits 3 (no verdict).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_llama_cpu.yaml"
REL_TOL = 0.01  # "within 1% of the fp32 mean"
CONTENDERS = ("fp32", "compact", "compact32", "bf16-rtn")
CHECKED = ("compact", "compact32")  # the contenders the target applies to

# Recipe overrides per model (on top of the tiny recipe). The 20M model's batch is small so that
# a 1000-step run takes minutes on 2 cores: 4 x 64 tokens a step.
MODELS = {
    "tiny-recipe": [],
    "llama-20m": ["--model.config.hidden_size", "512", "--model.config.intermediate_size", "1408",
                  "--model.config.num_hidden_layers", "6", "--model.config.num_attention_heads", "8",
                  "--model.config.num_key_value_heads", "4", "--model.config.max_position_embeddings", "64",
                  "--data.seq_len", "64", "--training.per_device_train_batch_size", "4",
                  "--training.learning_rate", "1.0e-3"],
}


class Bf16RoundToNearestAdamW(torch.optim.Optimizer):
    """AdamW on bf16 parameters whose master is the bf16 weight itself: each step computes the
    fp32 update from fp32 moments and the weight widened to fp32, then stores the weight rounded
    to nearest even (`Tensor.copy_` into bf16). Updates smaller than half a bf16 ulp are lost:
    the baseline the compact error term is measured against. Same coefficients as torch AdamW."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.bfloat16:
                    raise TypeError(f"Bf16RoundToNearestAdamW got a {p.dtype} parameter; expected torch.bfloat16 "
                                    "(build the model with `--model.dtype bfloat16`).")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                g = p.grad.float()
                w = p.float().mul_(1.0 - lr * wd)
                m.lerp_(g, 1.0 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                denom = (v.sqrt() / math.sqrt(1.0 - beta2**t)).add_(eps)
                w.addcdiv_(m, denom, value=-lr / (1.0 - beta1**t))
                p.copy_(w)  # fp32 -> bf16, round to nearest even
        return loss


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated subset of {', '.join(CONTENDERS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--log-every", type=int, default=10, help="training.logging_steps")
    p.add_argument("--final-window", type=int, default=50, help="steps at the end whose logged losses make the final loss")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "compact_quality.json"))
    p.add_argument("--png", default=str(ROOT / "benchmarks" / "compact_quality.png"))
    p.add_argument("--override", action="append", default=[], metavar="--section.key=value",
                   help="extra recipe override for every run (e.g. `--override=--model.config.hidden_size=64`)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads before training (default: torch's own; 1 on a loaded machine)")
    p.add_argument("--no-check", action="store_true", help="report only; never exit 2 on a missed target")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: report, plot and check the runs the JSON holds (while some are missing: the seeds complete for every contender, then exit 3)")
    args = p.parse_args(argv)
    args.models = _subset(p, "--models", args.models, MODELS)
    args.contenders = _subset(p, "--contenders", args.contenders, CONTENDERS)
    if "fp32" not in args.contenders:
        p.error("--contenders must include fp32 (the reference of the target)")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.final_window % args.log_every or args.final_window > args.steps:
        p.error(f"--final-window is {args.final_window}; expected a multiple of --log-every ({args.log_every}) "
                f"and at most --steps ({args.steps})")
    return args


def _subset(p, flag, text, valid):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown:
        p.error(f"{flag}: unknown {unknown}; valid: {list(valid)}")
    return names


# ---- one run ------------------------------------------------------------------------------------


def run_overrides(model: str, contender: str, seed: int, args) -> list[str]:
    """The recipe overrides of one run (its identity in the results cache, with the step count)."""
    common = ["--training.max_steps", str(args.steps), "--training.logging_steps", str(args.log_every),
              "--training.seed", str(seed), "--training.save_strategy", "no", "--training.report_to", "none",
              "--training.disable_tqdm", "true"]
    if contender == "bf16-rtn":
        precision = ["--superoffload", "false", "--model.dtype", "bfloat16"]
    else:
        precision = ["--superoffload.device_dtype", "bf16", "--superoffload.state_precision", contender]
    extra = [token for item in args.override for token in item.split("=", 1)]
    return MODELS[model] + common + precision + extra


def train_one(overrides: list[str], contender: str) -> dict:
    """Train one run in this process; its logged losses, parameter count and wall time."""
    from transformers import TrainerCallback, default_data_collator, set_seed

    from superoffload_hf import Trainer
    from superoffload_hf.train.run import build_model, build_tokenizer, build_training_arguments
    from superoffload_hf.train.data import build_dataset
    from superoffload_hf.train.recipe import load_recipe

    losses: list[tuple[int, float]] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append((state.global_step, float(logs["loss"])))

    with tempfile.TemporaryDirectory(prefix="compact_quality_") as out:
        recipe = load_recipe(RECIPE, overrides + ["--training.output_dir", out])
        args = build_training_arguments(recipe)
        set_seed(args.seed)
        tokenizer = build_tokenizer(recipe)
        model = build_model(recipe, tokenizer)
        dataset = build_dataset(recipe.data, tokenizer)
        trainer_cls = _bf16_rtn_trainer() if contender == "bf16-rtn" else Trainer
        trainer = trainer_cls(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
                              processing_class=tokenizer, callbacks=[Record()])
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # under Accelerate's wrapper
        host_state = optimizer.host_state() if hasattr(optimizer, "host_state") else "bf16 master (benchmark-side)"
        if hasattr(optimizer, "close"):
            optimizer.close()  # frees the host buffers before the next run
    return {"steps": [s for s, _ in losses], "loss": [l for _, l in losses], "wall_s": round(wall, 1),
            "params": sum(p.numel() for p in model.parameters()), "host_state": host_state}


def trainer_param_groups(trainer, model) -> list[dict]:
    """`model`'s trainable parameters grouped as the Trainer groups them: weight decay except on
    the names `get_decay_parameter_names` leaves out (biases, norms)."""
    decay = set(trainer.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": trainer.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def _bf16_rtn_trainer():
    from superoffload_hf import Trainer

    class _Bf16RtnTrainer(Trainer):
        """The stock Trainer path (`superoffload: false`) with Bf16RoundToNearestAdamW, grouped as
        the Trainer groups (no weight decay on biases and norms)."""

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                groups = trainer_param_groups(self, self.model if model is None else model)
                self.optimizer = Bf16RoundToNearestAdamW(groups, lr=self.args.learning_rate, eps=self.args.adam_epsilon,
                                                         betas=(self.args.adam_beta1, self.args.adam_beta2))
            return self.optimizer

    return _Bf16RtnTrainer


# ---- results, target, report --------------------------------------------------------------------


def load_results(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"runs": {}}


def save_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)  # a crash mid-write leaves the previous file


def run_key(model: str, contender: str, seed: int) -> str:
    return f"{model}/{contender}/{seed}"


def final_loss(run: dict, window: int) -> float:
    """Mean of the logged losses whose steps lie in the last `window` steps of the run."""
    last = run["steps"][-1]
    tail = [l for s, l in zip(run["steps"], run["loss"]) if s > last - window]
    if not tail:
        raise ValueError(f"a run logged no loss in its last {window} steps (steps logged: {run['steps'][-3:]})")
    return statistics.fmean(tail)


def verdict(fp32_finals: list[float], finals: list[float], rel_tol: float = REL_TOL) -> dict:
    """The target for one contender on one model: the mean of its finals within the fp32
    finals' [min, max] or within rel_tol of their mean."""
    ref_mean, mean = statistics.fmean(fp32_finals), statistics.fmean(finals)
    in_spread = min(fp32_finals) <= mean <= max(fp32_finals)
    rel = (mean - ref_mean) / ref_mean
    return {"mean": mean, "fp32_mean": ref_mean, "fp32_min": min(fp32_finals), "fp32_max": max(fp32_finals),
            "rel_to_fp32_mean": rel, "in_spread": in_spread, "within_rel_tol": abs(rel) <= rel_tol,
            "ok": in_spread or abs(rel) <= rel_tol}


def summarize(results: dict, models, contenders, seeds, window: int) -> dict:
    """Per model and contender: finals per seed, mean, and (compact contenders) the verdict."""
    out = {}
    for model in models:
        finals = {c: [final_loss(results["runs"][run_key(model, c, s)], window) for s in seeds] for c in contenders}
        rows = {}
        for c in contenders:
            row = {"finals": finals[c], "mean": statistics.fmean(finals[c]),
                   "paired_vs_fp32": [f - r for f, r in zip(finals[c], finals["fp32"])]}
            if c != "fp32":
                row["verdict"] = verdict(finals["fp32"], finals[c])
            rows[c] = row
        out[model] = rows
    return out


def report(results: dict, summary: dict, seeds) -> str:
    lines = [f"final loss (mean of the logged losses of the last {results['final_window']} of "
             f"{results['steps']} steps), seeds {', '.join(map(str, seeds))}", "",
             "| model | params | contender | final loss per seed | mean | vs fp32 mean | minus fp32, same seed | target |",
             "| --- | ---: | --- | --- | ---: | ---: | --- | --- |"]
    for model, rows in summary.items():
        params = results["runs"][run_key(model, "fp32", seeds[0])]["params"]
        for c, row in rows.items():
            v = row.get("verdict")
            rel = "" if v is None else f"{100 * v['rel_to_fp32_mean']:+.2f}%"
            target = "" if c not in CHECKED else ("ok" if v["ok"] else "MISSED") + (
                " (in fp32 range)" if v["in_spread"] else "")
            lines.append(f"| {model} | {params / 1e6:.2f}M | {c} | {' / '.join(f'{f:.4f}' for f in row['finals'])} "
                         f"| {row['mean']:.4f} | {rel} | {' / '.join(f'{d:+.4f}' for d in row['paired_vs_fp32'])} "
                         f"| {target} |")
    return "\n".join(lines)


def plot(results: dict, models, contenders, seeds, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fp32": "black", "compact": "tab:blue", "compact32": "tab:green", "bf16-rtn": "tab:red"}
    fig, axes = plt.subplots(2, len(models), figsize=(5.2 * len(models), 6.4), squeeze=False)
    for col, model in enumerate(models):
        for row, zoom in enumerate((False, True)):
            ax = axes[row][col]
            for c in contenders:
                for i, s in enumerate(seeds):
                    run = results["runs"][run_key(model, c, s)]
                    steps, loss = run["steps"], run["loss"]
                    if zoom:
                        keep = [j for j, st in enumerate(steps) if st > 0.6 * steps[-1]]
                        steps, loss = [steps[j] for j in keep], [loss[j] for j in keep]
                    ax.plot(steps, loss, color=colors[c], lw=0.9, alpha=0.8, label=c if i == 0 else None)
            ax.set_xlabel("step")
            ax.set_ylabel("training loss")
            params = results["runs"][run_key(model, "fp32", seeds[0])]["params"]
            ax.set_title(f"{model} ({params / 1e6:.1f}M)" + (": last 40%" if zoom else ""), fontsize=10)
            ax.grid(alpha=0.3)
            if not zoom:
                ax.legend(fontsize=8)
    fig.suptitle(f"compact vs fp32 host state, bf16 device weights, {len(seeds)} seeds each", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    path = Path(args.json)
    results = load_results(path)
    results.update(steps=args.steps, final_window=args.final_window, log_every=args.log_every,
                   machine=f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for model in ([] if args.report_only else args.models):
        for seed in args.seeds:  # seed-major: every contender of a seed before the next seed
            for contender in args.contenders:
                key, overrides = run_key(model, contender, seed), run_overrides(model, contender, seed, args)
                cached = results["runs"].get(key)
                if cached is not None and cached.get("overrides") == overrides:
                    continue
                print(f"compact_quality: {key} ...", flush=True)
                run = train_one(overrides, contender)
                run["overrides"] = overrides
                if not all(math.isfinite(l) for l in run["loss"]):
                    print(f"compact_quality: {key} logged a non-finite loss: {run['loss'][-5:]}", file=sys.stderr)
                    return 1
                results["runs"][key] = run
                save_results(path, results)
                print(f"compact_quality: {key} final {final_loss(run, args.final_window):.4f} "
                      f"in {run['wall_s']:.0f} s", flush=True)
    def have(m, c, s):
        return results["runs"].get(run_key(m, c, s), {}).get("overrides") == run_overrides(m, c, s, args)

    missing = [run_key(m, c, s) for m in args.models for s in args.seeds for c in args.contenders if not have(m, c, s)]
    seeds = [s for s in args.seeds if all(have(m, c, s) for m in args.models for c in args.contenders)]
    if missing:
        print(f"compact_quality: {len(missing)} runs missing (or run with other settings): {', '.join(missing)}; "
              "run without --report-only to train them" + (f"; reporting seeds {seeds} only" if seeds else ""),
              file=sys.stderr)
        if not seeds:
            return 3
    summary = summarize(results, args.models, args.contenders, seeds, args.final_window)
    results["summary"] = dict(summary, seeds=seeds, complete=not missing)
    save_results(path, results)
    print(report(results, summary, seeds))
    if args.png:
        plot(results, args.models, args.contenders, seeds, Path(args.png))
        print(f"wrote {args.png} and {path}")
    missed = [f"{m}/{c}" for m, rows in summary.items() for c, row in rows.items()
              if c in CHECKED and not row["verdict"]["ok"]]
    if missed and not args.no_check:
        print(f"compact_quality: target missed by {', '.join(missed)}: the mean final loss lies outside the fp32 "
              f"seeds' range and more than {100 * REL_TOL:.0f}% from their mean", file=sys.stderr)
        return 2
    if missing:
        return 3  # incomplete: no verdict on the seeds asked for
    return 0


if __name__ == "__main__":
    sys.exit(main())
