"""Which units' weights flow (config `weights`), decided before anything is allocated, from the
stationary layout's device memory (engine/memory.py footprint) against the device's free memory.

Pure given the machine's facts (engine/layout.py MachineFacts): no device calls.
"""

from __future__ import annotations

from typing import Optional

import torch


def choose_weights(choice: str, weight_bytes: int, buffer_bytes: int, free_bytes: int, total_bytes: int) -> str:
    """"auto": flow when the weights and the engine's device buffers do not fit in the free device
    memory; "stationary" that does not fit is refused here, before anything is trained."""
    fits = weight_bytes + buffer_bytes <= free_bytes
    if choice == "auto":
        return "stationary" if fits else "flow"
    if choice == "stationary" and not fits:
        raise torch.OutOfMemoryError(
            f"`weights: stationary` keeps {weight_bytes} bytes of weights on the device, plus {buffer_bytes} "
            f"bytes of the engine's device buffers, but {free_bytes} of the device's {total_bytes} bytes are "
            "free. Set `weights: flow` (or \"auto\") to stream the weights from the host block by block, or "
            "use a device with more memory.")
    return choice


def decide_weights(choice: str, plan, stationary_policy, machine, model: Optional[torch.nn.Module]) -> str:
    """"stationary" or "flow" (config `weights`: `choice`) for this run: what the stationary layout
    (`plan` under `stationary_policy`) puts on the device against the device's free memory
    (`machine`: engine/layout.py MachineFacts). On the CPU device nothing is checked (the host
    memory check covers it), nor where the device's memory is not known (the dry run's default)."""
    from superoffload_hf.engine.memory import footprint

    if not machine.host_is_device and machine.free_bytes is not None:
        rows = footprint(plan, stationary_policy)
        weight_bytes = sum(r.nbytes for r in rows if r.what == "device params")
        buffer_bytes = sum(r.nbytes for r in rows if r.place == "device" and r.what != "device params")
        free = machine.free_bytes
        if not machine.params_counted:  # a real device: the model is on it
            free += weight_bytes
        choice = choose_weights(choice, weight_bytes, buffer_bytes, free, machine.total_bytes)
    elif choice == "auto":
        choice = "stationary"  # the device is the host (nothing to free), or its memory is unknown
    if choice == "flow" and model is None:
        raise ValueError("`weights` is \"flow\" (or \"auto\" chose it) but the optimizer was not given the model: "
                         "weight-flow hooks the model's blocks. Pass `model=model` to SuperOffloadAdamW (the "
                         "Trainer and Accelerate integrations do), or set `weights: stationary`.")
    return choice

