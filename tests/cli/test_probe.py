"""`superoffload probe` on the CPU as the device: every measurement is there and positive, the
recipe's model is measured, the plan is printed, and the JSON holds the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superoffload_hf.cli import main

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_llama_cpu.yaml"


@pytest.mark.timeout(240)
def test_probe_measures_the_machine_and_prints_the_plan_for_a_recipe(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert main(["probe", "--quick", "--recipe", str(RECIPE), "--json", str(out),
                 "--threads", "2"]) == 0
    text = capsys.readouterr().out
    assert "superoffload probe: device cpu" in text and "plan: bucket" in text and "predicted step" in text
    report = json.loads(out.read_text())
    assert set(report["copies"]) == {"h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"}
    assert all(gbps > 0 for table in report["copies"].values() for gbps in table.values())
    assert set(report["host_adam_rate"]) == set(report["host_adam_rate_busy"]) == {"1", "2"}
    assert all(r > 0 for r in report["host_adam_rate"].values())
    assert report["device_adam_rate"] > 0 and report["device_free_bytes"] > 0
    assert report["host_adam_compact_rate"] > 0
    assert report["state_precision"] == "fp32" and report["state_bytes_per_param"] == 12.0  # the recipe's
    assert "host state fp32, 12.000 B/param stored" in text and "compact host Adam " in text
    workload = report["workload"]
    assert 1.2e6 < workload["num_params"] < 1.5e6  # the recipe's 1.3M-parameter Llama
    assert workload["tokens_per_step"] == 8 * 128
    assert workload["forward_s"] > 0 and workload["backward_s"] > 0
    fractions = [x for x, _ in workload["ready_profile"]]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    plan = report["plan"]
    assert plan["device_buckets"] == 0 and plan["cast"] == "device"  # the CPU is the device
    assert plan["prediction"]["step_s"] >= workload["forward_s"] + workload["backward_s"]


def test_probe_with_a_missing_recipe_fails_with_the_path(tmp_path, capsys):
    assert main(["probe", "--quick", "--recipe", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_page_locking_is_compared_by_method_where_the_runtime_has_the_choice():
    """cudaHostAlloc against cudaHostRegister (torch's `pinned_use_cuda_host_register`): on the
    simulated device the path runs (the numbers are its accounting, not a GPU's); the CPU device
    has no choice and reports none; the method is torch's default again afterwards."""
    from superoffload_hf.device.cpu import CpuRuntime
    from superoffload_hf.perf.probe import MB, measure_pinning
    from superoffload_hf.testing.sim import SimRuntime

    sim = SimRuntime()
    try:
        pinning = measure_pinning(sim, 1 * MB, threads=2, point_seconds=0.01)
        assert set(pinning) == {"cudaHostAlloc", "cudaHostRegister", "faster"}
        assert pinning["faster"] in ("cudaHostAlloc", "cudaHostRegister")
        for method in ("cudaHostAlloc", "cudaHostRegister"):
            assert pinning[method]["pin_gbps"] > 0 and pinning[method]["h2d_gbps"] > 0
        assert sim.host_registered is False and sim.host_memory.pinned_reserved == 0 and not sim.errors
    finally:
        sim.close()
    assert measure_pinning(CpuRuntime(), 1 * MB, threads=2, point_seconds=0.01) == {}


def test_the_cuda_runtime_sets_torch_s_host_register_setting_with_a_power_of_two_of_threads():
    """What AcceleratorRuntime.host_register asks of torch (the allocator settings string; its
    effect on page-locking needs a GPU)."""
    import torch

    from superoffload_hf.device.accelerator import AcceleratorRuntime

    if not hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        pytest.skip("this torch has no torch._C._accelerator_setAllocatorSettings")
    rt = AcceleratorRuntime(torch.device("cuda", 0))
    try:
        assert rt.host_register(True, threads=12)
        assert "pinned_use_cuda_host_register:True,pinned_num_register_threads:8" in (
            torch._C._accelerator_getAllocatorSettings())
    finally:
        rt.host_register(False, threads=1)
    assert "pinned_use_cuda_host_register:False" in torch._C._accelerator_getAllocatorSettings()
    assert not AcceleratorRuntime(torch.device("xpu", 0)).host_register(True)
