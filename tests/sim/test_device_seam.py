"""Each runtime implements the device seam (device/runtime.py `DeviceRuntime`): every member the
protocol names, each method with the protocol's parameters in order (a default where the
protocol has one), and its streams and events implement `DeviceStream` / `DeviceEvent`."""

from __future__ import annotations

import inspect

import pytest
import torch

from superoffload_hf.device.accelerator import AcceleratorRuntime
from superoffload_hf.device.cpu import CpuRuntime
from superoffload_hf.device.runtime import DeviceEvent, DeviceRuntime, DeviceStream
from superoffload_hf.testing.sim import SimRuntime

RUNTIMES = [CpuRuntime, AcceleratorRuntime, SimRuntime]


def protocol_methods(protocol) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(protocol).items()
            if callable(member) and not name.startswith("_")}


def signature_mismatches(cls, protocol) -> list[str]:
    """What `cls` lacks of `protocol`'s methods, or takes differently (names, order, defaults)."""
    found = []
    for name, wanted in protocol_methods(protocol).items():
        member = getattr(cls, name, None)
        if not callable(member):
            found.append(f"{cls.__name__}.{name}: missing")
            continue
        have = list(inspect.signature(member).parameters.values())
        want = list(wanted.parameters.values())
        if [p.name for p in have] != [p.name for p in want]:
            found.append(f"{cls.__name__}.{name}{inspect.signature(member)}: the seam has {name}{wanted}")
        elif any(w.default is not w.empty and h.default is h.empty for h, w in zip(have, want)):
            found.append(f"{cls.__name__}.{name}: no default where the seam has one ({name}{wanted})")
    return found


@pytest.mark.parametrize("cls", RUNTIMES, ids=lambda c: c.__name__)
def test_every_runtime_has_the_seams_methods_with_its_signatures(cls):
    assert signature_mismatches(cls, DeviceRuntime) == []


def test_the_signature_check_reports_a_missing_method_and_a_changed_signature():
    class Partial(CpuRuntime):
        copy_ = None

        def device_empty(self, size: int, dtype: torch.dtype) -> torch.Tensor:
            raise AssertionError("not called")

        def new_event(self, timing: bool) -> None:
            raise AssertionError("not called")

    found = signature_mismatches(Partial, DeviceRuntime)
    assert [line.split(":")[0].split("(")[0] for line in found] == [
        "Partial.device_empty", "Partial.new_event", "Partial.copy_"]


def test_the_cpu_and_simulated_runtimes_are_device_runtimes_with_streams_and_events():
    sim = SimRuntime()
    try:
        for runtime in (CpuRuntime(), sim):
            assert isinstance(runtime, DeviceRuntime)
            assert isinstance(runtime.current_stream(), DeviceStream)
            assert isinstance(runtime.new_stream(), DeviceStream)
            assert isinstance(runtime.new_event(timing=True), DeviceEvent)
    finally:
        sim.close()


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator")
def test_the_accelerator_runtime_is_a_device_runtime_with_streams_and_events():
    runtime = AcceleratorRuntime(torch.device(torch.accelerator.current_accelerator().type, 0))
    assert isinstance(runtime, DeviceRuntime)
    assert isinstance(runtime.current_stream(), DeviceStream)
    assert isinstance(runtime.new_event(timing=True), DeviceEvent)
