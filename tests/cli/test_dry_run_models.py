"""`superoffload train --dry-run` on the shipped large recipes, offline: their models'
architectures come from recipes/models/*/config.json (no download), the model is built on the
meta device (nothing allocated), and the host memory it prints is what the engine's check
compares (the buffers plus the re-plan's transient)."""

from __future__ import annotations

import resource

import pytest

from superoffload_hf.cli import main
from superoffload_hf.train.catalog import shipped_model_dir
from test_cli import TABLE_ROW

GIB = 2**30


def dry_run(capsys, recipe: str, *args: str) -> tuple[str, dict, float]:
    """(the memory text, its rows: buffer -> (place, GB, B/param), the host GB the check compares)."""
    assert main(["train", recipe, "--dry-run", *args]) == 0
    out = capsys.readouterr().out
    memory = out[out.index("\nmemory: ") + 1:]
    line = next(x for x in memory.splitlines() if x.startswith("  host memory checked before allocating "))
    need_gb = float(line.split("allocating ")[1].split(" GB")[0])
    return memory, {m[1]: (m[2], float(m[3]), float(m[4])) for m in TABLE_ROW.finditer(memory)}, need_gb


def test_the_large_recipes_models_ship_their_architecture():
    assert shipped_model_dir("meta-llama/Llama-3.1-8B").name == "llama-3.1-8b"
    assert shipped_model_dir("meta-llama/Llama-2-13b-hf").name == "llama-2-13b"
    assert shipped_model_dir("someone/else") is None


def test_llama_3_1_8b_with_compact_state_fits_a_128_gib_host_with_the_replan_transient(capsys):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    fp32, fp32_rows, fp32_need = dry_run(capsys, "llama3.1-8b")
    compact, rows, need = dry_run(capsys, "llama3.1-8b", "--superoffload.state_precision", "compact")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < 2 * GIB, f"the dry run allocated {grown / GIB:.1f} GiB: the 16 GB model must stay on meta"
    assert "memory: 8.030B parameters" in compact and "architecture from the shipped" in compact
    assert fp32_need * 1e9 > 128 * GIB and "fits a 256 GiB host" in fp32, fp32
    assert need * 1e9 <= 128 * GIB and "fits a 128 GiB host" in compact, compact
    assert rows["snapshot"][2] == pytest.approx(5.125, abs=0.02)  # speculation auto: the rollback snapshot
    # what auto trades for it: its bytes and their copy per step, and the decision on a 128 GiB host
    assert "speculation snapshot 41.155 GB (5.125 B/param), 82.310 GB copied per speculative step" in compact \
        or "speculation snapshot 41.155 GB (5.125 B/param)" in compact, compact
    assert "on a 128 GiB host (one H200 server): speculates 195 of 195 host buckets (the snapshots fit)" in compact
    assert rows["grad staging"][2] == pytest.approx(4.0, abs=0.01)  # fp32 accumulation of 8 micro-batches


def test_llama_3_1_8b_compact_at_rest_per_param_on_an_accelerator_and_13b_needs(capsys):
    """One micro-batch, speculation off: the compact state plus the bf16 gradient landing, all of
    the host memory at rest (7.15 B/param: the format's 5.125, the landing's 2, page-locked
    segments rounded up to powers of two)."""
    memory, rows, _ = dry_run(capsys, "llama3.1-8b", "--superoffload.state_precision", "compact",
                              "--superoffload.speculation", "off", "--training.gradient_accumulation_steps", "1")
    host = sum(b for what, (place, _, b) in rows.items() if place in ("pinned", "host") and not what.startswith("total"))
    assert host == pytest.approx(7.15, abs=0.02), memory
    assert "snapshot" not in rows and "grad staging" not in rows
    memory, rows, need = dry_run(capsys, "llama-13b", "--superoffload.state_precision", "compact")
    assert "memory: 13.016B parameters" in memory
    assert 128 * GIB < need * 1e9 <= 256 * GIB and "fits a 256 GiB host" in memory, memory
