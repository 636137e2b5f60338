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

The position and padding checks read the batch's values: on a device batch, a synchronisation.
They are computed on the batch's device into one small verdict (`batch_verdict`) that is read
once: at once by default (`check_now`), or, through `BatchChecks` (SequenceParallel's), the
first batch at once and every later one a call late, from a page-locked copy whose event has
completed, so that no step synchronises the device.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

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


def full_sequence_batch(batch: Mapping[str, torch.Tensor], ignore_index: int = IGNORE_INDEX,
                        check: Optional[Callable[[torch.Tensor], None]] = None) -> dict[str, torch.Tensor]:
    """The whole batch as (input_ids, position_ids, shift_labels), checked (module docstring):
    `check(verdict)` reads the verdict (default `check_now`)."""
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
    given = batch.get("position_ids")
    positions = (torch.arange(ids.shape[1], device=ids.device).expand_as(ids) if given is None
                 else given.expand_as(ids))
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_shape("attention_mask", mask, ids)
        targets = targets.masked_fill(~mask.bool(), ignore_index)  # the pads' targets (right padding: checked)
    if given is not None or mask is not None:
        (check or check_now)(batch_verdict(positions if given is not None else None, mask))
    return {"input_ids": ids, "position_ids": positions.contiguous(), "shift_labels": targets}


def shard_sequence(batch: Mapping[str, torch.Tensor], rank: int, size: int, pad_token_id: int = 0,
                   ignore_index: int = IGNORE_INDEX,
                   check: Optional[Callable[[torch.Tensor], None]] = None) -> dict[str, torch.Tensor]:
    """Rank `rank` of `size`'s contiguous part of every sequence of the batch (`check`:
    full_sequence_batch's)."""
    if not 0 <= rank < size:
        raise ValueError(f"shard_batch: rank {rank} is not in a sequence-parallel group of {size}.")
    whole = pad_to_multiple(full_sequence_batch(batch, ignore_index, check), size, pad_token_id, ignore_index)
    return {name: t.chunk(size, dim=1)[rank].contiguous() for name, t in whole.items()}


def _check_shape(name: str, t: torch.Tensor, ids: torch.Tensor) -> None:
    if tuple(t.shape) != tuple(ids.shape):
        raise ValueError(f"shard_batch: `{name}` has shape {tuple(t.shape)}, `input_ids` {tuple(ids.shape)}; "
                         "they must match.")


def batch_verdict(positions: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> torch.Tensor:
    """What the checks find, computed on the batch's device without reading it: int64
    [packed, row, token, from, to, padded, pad_row] (packed: a row's positions do not go up by
    one at `token`, from `from` to `to`; padded: `pad_row` has a real token after a pad)."""
    device = (positions if positions is not None else mask).device
    zero = torch.zeros((), dtype=torch.int64, device=device)
    packed = row = col = start = end = padded = pad_row = zero
    if positions is not None and positions.shape[0] and positions.shape[1] > 1:
        bad = (positions[:, 1:] - positions[:, :-1]) != 1
        first = bad.flatten().to(torch.uint8).argmax()  # the first offending pair, row-major
        row, col = first // bad.shape[1], first % bad.shape[1]
        flat = positions.flatten()
        packed, start, end = bad.any().long(), flat[row * positions.shape[1] + col], flat[row * positions.shape[1] + col + 1]
    if mask is not None and mask.shape[0] and mask.shape[1] > 1:
        real = mask.bool()
        inner = (real[:, 1:] & ~real[:, :-1]).any(dim=1)
        padded, pad_row = inner.any().long(), inner.to(torch.uint8).argmax()
    return torch.stack([packed, row, col, start, end, padded, pad_row]).to(torch.int64)


def raise_for(verdict: list[int], late: bool = False) -> None:
    """Raise what `batch_verdict` found (`verdict` read on the host); nothing where it found nothing."""
    packed, row, col, start, end, padded, pad_row = verdict
    which = "the batch before this one (checked a call late, not to synchronise the device): " if late else ""
    if packed:
        raise ValueError(
            f"shard_batch: {which}`position_ids` row {row} goes from {start} to {end} at token {col + 1}: packed "
            "sequences (positions restarting) are not supported under sequence parallelism. Pass one sequence "
            "per row (pad with an attention_mask), or train without sequence parallelism.")
    if padded:
        raise ValueError(
            f"shard_batch: {which}`attention_mask` row {pad_row} has a real token after a pad (left or inner "
            "padding): under sequence parallelism only right padding is supported (the pads become ignored "
            "targets and the causal mask does the rest). Set the tokenizer's padding_side='right'.")


def check_now(verdict: torch.Tensor) -> None:
    """Read the verdict at once (on a device batch: one synchronisation)."""
    raise_for(verdict.tolist())


class BatchChecks:
    """A batch's verdict read without synchronising the device: the first batch's at once (a
    packing collator or a tokenizer padding on the left shows there, before any step), each later
    one copied to page-locked memory on the current stream and read at a later call once its
    event has completed (`settle`; `settle(wait=True)` reads every pending one)."""

    def __init__(self, runtime=None):
        self.runtime = runtime  # (default: the runtime of the first batch's device)
        self._first = True
        self._pending: list = []  # (host verdict, its copy's event), oldest first

    def __call__(self, verdict: torch.Tensor) -> None:
        self.settle()
        if self.runtime is None:
            from superoffload_hf.device import make_runtime

            self.runtime = make_runtime(verdict.device)
        if self._first or self.runtime.host_is_device:  # (the CPU: reading it synchronises nothing)
            self._first = False
            check_now(verdict)
            return
        rt = self.runtime
        host = rt.host_empty(verdict.numel(), verdict.dtype, pinned=True)
        rt.copy_(host, verdict)  # on the current stream: after the kernels that computed it
        copied = rt.new_event()
        copied.record(rt.current_stream())
        self._pending.append((host, copied))

    def settle(self, wait: bool = False) -> None:
        # a third pending verdict: the host has run two batches ahead, the oldest is waited for
        while self._pending and (wait or len(self._pending) > 2 or self._pending[0][1].query()):
            host, copied = self._pending.pop(0)
            copied.synchronize()
            raise_for(host.tolist(), late=True)
