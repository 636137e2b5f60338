"""The `superoffload` command.

    superoffload train RECIPE.yaml [--dry-run] [--section.key value | --section.key=value ...]
    superoffload launch [accelerate launch arguments ...]

`train` runs a recipe (see superoffload_hf/recipe.py) with our Trainer: it prints what it
built, shows the Trainer's progress bar, saves safetensors checkpoints in training.output_dir,
resumes with `--training.resume_from_checkpoint true`, and ends with a summary. `--dry-run`
validates the recipe and prints it resolved and its memory (train/footprint.py), without loading
a model or data; `--num_processes N [--num_machines M]` makes that memory one rank's of N
data-parallel processes, and one host's. RECIPE may name a shipped recipe (`tiny_llama_cpu`;
`recipes` lists them). Before anything loads, the output directory must be writable and hold no
other run's checkpoints (train/output_dir.py), and hub names must be cached or reachable
(train/hub.py); Ctrl-C prints the step reached, the last complete checkpoint and the command that
resumes it, and exits 130. `launch` is `accelerate launch` with a superoffload config
(superoffload_hf.integrations.launcher).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.errors import CorruptStateError
from superoffload_hf.integrations.openmp_wait import set_openmp_waiting
from superoffload_hf.integrations.checkpoint_save import CheckpointSaveError
from superoffload_hf.integrations.resume import ResumeError
from superoffload_hf.train.catalog import resolve_recipe
from superoffload_hf.train.output_dir import OVERWRITE_FLAG
from superoffload_hf.train.recipe import DataSpec, ModelSpec, Recipe, RecipeError, TokenizerSpec, load_recipe
# the run itself; `train` is looked up here when called (tests replace it)
from superoffload_hf.train.run import TrainingInterrupted, train

USAGE = """usage: superoffload train RECIPE.yaml [--dry-run [--num_processes N [--num_machines M]]] [--timeline DIR]
                          [--sequence_parallel_size N]
                          [--overwrite_output_dir] [--section.key value ...]
       superoffload launch [accelerate launch arguments ...]
       superoffload recipes
       superoffload probe [--json FILE] [--recipe R.yaml]
       superoffload export-optimizer CHECKPOINT_DIR OUT.pt

commands:
  train    train the model a recipe describes; command-line keys override the YAML,
           e.g. `superoffload train recipes/tiny_llama_cpu.yaml --training.max_steps 20`;
           `--dry-run` validates it and prints the memory per buffer kind, with
           `--num_processes N` per rank of N data-parallel processes and per host
           (`--num_machines M`: N / M ranks on each host; default 1 machine); a new run into
           an output_dir that holds another run's checkpoints is refused unless it resumes
           (`--training.resume_from_checkpoint true`) or `--overwrite_output_dir` removes them;
           `--sequence_parallel_size N` (= `--superoffload.sequence_parallel_size N`) splits each
           sequence over N ranks (docs/sequence-parallel.md): start a multiple of N processes;
           `--timeline DIR` (= `--superoffload.timeline_dir DIR`) writes what each stream did in
           steps `superoffload.timeline_steps` [2, 3] to DIR: trace.json (open it in
           https://ui.perfetto.dev) and, with matplotlib, timeline.png (docs/measure.md)
           RECIPE is a YAML file or the name of a shipped recipe (`superoffload train tiny_llama_cpu`)
  launch   `accelerate launch` with a `superoffload:` block in the accelerate config
  recipes  list the shipped recipes
  probe    measure this machine's links, host and device Adam (and a recipe's backward);
           print the plan they imply (bucket size, device buckets, cast) and the step time
  export-optimizer  one file with every parameter's fp32 master and moments (the single-process
           state dict) from the per-rank shard files of a data-parallel checkpoint
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        set_openmp_waiting(os.environ, on_cpu=recipe_trains_on_cpu(argv[1:]))
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train_command(rest)
    if command == "launch":
        from superoffload_hf.integrations.launcher import main as launch_main

        return launch_main(rest)
    if command == "recipes":
        from superoffload_hf.train.catalog import recipes_listing

        print(recipes_listing())
        return 0
    if command == "probe":
        return probe_command(rest)
    if command == "export-optimizer":
        return export_optimizer_command(rest)
    print(f"superoffload: unknown command {command!r}; expected `train` or `launch` (or `recipes`, `probe`, "
          f"`export-optimizer`).\n\n{USAGE}", file=sys.stderr)
    return 2


def probe_command(argv: Sequence[str]) -> int:
    """`superoffload probe [--json FILE] [--recipe R.yaml] [--device cuda|cpu] [--threads N] [--quick]`:
    measure this machine (perf/probe.py) and print the plan the cost model derives; 0 on success,
    2 on a bad recipe or device."""
    import argparse
    import dataclasses
    import json

    parser = argparse.ArgumentParser(prog="superoffload probe", description=(
        "measure this machine (and, given a recipe, its model), then print the plan the cost model "
        "derives from the numbers"))
    parser.add_argument("--json", metavar="FILE", help="also write the measurements and the plan as JSON")
    parser.add_argument("--recipe", metavar="R.yaml", help="measure this recipe's model and print its plan")
    parser.add_argument("--device", help="cuda, cuda:1, cpu, ... (default: the accelerator, else cpu)")
    parser.add_argument("--threads", type=int, help="the host Adam's pool size (default: every core this process may use)")
    parser.add_argument("--quick", action="store_true", help="smaller and fewer measurements (seconds; for tests)")
    args = parser.parse_args(argv)
    import torch

    from superoffload_hf.perf.probe import probe

    try:
        recipe = load_recipe(args.recipe, []) if args.recipe else None
        report = probe(torch.device(args.device) if args.device else None, recipe, quick=args.quick,
                       threads=args.threads)
    except ValueError as exc:  # RecipeError, ConfigError and a device torch cannot use are ValueErrors
        print(f"superoffload probe: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a hub model's config that cannot be fetched (offline) or read
        print(f"superoffload probe: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as exc:
        print(f"superoffload probe: error: the recipe's model does not fit on the device for a plain forward "
              f"and backward of one micro-batch ({str(exc).splitlines()[0]}); lower "
              "`training.per_device_train_batch_size` or `data.seq_len` in the recipe, or turn on "
              "`training.activation_checkpointing`.", file=sys.stderr)
        return 2
    print(report.format())
    if args.json:
        Path(args.json).write_text(json.dumps(dataclasses.asdict(report), indent=1, default=str) + "\n")
    return 0


def export_optimizer_command(argv: Sequence[str]) -> int:
    """`superoffload export-optimizer CHECKPOINT_DIR OUT.pt`: 0 on success, 2 on bad input."""
    from superoffload_hf.engine.dp.checkpoint import export_consolidated

    usage = ("usage: superoffload export-optimizer CHECKPOINT_DIR OUT.pt\n\nwrite one file with every parameter's "
             "fp32 master and moments (the single-process state dict) from the per-rank shard files of a "
             "data-parallel checkpoint")
    if list(argv[:1]) in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(argv) != 2:
        print(usage, file=sys.stderr)
        return 2
    try:
        sd = export_consolidated(argv[0], argv[1])
    except (FileNotFoundError, ValueError, CorruptStateError) as error:
        print(f"superoffload export-optimizer: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {argv[1]}: {len(sd['state'])} parameters' fp32 master, exp_avg and exp_avg_sq")
    return 0


def recipe_trains_on_cpu(argv: Sequence[str]) -> bool:
    """`training.use_cpu` of `superoffload train RECIPE [overrides]`, read without torch (the YAML
    and a `--training.use_cpu` override); False when it cannot be read (the run reports why)."""
    from superoffload_hf.yaml12 import load_yaml

    value = None
    try:
        value = ((load_yaml(resolve_recipe(argv[0]).read_text()) or {}).get("training") or {}).get("use_cpu")
    except Exception:  # a missing or broken recipe: train_command says what is wrong
        pass
    for i, token in enumerate(argv):
        if token == "--training.use_cpu" and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith("--training.use_cpu="):
            value = token.split("=", 1)[1]
    return str(value).lower() in ("true", "1", "yes")


def timeline_overrides(tokens: list[str]) -> list[str]:
    """`--timeline DIR` (or `--timeline=DIR`) is `--superoffload.timeline_dir DIR`: write the step
    timeline (trace.json, timeline.png) of steps `superoffload.timeline_steps` to DIR."""
    out, i = [], 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--timeline" or token.startswith("--timeline="):
            if token == "--timeline":
                if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                    raise ValueError("`--timeline` needs a directory, e.g. `--timeline out/timeline`.")
                value, i = tokens[i + 1], i + 2
            else:
                value, i = token.split("=", 1)[1], i + 1
            out += ["--superoffload.timeline_dir", value]
            continue
        out.append(token)
        i += 1
    return out


def process_count_options(tokens: list[str]) -> tuple[list[str], int, int]:
    """`--num_processes N` and `--num_machines M` (or `--name=value`), the names `superoffload
    launch` takes: the data-parallel run the `--dry-run` memory is for. The other tokens, N, M."""
    values = {"num_processes": 1, "num_machines": 1}
    out, i = [], 0
    while i < len(tokens):
        name, eq, text = tokens[i][2:].partition("=") if tokens[i].startswith("--") else ("", "", "")
        if name not in values:
            out.append(tokens[i])
            i += 1
            continue
        if not eq:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ValueError(f"`--{name}` needs a value: an integer >= 1, e.g. `--{name} 8`.")
            text, i = tokens[i + 1], i + 1
        i += 1
        if not re.fullmatch(r"[0-9]+", text.strip()) or int(text) < 1:
            raise ValueError(f"`--{name}` is {text!r}; expected an integer >= 1 (the number of "
                             f"{'processes, one per GPU' if name == 'num_processes' else 'hosts the processes run on'}"
                             f"), e.g. `--{name} 8`.")
        values[name] = int(text)
    n, m = values["num_processes"], values["num_machines"]
    if n % m:
        raise ValueError(f"`--num_machines` is {m} but `--num_processes` is {n}; expected a divisor of "
                         f"{n} (the same number of processes on every machine), e.g. `--num_machines 1`.")
    return out, n, m


SEQUENCE_PARALLEL_FLAG = "--sequence_parallel_size"


def sequence_parallel_option(tokens: list[str]) -> list[str]:
    """`--sequence_parallel_size N` (or `=N`) as the recipe override it names."""
    out, i = [], 0
    while i < len(tokens):
        name, eq, text = tokens[i].partition("=")
        if name != SEQUENCE_PARALLEL_FLAG:
            out.append(tokens[i])
            i += 1
            continue
        if not eq:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ValueError(f"`{SEQUENCE_PARALLEL_FLAG}` needs a value: an integer >= 1, e.g. "
                                 f"`{SEQUENCE_PARALLEL_FLAG} 2`.")
            text, i = tokens[i + 1], i + 1
        out.append(f"--superoffload.sequence_parallel_size={text}")  # validated with the recipe
        i += 1
    return out


def sequence_parallel_check(recipe: Recipe, dry_run: bool, num_processes: int, argv0: str) -> Optional[str]:
    """The dry run's DP x SP line; in a real run of one process, a size above 1 is refused."""
    from superoffload_hf.config import check_sequence_parallel_size

    size = (recipe.superoffload or {}).get("sequence_parallel_size", 1)
    world = num_processes if dry_run else int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return None
    if not dry_run and world == 1:
        raise ConfigError(
            f"`sequence_parallel_size` is {size}: each sequence is split over {size} processes, and `superoffload "
            f"train` itself starts one. Start {size} (or a multiple) with `torchrun --nproc_per_node {size} -m "
            f"superoffload_hf.cli train {argv0} --sequence_parallel_size {size} ...` (gloo on CPUs, NCCL on GPUs), "
            f"or set `sequence_parallel_size: 1`.")
    check_sequence_parallel_size(size, world)
    return (f"parallelism: {world} processes = data parallel {world // size} x sequence parallel {size} "
            f"(each sequence split over {size} ranks; host state sharded over all {world})")


def train_command(argv: Sequence[str]) -> int:
    """`superoffload train RECIPE.yaml [--dry-run] [overrides]`: 0 on success, 2 on a bad recipe."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE + "\n" + recipe_keys_help())
        return 0
    if not argv or argv[0].startswith("--"):
        print(USAGE, file=sys.stderr)
        return 2
    dry_run = "--dry-run" in argv[1:]
    overwrite = OVERWRITE_FLAG in argv[1:]
    try:
        tokens, num_processes, num_machines = process_count_options(
            [t for t in argv[1:] if t not in ("--dry-run", OVERWRITE_FLAG)])
        given = [t for t in argv[1:] if t.split("=")[0] in ("--num_processes", "--num_machines")]
        if given and not dry_run:
            raise ValueError(f"`{given[0].split('=')[0]}` sizes the memory that `--dry-run` prints; `superoffload "
                             "train` itself starts one process. Add `--dry-run`, or start N training processes "
                             f"with `torchrun --nproc_per_node N -m superoffload_hf.cli train {argv[0]} ...` "
                             "(data parallel: each rank holds 1/N of the host state; gloo on CPUs, NCCL on GPUs).")
        overrides = timeline_overrides(sequence_parallel_option(tokens))
    except ValueError as exc:
        print(f"superoffload train: error: {exc}", file=sys.stderr)
        return 2
    recipe = None
    try:
        recipe = load_recipe(resolve_recipe(argv[0]), overrides)
        for warning in recipe.warnings:
            print(f"superoffload train: warning: {warning}", file=sys.stderr)
        check_output_dir(recipe, dry_run, overwrite)
        split = sequence_parallel_check(recipe, dry_run, num_processes, argv[0])
        if dry_run:
            from superoffload_hf.train.footprint import memory_report

            print(_dump_yaml(recipe.to_dict()), end="")
            print(memory_report(recipe, num_processes, num_machines))
            if split is not None:
                print(split)
            return 0
        from superoffload_hf.train.hub import check_hub_names_reachable

        check_hub_names_reachable(recipe)
        summary = train(recipe)
    except (TrainingInterrupted, KeyboardInterrupt) as exc:
        report = "superoffload train: interrupted" if recipe is None else interrupted_report(
            argv, recipe, getattr(exc, "step", None))
        print(report, file=sys.stderr, flush=True)
        return 130
    except (RecipeError, ConfigError, CorruptStateError, ResumeError) as exc:
        print(f"superoffload train: error: {exc}", file=sys.stderr)
        return 2
    except CheckpointSaveError as exc:
        print(f"superoffload train: error: {exc}", file=sys.stderr)
        return 1
    print(summary.format())
    return 0


def interrupted_report(argv: Sequence[str], recipe: Recipe, step: Optional[int]) -> str:
    """What Ctrl-C left: the step reached, the newest complete checkpoint, the command that resumes it."""
    from superoffload_hf.integrations.resume import last_complete_checkpoint

    output_dir = recipe.training["output_dir"]
    checkpoint, _ = last_complete_checkpoint(output_dir)
    reached = "before the first step" if step is None else f"at step {step}"
    max_steps = recipe.training.get("max_steps", -1)
    lines = [f"superoffload train: interrupted {reached}" + (f" (of {max_steps})" if max_steps > 0 else "")]
    if checkpoint is None:
        lines += [f"  last complete checkpoint  none in {output_dir} (one every {recipe.training.get('save_steps', 500)} steps)",
                  f"  start again with          {shlex.join(['superoffload', 'train', *argv])}"]
        return "\n".join(lines)
    lines += [f"  last complete checkpoint  {checkpoint}",
              f"  resume with               {shlex.join(['superoffload', 'train', *resume_arguments(argv)])}"]
    return "\n".join(lines)


def resume_arguments(argv: Sequence[str]) -> list[str]:
    """`argv` of `superoffload train` with `--training.resume_from_checkpoint true` in place of any
    resume or `--overwrite_output_dir` it had (the run continues where its checkpoints are)."""
    out, skip_value = [], False
    for token in argv:
        if skip_value:
            skip_value = False
        elif token == "--training.resume_from_checkpoint":
            skip_value = True
        elif token != OVERWRITE_FLAG and not token.startswith("--training.resume_from_checkpoint="):
            out.append(token)
    return out + ["--training.resume_from_checkpoint", "true"]


def check_output_dir(recipe: Recipe, dry_run: bool, overwrite: bool) -> None:
    """`training.output_dir` writable, and free of another run's checkpoints unless this run resumes
    or `--overwrite_output_dir` removes them (a dry run only warns: it writes nothing there)."""
    from superoffload_hf.train.output_dir import (
        OutputDirError, check_no_previous_run, check_writable, remove_previous_run)

    output_dir = Path(recipe.training["output_dir"]).expanduser()
    resuming = recipe.training.get("resume_from_checkpoint") not in (None, False)
    if overwrite and resuming:
        raise OutputDirError(f"`{OVERWRITE_FLAG}` would remove the checkpoints that "
                             "`training.resume_from_checkpoint` resumes from; drop one of the two.")
    check_writable(output_dir)
    try:
        check_no_previous_run(output_dir, resuming, overwrite)
    except OutputDirError as exc:
        if not dry_run:
            raise
        print(f"superoffload train: warning: {exc}", file=sys.stderr)
    if overwrite and not dry_run:
        for path in remove_previous_run(output_dir):
            print(f"superoffload train: {OVERWRITE_FLAG}: removed {path}", flush=True)


def recipe_keys_help() -> str:
    """The recipe sections and their keys (defaults in brackets), for `superoffload train --help`."""
    import dataclasses

    def keys(cls) -> str:
        return ", ".join(f.name if f.default is dataclasses.MISSING else f"{f.name} [{f.default}]"
                         for f in dataclasses.fields(cls) if f.init)

    return "\n".join([
        "recipe sections and keys (override any with --section.key value; every key: docs/config.md):",
        f"  model:         {keys(ModelSpec)}   (exactly one of config / name_or_path)",
        f"  tokenizer:     {keys(TokenizerSpec)}",
        f"  data:          {keys(DataSpec)}   (exactly one of shipped_corpus / name / files)",
        "  training:      any transformers.TrainingArguments field (output_dir required), plus",
        "                 resume_from_checkpoint [true: newest complete checkpoint | a directory] and",
        "                 resume_weights_only [false: refuse a checkpoint without optimizer state]",
        f"  superoffload:  {', '.join(SuperOffloadConfig.field_names())}   (or false: stock optimizer)",
        "",
    ])


def _dump_yaml(values: dict) -> str:
    import yaml

    return yaml.safe_dump(values, sort_keys=False, default_flow_style=False)


if __name__ == "__main__":
    sys.exit(main())
