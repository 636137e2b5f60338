"""Checkpoint directories as the Trainer writes them, whole or cut short, without training."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_checkpoint(path: Path, step: int = 4, *, optimizer=True, scheduler=True, trainer_state=True) -> Path:
    """A complete Trainer checkpoint (tiny files), in the Trainer's order: weights, optimizer,
    scheduler, trainer_state.json last. Pass False to leave a file out, or bytes for its content."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(b"weights")
    for name, wanted in (("optimizer.pt", optimizer), ("scheduler.pt", scheduler)):
        if isinstance(wanted, bytes):
            (path / name).write_bytes(wanted)
        elif wanted:
            torch.save({"state": {}, "param_groups": []}, path / name)
    if isinstance(trainer_state, bytes):
        (path / "trainer_state.json").write_bytes(trainer_state)
    elif trainer_state:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path
