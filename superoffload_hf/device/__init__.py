"""The device seam: `make_runtime` picks the runtime for the parameters' device (runtime.py
states the interface as `DeviceRuntime`, a typing.Protocol), and `Transfer` moves bucket data
over it (transfer.py)."""

from __future__ import annotations

import os

import torch

from superoffload_hf.device.runtime import DeviceRuntime

SIM_ENV_VAR = "SUPEROFFLOAD_SIM_DEVICE"


def accelerator_count() -> int:
    """How many devices of torch's accelerator (CUDA, XPU, ...) this process sees; 0 without one."""
    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def make_runtime(device: torch.device, environ=os.environ) -> DeviceRuntime:
    """The runtime for `device`. With SUPEROFFLOAD_SIM_DEVICE=1, parameters on the CPU run on the
    simulated asynchronous device (superoffload_hf.testing.sim) instead of the synchronous CPU."""
    if device.type == "cpu":
        if environ.get(SIM_ENV_VAR, "0") not in ("", "0"):
            from superoffload_hf.testing.sim import SimRuntime

            return SimRuntime.shared()
        from superoffload_hf.device.cpu import CpuRuntime

        return CpuRuntime()
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != device.type:
        raise ValueError(
            f"Parameters are on {device}, but this torch's accelerator is "
            f"{accelerator.type if accelerator else 'none'}; SuperOffload runs on the accelerator torch "
            "was built for (CUDA, XPU, ...) or on the CPU. Move the model to that device or to cpu."
        )
    from superoffload_hf.device.accelerator import AcceleratorRuntime

    return AcceleratorRuntime(device)
