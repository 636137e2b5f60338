"""benchmarks/train_llama.py writes each mode's results when the mode ends: a mode that fails
(here a refused host-memory preflight) is recorded with its error, the other modes still run and
keep their results, and the run exits non-zero naming the failed mode."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from superoffload_hf.engine.host_limit import HostMemoryError

ROOT = Path(__file__).resolve().parents[2]


def _train_llama():
    spec = importlib.util.spec_from_file_location("train_llama", ROOT / "benchmarks" / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failed_mode_keeps_the_other_modes_results_written_as_each_mode_ends(tmp_path, monkeypatch):
    train_llama = _train_llama()
    real_run_mode, seen_on_disk = train_llama.run_mode, []

    def run_mode(args, speculation, max_grad_norm, timeline_dir=None):
        results = tmp_path / "results.json"
        seen_on_disk.append(len(json.loads(results.read_text())["results"]) if results.exists() else 0)
        if (speculation, max_grad_norm) == ("off", 1.0):
            raise HostMemoryError("SuperOffload: the optimizer's buffers need 17 GB (forced by the test)")
        return real_run_mode(args, speculation, max_grad_norm, timeline_dir)

    monkeypatch.setattr(train_llama, "run_mode", run_mode)
    threads = torch.get_num_threads()
    try:
        rc = train_llama.main(["--tiny", "--steps", "1", "--warmup", "1", "--max-grad-norm", "1.0,1e3",
                               "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 1
    # before each mode, every mode that finished before it was already on disk
    assert seen_on_disk == [0, 1, 1, 2]
    written = json.loads((tmp_path / "results.json").read_text())
    assert [(r["speculation"], r["max_grad_norm"]) for r in written["results"]] == [("on", 1.0), ("on", 1e3),
                                                                                    ("off", 1e3)]
    assert written["failures"] == [{"speculation": "off", "max_grad_norm": 1.0,
                                    "error": "HostMemoryError: SuperOffload: the optimizer's buffers need 17 GB "
                                             "(forced by the test)"}]
    assert written["pending"] == []
    assert any("speculation off, max_grad_norm 1 failed: HostMemoryError" in p for p in written["problems"])
    assert all(r["tokens_per_second"] > 0 for r in written["results"])
    assert "FAIL: speculation off, max_grad_norm 1 failed" in (tmp_path / "results.md").read_text()
