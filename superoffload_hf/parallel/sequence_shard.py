"""One SP rank's part of a causal-LM batch: `input_ids`, `position_ids` and pre-shifted labels.

The labels are shifted before the split: `shift_labels[:, t]` is the target of token t (the
label of token t + 1, ignore_index for the last token), so the last token of every shard
keeps its target, which lives on the next shard. The model then must not shift again: the
loss (loss.py) reads `shift_labels` as they are.

What a batch may hold, and what happens to it:
* `input_ids` (B, S): required.
* `labels` (B, S), as the model takes them (unshifted; default: `input_ids`), or
  `shift_labels` (B, S), already shifted.
* `position_ids`: made explicit (arange) before the split when absent; rows that restart
  (packed sequences) are refused: each shard's attention would need the documents' bounds.
* `attention_mask` (B, S): right padding is handled: the pads' own predictions become
  ignore_index targets and the mask is dropped (attention is causal, so no real token attends
  to a later pad; the same numbers as one process with the mask when the pads' labels are
  ignore_index, as collators set them). Left or inner padding is refused.
* S not a multiple of N: padded at the end to one (with `pad_token_id`, positions continuing,
  ignore_index targets), which changes no real token's result for the same reason.
Any other key is refused (it would have to be split or not, and this module cannot know).
"""

from __future__ import annotations

from typing import Mapping

import torch

IGNORE_INDEX = -100
KNOWN_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask")


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """(B, S) labels -> (B, S) targets: token t's is label t + 1; the last token's is ignored."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


def pad_to_multiple(batch: Mapping[str, torch.Tensor], multiple: int, pad_token_id: int = 0,
                    ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """(input_ids, position_ids, shift_labels) padded at the end to a length divisible by `multiple`."""
    seq = batch["input_ids"].shape[1]
    extra = -seq % multiple
    if not extra:
        return dict(batch)
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["shift_labels"]
    tail = torch.arange(1, extra + 1, device=pos.device, dtype=pos.dtype)
    return {"input_ids": torch.nn.functional.pad(ids, (0, extra), value=pad_token_id),
            "position_ids": torch.cat([pos, pos[:, -1:] + tail], dim=1),
            "shift_labels": torch.nn.functional.pad(labels, (0, extra), value=ignore_index)}


def full_sequence_batch(batch: Mapping[str, torch.Tensor], ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """The whole batch as (input_ids, position_ids, shift_labels), checked (module docstring)."""
    unknown = sorted(set(batch) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"shard_batch: batch keys {unknown} are not understood; sequence parallelism shards "
                         f"{list(KNOWN_KEYS)}. Drop the others before sharding (or compute them per shard).")
    if "input_ids" not in batch:
        raise ValueError(f"shard_batch: the batch has no `input_ids` (keys: {sorted(batch)}).")
    ids = batch["input_ids"]
    if ids.ndim != 2:
        raise ValueError(f"shard_batch: `input_ids` has shape {tuple(ids.shape)}; expected (batch, sequence).")
    if "labels" in batch and "shift_labels" in batch:
        raise ValueError("shard_batch: the batch has both `labels` and `shift_labels`; pass one "
                         "(`labels` unshifted, as the model takes them, or `shift_labels` already shifted).")
    if "shift_labels" in batch:
        targets = batch["shift_labels"].clone()
    else:
        targets = shift_labels(batch.get("labels", ids), ignore_index)
    _check_shape("shift_labels" if "shift_labels" in batch else "labels", targets, ids)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    else:
        positions = positions.expand_as(ids)
        _check_not_packed(positions)
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_shape("attention_mask", mask, ids)
        pad = _right_padding(mask)
        targets = targets.masked_fill(pad, ignore_index)
    return {"input_ids": ids, "position_ids": positions.contiguous(), "shift_labels": targets}


def shard_sequence(batch: Mapping[str, torch.Tensor], rank: int, size: int, pad_token_id: int = 0,
                   ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """Rank `rank` of `size`'s contiguous part of every sequence of the batch."""
    if not 0 <= rank < size:
        raise ValueError(f"shard_batch: rank {rank} is not in a sequence-parallel group of {size}.")
    whole = pad_to_multiple(full_sequence_batch(batch, ignore_index), size, pad_token_id, ignore_index)
    return {name: t.chunk(size, dim=1)[rank].contiguous() for name, t in whole.items()}


def _check_shape(name: str, t: torch.Tensor, ids: torch.Tensor) -> None:
    if tuple(t.shape) != tuple(ids.shape):
        raise ValueError(f"shard_batch: `{name}` has shape {tuple(t.shape)}, `input_ids` {tuple(ids.shape)}; "
                         "they must match.")


def _check_not_packed(positions: torch.Tensor) -> None:
    steps = positions[:, 1:] - positions[:, :-1]
    if bool((steps != 1).any()):
        row, col = (steps != 1).nonzero()[0].tolist()
        raise ValueError(
            f"shard_batch: `position_ids` row {row} goes from {int(positions[row, col])} to "
            f"{int(positions[row, col + 1])} at token {col + 1}: packed sequences (positions restarting) are "
            "not supported under sequence parallelism. Pass one sequence per row (pad with an attention_mask), "
            "or train without sequence parallelism.")


def _right_padding(mask: torch.Tensor) -> torch.Tensor:
    """The pads of a right-padded 0/1 mask (True where padded); refuses any other padding."""
    real = mask.bool()
    if bool((real[:, 1:] & ~real[:, :-1]).any()):
        row = int((real[:, 1:] & ~real[:, :-1]).any(dim=1).nonzero()[0])
        raise ValueError(
            f"shard_batch: `attention_mask` row {row} has a real token after a pad (left or inner padding): "
            "under sequence parallelism only right padding is supported (the pads become ignored targets "
            "and the causal mask does the rest). Set the tokenizer's padding_side='right'.")
    return ~real
