"""Long-sequence activation memory: what the tiled loss, the tiled MLP and activation offload buy.

    python benchmarks/long_sequence_memory.py --table      # the estimate: longest sequence on one H200
    python benchmarks/long_sequence_memory.py --measure    # measured on the CPU: tiny Llama, 32K vocab, 16K tokens
    python benchmarks/long_sequence_memory.py              # both

`--table` (pure arithmetic, plan/activations.py): Llama-3.1-8B (recipes/models/llama-3.1-8b)
on one H200 (141 GB), micro-batch 1, bf16, gradient checkpointing of every block: the longest
sequence (a multiple of 1024 tokens) whose activations plus the device's weights fit, weights
stationary (every bf16 weight on the device) or flowing (two decoder blocks' weights, the
embedding and the head on the device), plus the engine's device buffers (ENGINE_DEVICE_BYTES);
and Llama-2-13B with sequence parallelism over 8 GPUs at 1M tokens.

`--measure`: the peak of live tensor storage (testing/alloc_peak.py: every storage the operators
allocate, counted until freed; the weights, which exist before, are not counted; their gradients
are) of one forward + backward of a tiny Llama (2 layers, hidden 64, vocabulary 32768) at 16384
tokens, untiled and with the tiled loss, each in a fresh subprocess that also reports its peak
resident set growth (ru_maxrss after less RSS before: the process's whole memory, allocator
included). Target: tiled <= 1/4 of untiled, on both measures. Exits 1 when it is missed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

H200 = 141 * 10**9
# `superoffload train llama3.1-8b --dry-run`: total device 20.263 GB less device params 16.061 GB
# (the engine's gradient buckets and staging on the device, weights stationary or flowing)
ENGINE_DEVICE_BYTES = int(4.202e9)
SWITCHES = (("checkpointing", {}), ("+ tiled loss", {"tiled_loss": True}),
            ("+ tiled loss + MLP", {"tiled_loss": True, "tiled_mlp": True}),
            ("+ tiled + activation offload", {"tiled_loss": True, "tiled_mlp": True, "activation_offload": True}))


def device_weights(config, flow: bool, dtype_bytes: int = 2) -> int:
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or h // config.num_attention_heads)
    block = (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) * dtype_bytes
    ends = (v * h * (1 if config.tie_word_embeddings else 2) + h) * dtype_bytes
    return (2 * block if flow else config.num_hidden_layers * block) + ends


def longest_sequence(config, weights: int, budget: int, sp: int = 1, **switches) -> int:
    from superoffload_hf.plan.activations import estimate_activations

    def fits(seq):
        return weights + ENGINE_DEVICE_BYTES + estimate_activations(
            config, 1, seq, 2, sequence_parallel_size=sp, **switches).total <= budget

    low, high = 0, 1
    while fits(high * 1024) and high < 2**16:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * 1024) else (low, mid)
    return low * 1024


def table() -> str:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(REPO / "recipes/models/llama-3.1-8b"))
    rows = ["| Llama-3.1-8B, one H200 (141 GB), bf16, checkpointing | weights stationary (16.1 GB) | weights flow (two blocks) |",
            "| --- | --- | --- |"]
    for name, switches in SWITCHES:
        cells = [f"{longest_sequence(config, device_weights(config, flow), H200, **switches) / 1024:,.0f}K"
                 for flow in (False, True)]
        rows.append(f"| {name} | {cells[0]} | {cells[1]} |")
    from superoffload_hf.plan.activations import estimate_activations

    big = AutoConfig.from_pretrained(str(REPO / "recipes/models/llama-2-13b"))
    terms = estimate_activations(big, 1, 2**20, 2, sequence_parallel_size=8, tiled_loss=True, tiled_mlp=True,
                                 activation_offload=True)
    need = terms.total + device_weights(big, True) + ENGINE_DEVICE_BYTES
    rows.append("")
    rows.append(f"Llama-2-13B at 1M tokens, sequence parallel over 8 GPUs (131K tokens each), weights flow, tiled "
                f"loss and MLP, activation offload: {need / 1e9:.1f} GB per GPU "
                f"({'fits' if need <= H200 else 'does not fit'} 141 GB; host holds {terms.offloaded_inputs / 1e9:.1f} GB "
                "of checkpointed inputs per GPU)")
    return "\n".join(rows)


def measure_one(tiled: bool, seq: int, vocab: int) -> dict:
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from superoffload_hf.parallel.tiled_loss import apply_tiled_loss
    from superoffload_hf.testing.alloc_peak import AllocationPeak

    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=seq)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if tiled:
        apply_tiled_loss(model)
    ids = torch.randint(0, vocab, (1, seq))
    rss_before = _rss_bytes()
    with AllocationPeak() as peak:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tiled": tiled, "loss": float(loss), "peak_bytes": peak.peak_bytes, "rss_growth_bytes": maxrss - rss_before}


def _rss_bytes() -> int:
    import resource

    # ru_maxrss is the peak so far: before the forward it is the start-up's peak (imports, the model)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(seq: int = 16384, vocab: int = 32768) -> tuple[str, bool]:
    runs = {}
    for tiled in (False, True):
        out = subprocess.run([sys.executable, __file__, "--one", "tiled" if tiled else "untiled", str(seq), str(vocab)],
                             check=True, capture_output=True, text=True, cwd=REPO).stdout
        runs[tiled] = json.loads(out.strip().splitlines()[-1])
    untiled, tiled = runs[False], runs[True]
    ratio = tiled["peak_bytes"] / untiled["peak_bytes"]
    rss_ratio = tiled["rss_growth_bytes"] / untiled["rss_growth_bytes"]
    ok = ratio <= 0.25 and rss_ratio <= 0.25 and abs(tiled["loss"] - untiled["loss"]) <= 1e-4 * abs(untiled["loss"])
    text = "\n".join([
        f"| tiny Llama, vocab {vocab}, {seq} tokens, fp32, forward + backward | untiled | tiled loss | ratio |",
        "| --- | --- | --- | --- |",
        f"| peak of live tensor storage (alloc_peak) | {untiled['peak_bytes'] / 1e9:.3f} GB | "
        f"{tiled['peak_bytes'] / 1e9:.3f} GB | {ratio:.3f} |",
        f"| peak RSS growth (ru_maxrss) | {untiled['rss_growth_bytes'] / 1e9:.3f} GB | "
        f"{tiled['rss_growth_bytes'] / 1e9:.3f} GB | {rss_ratio:.3f} |",
        f"| loss | {untiled['loss']:.6f} | {tiled['loss']:.6f} | |",
        f"target tiled <= 1/4 of untiled on both measures, the same loss: {'met' if ok else 'MISSED'}"])
    return text, ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one[0] == "tiled", int(args.one[1]), int(args.one[2]))))
        return 0
    both = not (args.table or args.measure)
    ok = True
    if args.table or both:
        print(table())
    if args.measure or both:
        text, ok = measure()
        print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
