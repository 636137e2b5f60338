"""`superoffload train --dry-run`: the memory the run will need, per buffer kind, computed by
the engine's own allocation arithmetic (plan.layout.estimate) for the model built on the
meta device: nothing is downloaded but the model's config.json (read from a local directory or
the local hub cache), and no byte of the model is allocated.

`--num_processes N` (and `--num_machines M`, as `superoffload launch` takes them) prints one
rank's memory under data parallelism over N ranks, each holding 1/N of every host bucket's
state (plan.layout.estimate with a shard world of N: the arithmetic the engine sizes its
buffers with under data parallelism), and the total of the N / M ranks that share a host."""

from __future__ import annotations

import dataclasses

from typing import Any, Optional

from superoffload_hf.plan.activations import device_activations
from superoffload_hf.train.recipe import Recipe, checkpointing_on


def memory_report(recipe: Recipe, num_processes: int = 1, num_machines: int = 1) -> str:
    """The memory table of `recipe`; with `num_processes` > 1, one rank's and one host's."""
    if recipe.superoffload is None:
        return "memory: not estimated (superoffload: false runs the stock optimizer)"
    import torch
    from transformers import AutoModelForCausalLM

    from superoffload_hf.config import SuperOffloadConfig
    from superoffload_hf.plan.layout import estimate_layout
    from superoffload_hf.plan.layout import DTYPES
    from superoffload_hf.plan.memory import footprint, format_footprint
    from superoffload_hf.parallel.activation_offload import dry_run_line as activation_offload_line
    from superoffload_hf.parallel.activation_offload import dry_run_pinned_bytes as activation_pinned_bytes

    model_config, shipped = _model_config(recipe)
    if model_config is None:
        name = recipe.model.name_or_path
        return (f"memory: not estimated: the config.json of {name!r} is not available locally "
                f"(`hf download {name} config.json` on a machine with network fetches it; or set `model.name_or_path` to a local directory with its config.json)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=getattr(torch, recipe.model_dtype))
    params = [p for p in model.parameters() if p.requires_grad]
    t = recipe.training
    hyper = dict(lr=float(t.get("learning_rate", 5e-5)), betas=(float(t.get("adam_beta1", 0.9)),
                 float(t.get("adam_beta2", 0.999))), eps=float(t.get("adam_epsilon", 1e-8)))
    decay = [p for p in params if p.ndim >= 2]  # as the Trainer groups them (norms, biases: no decay)
    groups = [g for g in ({"params": decay, "weight_decay": float(t.get("weight_decay", 0.0)), **hyper},
                          {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, **hyper}) if g["params"]]
    config = SuperOffloadConfig.coerce(recipe.superoffload)
    accelerator = not t.get("use_cpu", False)
    shard_world = num_processes if num_processes > 1 else None  # one process: no data parallelism
    plan, policy = estimate_layout(params, groups, config, accelerator, int(t.get("gradient_accumulation_steps", 1)),
                                   shard_world=shard_world)
    n = sum(p.numel() for p in params)
    trade = dry_run_trade(plan, policy, config.speculation, not accelerator, host_budget=config.host_memory_budget)
    rows = footprint(plan, policy)  # every snapshot counted: the trade lines say what auto drops
    where = "an accelerator (cast auto = host, device_buckets auto = 0)" if accelerator else "the CPU"
    lines = [f"memory: {n / 1e9:.3f}B parameters, {len(plan.buckets)} buckets, on {where}; "
             "activations (after the table) and the device gradients of the model not included"]
    if shipped is not None:
        lines.append(f"  architecture from the shipped {shipped / 'config.json'} (no local copy of "
                     f"{recipe.model.name_or_path}'s config.json)")
    if shard_world is not None:
        lines.append(f"memory per rank, data parallel over {num_processes} processes (each rank holds "
                     f"1/{num_processes} of every host bucket's master, moments and gradient staging):")
    lines.append(format_footprint(rows, n))
    lines.append(state_line(rows, config.state_precision, n, shard_world))
    if trade.applies:
        against = ("this machine's memory now" if config.host_memory_budget is None else
                   f"`host_memory_budget` ({config.host_memory_budget / 2**30:.2f} GiB) less this process's resident memory")
        lines.append(f"  {trade.describe(n)} with {against}; after step 1 the engine decides "
                     "again, also from the measured host bandwidth and backward time")
        on_128 = dry_run_trade(plan, policy, config.speculation, not accelerator, memory_left=HOST_SIZES[0][0])
        lines.append(f"  on {HOST_SIZES[0][1]}: speculates {on_128.speculated_buckets} of {on_128.host_buckets} "
                     f"host buckets ({on_128.reason})")
    config = with_recipe_activations(config, recipe, model_config, accelerator, n)  # what weights auto counts
    lines.append(weights_line(model, params, config))
    lines.append(activation_offload_line(recipe, model_config, config.activation_offload,
                                         DTYPES[config.device_dtype].itemsize, not accelerator))
    tokens = int(t.get("per_device_train_batch_size", 8)) * recipe.data.seq_len
    if accelerator and shard_world is None:
        lines.append(flow_choice_lines(model, params, groups, config, tokens,
                                       int(t.get("gradient_accumulation_steps", 1))))
    lines.extend(activation_lines(model_config, recipe, config, accelerator, n))
    element_bytes = DTYPES[config.device_dtype].itemsize
    lines.append(host_check_line(rows, not accelerator, activation_pinned_bytes(
        recipe, model_config, config.activation_offload, element_bytes, not accelerator,
        max(H200_BYTES - n * element_bytes, 0)), config.host_memory_budget))
    if shard_world is not None:
        lines.append(per_host_lines(rows, num_processes // num_machines, num_machines, not accelerator))
    return "\n".join(lines)


def state_line(rows, state_precision: str, num_params: int, shard_world: Optional[int]) -> str:
    """The host state's precision and bytes per parameter (the rows of its kinds), and what the
    rollback snapshot of speculated buckets costs."""
    from superoffload_hf.plan.memory import COMPACT_KINDS, STATE_KINDS

    kinds = STATE_KINDS if state_precision == "fp32" else COMPACT_KINDS
    state = sum(r.nbytes for r in rows if r.what in kinds) / max(num_params, 1)
    snapshot = sum(r.nbytes for r in rows if r.what == "snapshot") / max(num_params, 1)
    line = f"  host state {state_precision} {state:.3f} B/param"  # (no ": ": the output reads as YAML)
    if snapshot:
        what = "the compact bytes" if state_precision != "fp32" else "master and moments"
        line += f"; rollback keeps a snapshot of {what} of speculated buckets ({snapshot:.3f} B/param"
        line += ", none with speculation off)" if state_precision != "fp32" else ")"
    return line


def dry_run_trade(plan, policy, mode: str, device_is_host: bool, memory_left: Optional[int] = None,
                  host_budget: Optional[int] = None):
    """The snapshot trade of `speculation: auto` (plan/snapshot_trade.py) as the engine decides
    it at construction: against the memory this process may use now (`host_budget`, config
    `host_memory_budget`, when set: engine/host_limit.py), or `memory_left` bytes."""
    from superoffload_hf.engine.host_limit import engine_trade
    from superoffload_hf.plan.memory import footprint, host_bytes, replan_transient
    from superoffload_hf.plan.snapshot_trade import snapshot_trade

    if memory_left is not None:
        rows = footprint(plan, policy, frozenset())
        other = host_bytes(rows, device_is_host) + replan_transient(rows)
        return snapshot_trade(plan, policy, mode, memory_left=memory_left, other_bytes=other,
                              overlaps=not device_is_host)

    class _ThisHost:  # the dry run has no runtime: the memory limits of this process
        host_is_device = device_is_host

    return engine_trade(plan, policy, mode, _ThisHost(), check_memory=True, host_budget=host_budget)


def weights_line(model, params, config) -> str:
    """Which units flow (plan/flow.py plan_flow: the blocks, the embedding, the head) and the
    device's weights with and without weight-flow (`weights` "auto" decides at construction,
    against the device's free memory)."""
    from superoffload_hf.plan.flow import plan_flow
    from superoffload_hf.plan.layout import DTYPES

    weights, element_bytes = config.weights, DTYPES[config.device_dtype].itemsize
    plan = plan_flow(model, params, element_bytes=element_bytes)
    stationary = sum(p.numel() for p in params) * element_bytes  # (on the CPU device: the masters themselves)
    flowing = stationary - plan.nbytes + plan.peak_bytes  # units kept on the device stay
    chosen = {"stationary": "stationary", "flow": "flow", "auto": "auto (flow if the stationary device memory does "
              "not fit the free device memory at construction)"}[weights]
    names = [u.name for u in plan.units]
    shown = ", ".join(names if len(names) <= 6 else names[:3] + ["..."] + names[-3:])
    line = (f"  weights {chosen}; device weights stationary {stationary / 1e9:.3f} GB, with flow <= "
            f"{flowing / 1e9:.3f} GB ({len(plan.units)} units flow, prefetch depth {plan.depth} - {shown})")
    if plan.stationary:
        line += f"; on the device under flow too - {', '.join(plan.stationary)}"
    return line


H200 = {"name": "one H200", "device_bytes": 141 * 10**9, "link_gbps": 55.0, "flops": 989e12, "utilisation": 0.4}
"""The device the dry run decides weight-flow for (assumed, not measured: 141 GB of device memory;
PCIe Gen5 x16 page-locked host-to-device copies at 55 GB/s; 989 TFLOP/s dense bf16, of which the
forward and backward reach 40%). `superoffload probe` measures a machine's link."""


def flow_choice_lines(model, params, groups, config, tokens: int, accumulation_steps: int = 1,
                      device: Optional[dict] = None) -> str:
    """What `weights` ("auto" where the config says "stationary") decides on `device` (default
    H200): the layout value the engine would run with there, which units flow, the device peak
    with and without flow and the predicted exposed transfer time at `tokens` a micro-batch
    (plan/layout.py decide_layout, plan/flow.py: the engine's own decision)."""
    from superoffload_hf.plan.flow import choose_depth, device_margin
    from superoffload_hf.plan.layout import decide_layout, dry_run_machine

    device = device or H200
    machine = dry_run_machine(True, config.pin_memory, free_bytes=device["device_bytes"],
                              total_bytes=device["device_bytes"], params_counted=True, h2d_gbps=device["link_gbps"],
                              margin_bytes=device_margin(device["device_bytes"]))
    what = (f"{device['name']} ({device['device_bytes'] / 1e9:.0f} GB, {device['link_gbps']:g} GB/s host-to-device, "
            f"{device['utilisation']:.0%} of {device['flops'] / 1e12:.0f} TFLOP/s assumed; {tokens} tokens a micro-batch)")
    mode = "auto" if config.weights == "stationary" else config.weights
    try:
        chosen = config.replace(weights=mode, device_buckets="auto" if mode == "auto" else config.device_buckets)
        layout = decide_layout(params, groups, chosen, machine, model, accumulation_steps)
        forced = decide_layout(params, groups, chosen.replace(weights="flow", device_buckets="auto"), machine, model,
                               accumulation_steps)
    except ValueError as error:  # (a combination weight-flow does not do yet: the message says which)
        return f"  on {what} weight-flow is not decided - {str(error).split('.')[0].replace(': ', ' - ')}"
    choice = layout.flow_choice or forced.flow_choice
    per_element = 2 * tokens / (device["flops"] * device["utilisation"])  # forward seconds per multiply element
    timed = choose_depth(choice, device["link_gbps"] * 1e9, per_element,
                         headroom_bytes=max(0, device["device_bytes"] - choice.margin_bytes - choice.peak_flow))
    compute = 3 * per_element * sum(u.compute for u in choice.units)  # forward + backward
    flows = sum(choice.flowing) if layout.flow_choice is not None else 0
    head = (f"  on {what} weights {mode} flows {flows} of {len(choice.units)} units"
            + ("" if layout.flow_choice is not None else " (every unit fits on the device)"))
    lines = [head, f"    device peak {choice.peak_stationary / 1e9:.3f} GB stationary, "
             f"{forced.flow_choice.peak_flow / 1e9:.3f} GB with every unit flowing"
             + (f", {timed.peak_flow / 1e9:.3f} GB as chosen at prefetch depth {timed.depth}" if flows else "")
             + f" (activations {config.device_activation_bytes / 1e9:.3f} GB counted: device_activation_bytes, "
             "the estimate below unless the recipe sets it)"]
    every = choose_depth(forced.flow_choice, device["link_gbps"] * 1e9, per_element,
                         headroom_bytes=max(0, device["device_bytes"] - forced.flow_choice.peak_flow))
    exposed = timed.exposed_s if flows else 0.0
    lines.append(f"    predicted exposed transfer {exposed * 1e3:.1f} ms a step ({exposed / max(compute, 1e-12):.1%} of "
                 f"{compute * 1e3:.1f} ms of forward and backward compute); every unit flowing "
                 f"{every.exposed_s * 1e3:.1f} ms at prefetch depth {every.depth}")
    lines += ["    " + line.strip() for line in str(layout).splitlines()]
    return "\n".join(lines)


H200_BYTES = H200["device_bytes"]  # the device the dry run decides "auto" against when there is none


def recipe_activations(model_config, recipe: Recipe, config, accelerator: bool, num_params: int):
    """(ActivationTerms, TilingChoice): the device activations of one micro-batch at the recipe's
    batch, sequence length and checkpointing (plan/activations.py), with the tiling
    `tiled_loss` / `tiled_mlp` would choose: on an accelerator against an H200's 141 GB less the
    stationary weights (at run time "auto" decides at the first forward against the free memory)."""
    from superoffload_hf.plan.layout import DTYPES

    t = recipe.training
    dtype_bytes = DTYPES[config.device_dtype].itemsize
    free = max(H200_BYTES - num_params * dtype_bytes, 0) if accelerator else None
    return device_activations(model_config, config, int(t.get("per_device_train_batch_size", 8)),
                              int(recipe.data.seq_len), checkpointing_on(t),
                              accelerator, free)


def with_recipe_activations(config, recipe: Recipe, model_config, accelerator: bool, num_params: int):
    """`config` with `device_activation_bytes` from the activation estimate, for `weights` "auto"
    or "flow" on an accelerator when the recipe does not give it: what weight-flow's choice counts
    against the free device memory (plan/flow.py). Otherwise `config` as it is."""
    given = "device_activation_bytes" in (recipe.superoffload or {})
    if given or not accelerator or config.weights == "stationary" or model_config is None:
        return config
    terms, _ = recipe_activations(model_config, recipe, config, accelerator, num_params)
    return config.replace(device_activation_bytes=int(terms.total))


def recipe_with_activation_bytes(recipe: Recipe) -> tuple[Recipe, Optional[str]]:
    """`superoffload train`: the recipe with `device_activation_bytes` from the estimate where
    `with_recipe_activations` sets it, and a line saying so (None: unchanged)."""
    if recipe.superoffload is None:
        return recipe, None
    import torch
    from transformers import AutoModelForCausalLM

    from superoffload_hf.config import SuperOffloadConfig

    config = SuperOffloadConfig.coerce(recipe.superoffload)
    accelerator = not recipe.training.get("use_cpu", False)
    if config.weights == "stationary" or not accelerator or "device_activation_bytes" in recipe.superoffload:
        return recipe, None
    model_config, _ = _model_config(recipe)
    if model_config is None:
        return recipe, None
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config).parameters())
    chosen = with_recipe_activations(config, recipe, model_config, accelerator, n)
    recipe = dataclasses.replace(recipe, superoffload={**recipe.superoffload,
                                                       "device_activation_bytes": chosen.device_activation_bytes})
    return recipe, (f"weights {config.weights} counts {chosen.device_activation_bytes / 1e9:.3f} GB of activations "
                    f"(the estimate at {recipe.training.get('per_device_train_batch_size', 8)} x "
                    f"{recipe.data.seq_len} tokens; `device_activation_bytes` sets it)")


def activation_lines(model_config, recipe: Recipe, config, accelerator: bool, num_params: int) -> list[str]:
    """The device activations of one micro-batch at the recipe's sequence length
    (plan/activations.py), term by term, and what `tiled_loss` / `tiled_mlp` decide
    (recipe_activations)."""
    t = recipe.training
    batch, seq = int(t.get("per_device_train_batch_size", 8)), int(recipe.data.seq_len)
    checkpointing = checkpointing_on(t)
    terms, choice = recipe_activations(model_config, recipe, config, accelerator, num_params)
    shown = ", ".join(f"{name} {value / 1e9:.3f}" for name, value in terms.rows() if name != "total")
    where = "against an H200's 141 GB less the stationary weights" if accelerator else "on the CPU device"
    # (indented, no ": ": the dry run's output reads as YAML)
    return [f"  activations of {batch} x {seq} tokens ({config.device_dtype}, gradient checkpointing "
            f"{'on' if checkpointing else 'off'}) {terms.total / 1e9:.3f} GB at their peak - {shown} GB",
            f"  tiled_loss {config.tiled_loss}, tiled_mlp {config.tiled_mlp} - {where}, "
            f"{choice.describe().replace(': ', ' - ')}"]


def host_check_line(rows, device_is_host: bool, activation_pinned: int = 0,
                    budget_bytes: Optional[int] = None) -> str:
    """What the engine's check before allocating compares (engine/host_limit.py), against this
    machine's memory now: the host buffers plus the re-plan's transient, plus activation
    offload's pinned pool (`activation_pinned`, reserved before training)."""
    from superoffload_hf.engine.host_limit import host_memory_left
    from superoffload_hf.plan.memory import host_bytes, replan_transient

    transient = replan_transient(rows)
    need = host_bytes(rows, device_is_host) + transient + activation_pinned
    # (indented, no ": ": the dry run's output reads as YAML)
    line = (f"  host memory checked before allocating {need / 1e9:.3f} GB with the re-plan after step 1 "
            f"({transient / 1e9:.3f} GB of it the re-plan's transient")
    line += f", {activation_pinned / 1e9:.3f} GB activation offload's pinned pool)" if activation_pinned else ")"
    line += f"; {fits_hosts(need)}"
    left = host_memory_left(None, budget_bytes)
    if left is None:
        return line
    fits = "fits" if need <= left[0] else "does NOT fit (the optimizer would refuse it, see host_memory_check)"
    return f"{line}; this machine may use {left[0] / 1e9:.3f} GB now ({left[1].replace(': ', ' ')}) - {fits}"


HOST_SIZES = ((128 * 2**30, "a 128 GiB host (one H200 server)"), (256 * 2**30, "a 256 GiB host"),
              (480 * 10**9, "a GH200's 480 GB"))


def fits_hosts(need: int) -> str:
    """Which of the usual host sizes `need` bytes fit in, in GiB (the smallest that does)."""
    for size, what in HOST_SIZES:
        if need <= size:
            return f"{need / 2**30:.1f} GiB fits {what}"
    return f"{need / 2**30:.1f} GiB exceeds {HOST_SIZES[-1][1]}"


def per_host_lines(rows, ranks_per_host: int, num_machines: int, device_is_host: bool) -> str:
    """The memory of the ranks that share one host: each rank's pinned and plain host memory
    `ranks_per_host` times; its device memory too where the device is the CPU, else that is on
    the rank's own GPU."""
    machines = "1 machine" if num_machines == 1 else f"each of {num_machines} machines"
    places = ("pinned", "host", "device") if device_is_host else ("pinned", "host")
    what = ("memory (the device is the CPU)" if device_is_host
            else "pinned and host memory (its device memory is on its own GPU)")
    lines = [f"memory per host, {ranks_per_host} ranks on {machines}: {ranks_per_host} x a rank's {what}"]
    for place in places:
        total = ranks_per_host * sum(r.nbytes for r in rows if r.place == place)
        lines.append(f"  {'total ' + place:<34}{total / 1e9:>10.3f}")
    total = ranks_per_host * sum(r.nbytes for r in rows if r.place in places)
    lines.append(f"  {'total ' + ' + '.join(places):<34}{total / 1e9:>10.3f}")
    return "\n".join(lines)


def _model_config(recipe: Recipe) -> tuple[Optional[Any], Optional[Any]]:
    """(the model's config, the shipped recipes/models/ directory it came from or None): the
    recipe's own config, a local (or hub-cached) config.json, else a shipped copy (catalog.py)."""
    from transformers import AutoConfig

    from superoffload_hf.train.catalog import shipped_model_dir

    if recipe.model.config is not None:
        values = dict(recipe.model.config)
        if recipe.tokenizer.shipped:
            values.setdefault("vocab_size", recipe.tokenizer.vocab_size)
        return AutoConfig.for_model(values.pop("model_type", "llama"), **values), None
    try:
        return AutoConfig.from_pretrained(recipe.model.name_or_path, local_files_only=True), None
    except (OSError, ValueError):
        shipped = shipped_model_dir(recipe.model.name_or_path)
        if shipped is None:
            return None, None
        return AutoConfig.from_pretrained(str(shipped), local_files_only=True), shipped
