"""One parameter's optimizer state converted between fp32 and compact (host/compact.py).

A parameter's state is a dict of its buffers' kinds (plan/memory.py): fp32 `master`, `exp_avg`,
`exp_avg_sq`, or the six compact kinds (`master_bf16`, `master_err`, `exp_avg_q`,
`exp_avg_scale`, `exp_avg_sq_q`, `exp_avg_sq_scale`: groups from the parameter's first element,
as in the engine's aligned slots). The conversion runs through a host Adam back end's
`compact_encode_` / `compact_decode` (host/kernel.py); within one precision it is the identity,
so state that stays in its precision moves bit-exactly. Used where state crosses between
precisions: a checkpoint of the other precision, a parameter moving between a compact host
bucket and an fp32 device-resident one at a re-plan.
"""

from __future__ import annotations

from typing import Mapping

import torch

from superoffload_hf.plan.memory import COMPACT_KINDS, STATE_KINDS
from superoffload_hf.host.compact import scale_numel, spec_of

FP32 = torch.float32


def precision_of(values: Mapping[str, torch.Tensor]) -> str:
    """"fp32", "compact" or "compact32": which state a parameter's dict holds."""
    if "master_bf16" not in values:
        return "fp32"
    return "compact32" if values["master_err"].dtype == spec_of("compact32").err_dtype else "compact"


def convert(values: Mapping[str, torch.Tensor], precision: str, codec) -> dict[str, torch.Tensor]:
    """`values` as `precision` state (new CPU tensors where it converts; `values` itself where
    it is that precision already). `codec`: a host Adam back end (compact_encode_ / compact_decode)."""
    have = precision_of(values)
    if have == precision:
        return dict(values)
    fp32 = values if have == "fp32" else decode(values, codec)
    return fp32 if precision == "fp32" else encode(fp32, precision, codec)


def decode(values: Mapping[str, torch.Tensor], codec) -> dict[str, torch.Tensor]:
    n = values["master_bf16"].numel()
    out = {kind: torch.empty(n, dtype=FP32) for kind in STATE_KINDS}
    codec.compact_decode(*(_flat(values[kind]) for kind in COMPACT_KINDS), *(out[kind] for kind in STATE_KINDS))
    return out


def encode(values: Mapping[str, torch.Tensor], precision: str, codec) -> dict[str, torch.Tensor]:
    n = values["master"].numel()
    out = empty_compact(n, precision)
    codec.compact_encode_(*(out[kind] for kind in COMPACT_KINDS),
                          *(_flat(values[kind]).to("cpu", FP32).contiguous() for kind in STATE_KINDS))
    return out


def empty_compact(n: int, precision: str) -> dict[str, torch.Tensor]:
    """Zeroed compact state of `n` elements (decodes to zeros)."""
    groups = scale_numel(n)
    return {"master_bf16": torch.zeros(n, dtype=torch.bfloat16),
            "master_err": torch.zeros(n, dtype=spec_of(precision).err_dtype),
            "exp_avg_q": torch.zeros(n, dtype=torch.int8), "exp_avg_scale": torch.zeros(groups, dtype=torch.bfloat16),
            "exp_avg_sq_q": torch.zeros(n, dtype=torch.uint8),
            "exp_avg_sq_scale": torch.zeros(groups, dtype=torch.bfloat16)}


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def cast_params_in_place(params: list[torch.Tensor], dtype: torch.dtype) -> None:
    """The device parameters in the layout's device dtype (the engine's construction)."""
    for p in params:
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
