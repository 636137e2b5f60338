"""benchmarks/long_sequence_memory.py --table: the estimate's table as benchmarks/README.md shows it
(the CPU measurement takes minutes and ~7 GB: run by hand, figures in the README)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("long_sequence_memory", REPO / "benchmarks" / "long_sequence_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_is_the_readmes_and_8b_fits_512k_tokens_on_one_h200_with_tiling_and_offload():
    table = _script().table()
    readme = (REPO / "benchmarks" / "README.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert all(row in readme for row in rows), table
    offload = next(row for row in rows if row.startswith("| + tiled + activation offload"))
    stationary_k = int(offload.split("|")[2].strip().rstrip("K").replace(",", ""))
    assert stationary_k >= 512, offload
    assert "30.9 GB per GPU (fits 141 GB" in table
