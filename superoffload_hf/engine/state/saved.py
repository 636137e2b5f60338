"""The on-disk state format both checkpoint paths share (engine/checkpoint.py, one process;
engine/dp/checkpoint.py, every rank's shard): the format version, an entry's keys, and the
CRC-32 of a tensor's values. The bottom of the checkpoint modules: it imports neither."""

from __future__ import annotations

import zlib

import torch

from superoffload_hf.plan.memory import COMPACT_KINDS

FORMAT_VERSION = 1
MOMENT_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master_param": "master"}
COMPACT_KEYS = COMPACT_KINDS  # a compact entry's keys are its buffer kinds
MASTER_KINDS = ("master", "master_bf16", "master_err")  # kept when an entry has no state


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's values as contiguous CPU fp32 bytes (a read: no copy when the tensor
    already is one)."""
    values = tensor.detach().to("cpu", torch.float32).contiguous()
    return zlib.crc32(values.reshape(-1).numpy()) if values.numel() else 0
