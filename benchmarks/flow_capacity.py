"""The largest Llama-style model that trains with weight-flow on one H200, per host memory size
and host state precision: a table computed by the engine's own code, nothing allocated.

For each model shape (built on the meta device from a LlamaConfig: no download), the host bytes
are the host and page-locked rows of the engine's footprint (plan/memory.py `footprint` of the
layout `decide_layout` makes on the dry run's H200, train/footprint.py H200: the arithmetic the
allocation itself uses), and the device peak is the weight-flow choice's (plan/flow.py:
the units that flow, their window at the prefetch depth chosen for the assumed link and compute,
the engine's device buffers) plus `--activation-gb` of activations (a stated input, not a model of
them). A model "trains" on a host when its host bytes fit that host's memory less `--reserve-gb`
(the OS, the data loader, the Python process) and its device peak fits the H200's 141 GB.

Compact state with weight-flow is refused by the config so far (its bf16 part is not wired to the
flow yet, branch `flow`): its host bytes are the stationary compact layout's (flow adds no host
buffer: it streams the copy the host Adam writes) and its device peak is fp32 state's (the device
side of flow does not depend on the host state's precision), with speculation off (no rollback
snapshot of the compact bytes; `speculation: auto` keeps snapshots where the host memory allows).

    python benchmarks/flow_capacity.py [--activation-gb 20] [--reserve-gb 8] [--markdown]

Exits non-zero when a shape's flow choice does not fit the device it was decided for.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

GIB = 2**30
HOSTS = ((128 * GIB, "128 GiB"), (10**12, "1 TB"))
# (name, hidden, layers, intermediate): Llama-3 proportions, 8 key/value heads, vocabulary 128256
SHAPES = (("8B", 4096, 32, 14336), ("13B", 5120, 40, 13824), ("16B", 5120, 52, 13824), ("20B", 6144, 44, 16384),
          ("34B", 8192, 48, 22016), ("50B", 8192, 72, 24576), ("62B", 8192, 80, 24576), ("70B", 8192, 80, 28672),
          ("100B", 10240, 80, 32768), ("140B", 12288, 80, 36864), ("180B", 12288, 104, 40960),
          ("250B", 14336, 110, 45056), ("405B", 16384, 126, 53248))


def meta_llama(hidden: int, layers: int, intermediate: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                         num_attention_heads=hidden // 128, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def row(name: str, hidden: int, layers: int, intermediate: int, activation_bytes: int, tokens: int) -> dict:
    from superoffload_hf import SuperOffloadConfig
    from superoffload_hf.plan.flow import choose_depth, device_margin
    from superoffload_hf.plan.layout import decide_layout, dry_run_machine
    from superoffload_hf.plan.memory import footprint
    from superoffload_hf.train.footprint import H200

    model = meta_llama(hidden, layers, intermediate)
    params = list(model.parameters())
    groups = [{"params": params, "lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}]
    machine = dry_run_machine(True, "auto", free_bytes=H200["device_bytes"], total_bytes=H200["device_bytes"],
                              params_counted=True, h2d_gbps=H200["link_gbps"],
                              margin_bytes=device_margin(H200["device_bytes"]))
    base = SuperOffloadConfig(device_dtype="bf16", device_activation_bytes=activation_bytes)
    auto = decide_layout(params, groups, base.replace(weights="auto"), machine, model)
    # where every unit fits the device, "auto" keeps them there: the choice of flowing them all
    # gives the units and the peak that flow would have
    flow = auto if auto.flow_choice is not None else decide_layout(params, groups, base.replace(weights="flow"),
                                                                   machine, model)
    choice = flow.flow_choice
    per_element = 2 * tokens / (H200["flops"] * H200["utilisation"])
    timed = choose_depth(choice, H200["link_gbps"] * 1e9, per_element,
                         headroom_bytes=max(0, H200["device_bytes"] - choice.margin_bytes - choice.peak_flow))
    stays = auto.flow_choice is None
    # (speculation off: no rollback snapshot of the compact bytes; "auto" keeps one where the host
    # memory allows, plan/snapshot_trade.py)
    compact = decide_layout(params, groups, base.replace(state_precision="compact", speculation="off"),
                            dry_run_machine(True, "auto"), model)

    def host(layout) -> int:
        return sum(r.nbytes for r in footprint(layout.bucket_plan, layout.policy) if r.place in ("host", "pinned"))

    n = sum(p.numel() for p in params)
    return {"name": name, "params": n, "shape": f"{hidden}x{layers}, ffn {intermediate}",
            "host_fp32": host(flow), "host_compact": host(compact), "flowing": 0 if stays else sum(choice.flowing),
            "units": len(choice.units), "depth": timed.depth, "device_peak": choice.peak_stationary if stays
            else timed.peak_flow, "device_stationary": choice.peak_stationary, "exposed_s": 0.0 if stays
            else timed.exposed_s, "all_flow_peak": timed.peak_flow, "all_flow_exposed_s": 0.0 if not stays else timed.exposed_s,
            "compute_s": 3 * per_element * sum(u.compute for u in choice.units)}


def table(rows: Sequence[dict], reserve: int, markdown: bool) -> str:
    head = ("model", "params", "shape", "host fp32 GB (B/param)", "host compact GB (B/param)",
            "units flowing (weights auto)", "device peak GB (all stationary)", "exposed / compute ms a step")
    lines = []
    fmt = (lambda cells: "| " + " | ".join(cells) + " |") if markdown else (lambda cells: "  ".join(cells))
    lines.append(fmt(head))
    if markdown:
        lines.append("|" + "---|" * len(head))
    for r in rows:
        lines.append(fmt((r["name"], f"{r['params'] / 1e9:.2f}B", r["shape"],
                          f"{r['host_fp32'] / 1e9:.0f} ({r['host_fp32'] / r['params']:.2f})",
                          f"{r['host_compact'] / 1e9:.0f} ({r['host_compact'] / r['params']:.2f})",
                          f"{r['flowing']}/{r['units']}" + (f" at depth {r['depth']}" if r["flowing"] else
                                                             f" (all: {r['all_flow_peak'] / 1e9:.1f} GB, exposed "
                                                             f"{r['all_flow_exposed_s'] * 1e3:.0f} ms)"),
                          f"{r['device_peak'] / 1e9:.1f} ({r['device_stationary'] / 1e9:.1f})",
                          f"{r['exposed_s'] * 1e3:.0f} / {r['compute_s'] * 1e3:.0f}")))
    lines.append("")
    for size, label in HOSTS:
        for state in ("fp32", "compact"):
            fits = [r for r in rows if r[f"host_{state}"] <= size - reserve]
            best = max(fits, key=lambda r: r["params"], default=None)
            lines.append(f"largest of these shapes training on one H200 (weights auto), {label} host, {state} state: "
                         + (f"{best['name']} ({best['params'] / 1e9:.1f}B parameters, {best[f'host_{state}'] / GIB:.0f} "
                            f"GiB of host memory)" if best else "none of these shapes"))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--activation-gb", type=float, default=20.0,
                        help="device GB of activations per step counted in the device peak (an input)")
    parser.add_argument("--reserve-gb", type=float, default=8.0, help="host GB left to everything but the optimizer")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a micro-batch (for the compute time)")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="comma-separated names of SHAPES")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    wanted = set(args.shapes.split(","))
    rows = [row(*shape, int(args.activation_gb * 1e9), args.tokens) for shape in SHAPES if shape[0] in wanted]
    print(table(rows, int(args.reserve_gb * 1e9), args.markdown))
    from superoffload_hf.train.footprint import H200

    too_big = [r["name"] for r in rows if r["device_peak"] > H200["device_bytes"]]
    if too_big:
        print(f"the flow choice does not fit the device for {too_big}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
