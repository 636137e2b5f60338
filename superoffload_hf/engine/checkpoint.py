"""The optimizer's state dict: torch.optim's layout, per parameter, plain CPU fp32 tensors.

    {"state": {i: {"step": int, "exp_avg": T, "exp_avg_sq": T, "master_param": T}},
     "param_groups": [{..hyperparameters.., "params": [i, ...]}],
     "superoffload": {"format_version": 1, "state_precision": "fp32" | "compact" | "compact32",
                      "loss_scale": {..}, "speculation": {..},
                      "counters": {..the counts; no wall-clock seconds..}, "plan": None | {"ready_order", "deferred", "device_buckets"},
                      "layout": {..plan/layout.py Layout.to_dict()..},
                      "checksums": {i: {"exp_avg": crc32, "exp_avg_sq": crc32, "master_param": crc32}}}}

As in torch.optim, a parameter has an entry only once it has been stepped, and the tensors
reference the live state: a host bucket's are views of its buffers (saving the state dict adds
no copy of the state; `torch.save` writes each buffer once however many views point into it),
a device-resident bucket's are CPU copies. So a state dict taken with `state_dict()` and read
later shows the state as it is then (and, after the plan changed, the buffers as they were
when it was taken); writing into it writes into the optimizer's masters and moments (the
device weights follow at the next step, or at `load_state_dict`). `copy.deepcopy` it to keep
a snapshot in memory. The checksums describe the state when `state_dict()` ran: save the state
dict before training goes on (as the Trainer does), or a later load refuses it. Tensors are shaped
like their parameter, so a checkpoint loads under another bucket size or
device-bucket count; `torch.load(weights_only=True)` reads it, with any `map_location`.
Loading copies everything back into the engine's fp32 buffers (host or device) and refreshes the
device parameters from the masters.

Compact state (`state_precision` "compact" / "compact32"): a parameter of a compact host bucket
is stored as its bytes, {"step", "master_bf16", "master_err", "exp_avg_q", "exp_avg_scale",
"exp_avg_sq_q", "exp_avg_sq_scale"} (flat; the scales one per group of 32 of the parameter's
elements: every parameter starts a group, so the entry is the same bytes under any plan), about
5-6 bytes per parameter in the file; a device-resident bucket's parameters keep fp32 entries.
Loading converts an entry of the other precision (fp32 <-> compact, either way, engine/precision.py)
with one notice in the log; within one precision the bytes are copied as they are, so a resumed
run continues bit-identically.

Checksums: the CRC-32 of every state tensor's fp32 bytes is stored with the state and checked on
load, before anything changes, so a file damaged on disk (finite garbage in a moment resumes
"successfully" otherwise, and trains to a different loss) is refused with the parameter and key
it hit. A state dict without checksums (older versions, torch.optim) loads unchecked.

Layout: the layout value the state was saved under (device dtype, cast, state precision, bucket
plan, buffers, which units flow) is stored with it. The state is per parameter, so it loads
under any other layout; where the saved one differs, loading says so in one notice naming each
decision that changed (the state precision is converted, as above; everything else needs no
conversion: the masters are fp32 or compact whatever the plan, and flowing weights are fetched
from the loaded masters).
"""

from __future__ import annotations

import logging
import types
import zlib
from typing import Any, Iterator, Mapping, Optional

import torch

from superoffload_hf.plan.memory import COMPACT_KINDS
from superoffload_hf.host.compact import scale_numel

from superoffload_hf.errors import CorruptStateError  # noqa: F401 (raised here, caught by the CLI)

FORMAT_VERSION = 1
MOMENT_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master_param": "master"}
COMPACT_KEYS = COMPACT_KINDS  # a compact entry's keys are its buffer kinds
MASTER_KINDS = ("master", "master_bf16", "master_err")  # kept when an entry has no state

logger = logging.getLogger("superoffload_hf")




def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's values as contiguous CPU fp32 bytes (a read: no copy when the tensor
    already is one)."""
    values = tensor.detach().to("cpu", torch.float32).contiguous()
    return zlib.crc32(values.reshape(-1).numpy()) if values.numel() else 0


def state_dict(engine, groups: list[dict]) -> dict:
    if engine.dp is not None:  # this rank's shard only (engine/shard_checkpoint.py)
        return engine.dp.state_dict(groups, _extras(engine))
    engine.synchronize()
    state, checksums = {}, {}
    for index, step in enumerate(engine.param_steps):
        if step == 0:
            continue  # as torch.optim: no state before a parameter's first step
        values = engine.export_param(index)
        keys = _entry_keys(values)
        state[index] = {"step": int(step), **{key: values[name] for key, name in keys.items()}}
        checksums[index] = {key: tensor_crc32(values[name]) for key, name in keys.items()}
    return {
        "state": dict(sorted(state.items())),
        "param_groups": _groups_with_indices(groups),
        "superoffload": {
            "format_version": FORMAT_VERSION,
            "state_precision": engine.config.state_precision,
            "loss_scale": engine.loss_scale.state_dict(),
            "speculation": engine.policy.state_dict(),
            "counters": engine.counters.counts(),
            "plan": engine.learned,
            "layout": engine.layout.to_dict(),
            "checksums": dict(sorted(checksums.items())),
        },
    }


class ParamStateView(Mapping):
    """`optimizer.state`: parameter -> {"step", "exp_avg", "exp_avg_sq"} (torch.optim's keys; the
    step a 0-d fp32 tensor), for the parameters stepped so far, as torch.optim's state holds them.

    Each read makes fp32 CPU copies of the state as it is then (after waiting for the host's jobs):
    read-only, a write into them does not reach the optimizer (load_state_dict does). Compact
    state: the decoded values. Data parallelism: this rank's shard, the 1-d range of the flattened
    parameter it owns (`start`/`end` in this rank's `state_dict()["pieces"]`), no gather, so any
    rank may read alone; a parameter with no element on this rank is absent. A managed
    parameter not stepped yet reads as {} (torch's defaultdict) but is not `in` the state."""

    def __init__(self, engine):
        self._engine = engine  # (not the optimizer: no reference cycle)

    def _index(self, p: Any) -> Optional[int]:
        engine = self._engine
        if engine.closed or not isinstance(p, torch.Tensor):
            return None
        return engine.buckets.index_of.get(p)

    def _stepped(self) -> list[int]:
        engine = self._engine
        if engine.closed:
            return []
        steps = engine.param_steps
        if engine.dp is None:
            return [i for i, step in enumerate(steps) if step > 0]
        return sorted({piece[0] for piece in engine.dp.pieces() if piece[4] > 0})

    def __getitem__(self, p: Any) -> Mapping[str, torch.Tensor]:
        index = self._index(p)
        if index is None:
            raise KeyError("not a parameter of this optimizer" + (" (it is closed)" if self._engine.closed else ""))
        if index not in self._stepped():
            return types.MappingProxyType({})
        return types.MappingProxyType(param_state(self._engine, index))

    def __contains__(self, p: Any) -> bool:
        index = self._index(p)
        return index is not None and index in self._stepped()

    def __iter__(self) -> Iterator[torch.Tensor]:
        params = self._engine.params
        return iter([params[i] for i in self._stepped()])

    def __len__(self) -> int:
        return len(self._stepped())

    def __repr__(self) -> str:
        return f"ParamStateView({len(self)} parameters with state)"


def param_state(engine, index: int) -> dict[str, torch.Tensor]:
    """Parameter `index`'s step and moments as new fp32 CPU tensors (ParamStateView)."""
    from superoffload_hf.engine.precision import convert, precision_of

    engine.synchronize()
    shape = tuple(engine.params[index].shape)
    if engine.dp is None:
        values = engine.export_param(index)
    else:
        values = next(piece[5] for piece in engine.dp.pieces() if piece[0] == index)
        shape = (-1,)
    if precision_of(values) != "fp32":
        values = convert(values, "fp32", engine.buckets.codec)
    out = {"step": torch.tensor(float(engine.param_steps[index]), dtype=torch.float32)}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = values[key].detach().to("cpu", torch.float32, copy=True).reshape(shape)
    return out


def _entry_keys(values: Mapping[str, Any]) -> dict[str, str]:
    """Entry key -> buffer kind: the fp32 names torch.optim uses, or the compact kinds as they are."""
    return {key: key for key in COMPACT_KEYS} if "master_bf16" in values else MOMENT_KEYS


def _extras(engine) -> dict:
    return {"format_version": FORMAT_VERSION, "loss_scale": engine.loss_scale.state_dict(),
            "speculation": engine.policy.state_dict(), "counters": engine.counters.counts(),
            "layout": engine.layout.to_dict()}


def load_state_dict(engine, groups: list[dict], sd: Any) -> None:
    from superoffload_hf.engine.dp import is_sharded_input
    from superoffload_hf.engine.shard_checkpoint import RangeSource, consolidate

    if not is_sharded_input(sd):
        sd = _state_by_position(sd)
    if engine.dp is not None:  # any saved layout: this rank reads its own ranges
        source = RangeSource.of(sd)
        _check_layout({"state": {}, "param_groups": source.param_groups, "superoffload": {}}, groups)
        engine.dp.load_state_dict(sd)
        _load_extras(engine, groups, source.param_groups, source.extra)
        engine.refresh_device_params()
        return
    if is_sharded_input(sd):  # every rank's shard files, read in one process
        sd = consolidate(RangeSource.of(sd))
    _check_layout(sd, groups)
    saved_state = {int(index): entry for index, entry in sd["state"].items()}
    for index, entry in saved_state.items():  # check everything before changing anything
        if not 0 <= index < len(engine.params):
            raise ValueError(f"The state dict has state for parameter {index}; this optimizer has "
                             f"{len(engine.params)} parameters (0..{len(engine.params) - 1}).")
        _check_entry(entry, index, tuple(engine.params[index].shape))
    _check_checksums(saved_state, (sd.get("superoffload") or {}).get("checksums"))
    engine.synchronize()
    if engine.has_pending_gradients():
        raise RuntimeError("load_state_dict() was called between backward and step(); load a checkpoint "
                           "before the backward of the step that should use it (or call zero_grad() first).")
    extra = sd.get("superoffload") or {}
    if extra.get("plan"):
        engine.adopt_learned(extra["plan"])
    converted: dict[tuple[str, str], int] = {}
    for index in range(len(engine.params)):
        change = _load_param(engine, index, saved_state.get(index, {}))
        if change is not None:
            converted[change] = converted.get(change, 0) + 1
    for (saved, ours), count in sorted(converted.items()):
        logger.warning("SuperOffload: converted the saved optimizer state of %d parameter%s from %s to %s "
                       "(this optimizer's state precision there)", count, "" if count == 1 else "s", saved, ours)
    _load_extras(engine, groups, sd["param_groups"], extra)
    engine.refresh_device_params()


def _state_by_position(sd: Any) -> Any:
    """As torch.optim reads a state dict: a state key names the parameter at its place in the
    saved param groups' "params" (our indices, or torch.distributed.checkpoint's names)."""
    if not isinstance(sd, Mapping) or "state" not in sd or "param_groups" not in sd:
        return sd  # (_check_layout says what is missing)
    position = {key: i for i, key in enumerate(k for g in sd["param_groups"] for k in g["params"])}
    if all(position.get(key) == key for key in sd["state"]):
        return sd
    state = {}
    for key, entry in sd["state"].items():
        if key not in position:
            raise ValueError(f"The state dict has state for {key!r}, which no saved param group lists in its "
                             "'params'. Is it from another model?")
        state[position[key]] = entry
    return {**sd, "state": state}


def _load_extras(engine, groups: list[dict], saved_groups: list, extra: Mapping[str, Any]) -> None:
    for group, saved in zip(groups, saved_groups):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})
    if "loss_scale" in extra:
        engine.loss_scale.load_state_dict(extra["loss_scale"])
    if "speculation" in extra:
        engine.policy.load_state_dict(extra["speculation"])
    if "counters" in extra:
        engine.counters.load_dict(extra["counters"])
    if extra.get("layout"):
        check_layout_change(engine.layout, extra["layout"])


def check_layout_change(layout, saved: Mapping[str, Any]) -> list[str]:
    """One notice when the checkpoint's layout (`saved`, Layout.to_dict()) differs from this
    engine's; the differences, "decision: saved -> this" each."""
    changed = layout.differences(saved)
    if changed:
        logger.warning("SuperOffload: the checkpoint was saved under another layout; its state is per parameter "
                       "and loads into this one (%s)", "; ".join(changed))
    return changed


def _load_param(engine, index: int, entry: Mapping[str, Any]):
    """An empty entry (no state saved: never stepped) resets the moments and the step count
    and keeps the current master weights; a torch.optim entry has no master either (the current
    one, as fp32). Returns (saved precision, this bucket's) where it converted, else None."""
    from superoffload_hf.engine.precision import convert, precision_of

    step = int(float(entry.get("step", 0)))
    if "master_bf16" in entry:
        return _converted(engine, index, engine.import_param(index, {k: entry[k] for k in COMPACT_KEYS}, step), entry)
    current = engine.export_param(index)
    if not entry:  # the current master (in its precision), zero moments
        values = {kind: (t if kind in MASTER_KINDS else torch.zeros_like(t)) for kind, t in current.items()}
        engine.import_param(index, values, step)
        return None
    if "master_param" not in entry:  # torch.optim
        master = convert(current, "fp32", engine.buckets.codec)["master"] if precision_of(current) != "fp32" else current["master"]
        entry = {**entry, "master_param": master}
    values = {name: entry[key] for key, name in MOMENT_KEYS.items()}
    return _converted(engine, index, engine.import_param(index, values, step), entry)


def _converted(engine, index: int, converted: bool, entry: Mapping[str, Any]):
    from superoffload_hf.engine.precision import precision_of

    if not converted:
        return None
    saved = precision_of({k: entry[k] for k in ("master_bf16", "master_err") if k in entry})
    return saved, engine.buckets.precision_of(index)


def _check_entry(entry: Mapping[str, Any], index: int, shape: tuple) -> None:
    if "master_bf16" in entry:
        return _check_compact_entry(entry, index, shape)
    for key in MOMENT_KEYS:
        if key not in entry:
            if key == "master_param":
                continue  # a torch.optim checkpoint: the current master weights are kept
            raise KeyError(f"The state of parameter {index} has no {key!r}; keys are {sorted(entry)}.")
        value = entry[key]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(f"state[{index}][{key!r}] must be a floating-point tensor, got {type(value).__name__}.")
        if value.numel() != torch.Size(shape).numel():
            raise ValueError(f"state[{index}][{key!r}] has shape {tuple(value.shape)}; parameter {index} has "
                             f"shape {shape}. Is this checkpoint from another model?")


COMPACT_DTYPES = {"master_bf16": (torch.bfloat16,), "master_err": (torch.int8, torch.int16),
                  "exp_avg_q": (torch.int8,), "exp_avg_scale": (torch.bfloat16,), "exp_avg_sq_q": (torch.uint8,),
                  "exp_avg_sq_scale": (torch.bfloat16,)}


def _check_compact_entry(entry: Mapping[str, Any], index: int, shape: tuple) -> None:
    numel = torch.Size(shape).numel()
    for key, dtypes in COMPACT_DTYPES.items():
        if key not in entry:
            raise KeyError(f"The compact state of parameter {index} has no {key!r}; keys are {sorted(entry)}.")
        value = entry[key]
        if not isinstance(value, torch.Tensor) or value.dtype not in dtypes:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"state[{index}][{key!r}] is {got}; expected a tensor of {' or '.join(map(str, dtypes))} "
                            "(compact state, superoffload_hf/host/compact.py). Is this file damaged?")
        expected = scale_numel(numel) if key.endswith("_scale") else numel
        if value.numel() != expected:
            raise ValueError(f"state[{index}][{key!r}] has {value.numel()} elements; parameter {index} (shape {shape}) "
                             f"needs {expected}. Is this checkpoint from another model?")


def _check_checksums(saved_state: Mapping[int, Mapping[str, Any]], checksums: Any) -> None:
    if not checksums:
        return  # saved without checksums: nothing to verify against
    checksums = {int(index): entry for index, entry in checksums.items()}
    for index, entry in saved_state.items():
        for key, expected in checksums.get(index, {}).items():
            if key in entry and tensor_crc32(entry[key]) != int(expected):
                raise CorruptStateError(
                    f"The optimizer state is corrupt: state[{index}][{key!r}] does not match the checksum "
                    "saved with it (the file was damaged after it was written, or the state dict was saved "
                    "after training went on past `state_dict()`: its tensors are views of the live state). "
                    "Resume from an earlier "
                    "checkpoint, or, deliberately, resume the model weights only with a fresh optimizer."
                )


def _check_layout(sd: Mapping[str, Any], groups: list[dict]) -> None:
    if not isinstance(sd, Mapping) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("Expected an optimizer state dict with keys 'state' and 'param_groups'; got "
                         f"{sorted(sd) if isinstance(sd, Mapping) else type(sd).__name__}.")
    saved = sd["param_groups"]
    if len(saved) != len(groups):
        raise ValueError(f"The state dict has {len(saved)} param groups; this optimizer has {len(groups)}.")
    for g, (ours, theirs) in enumerate(zip(groups, saved)):
        if len(theirs["params"]) != len(ours["params"]):
            raise ValueError(f"Param group {g} of the state dict has {len(theirs['params'])} parameters; "
                             f"this optimizer's has {len(ours['params'])}.")
        for option in ("amsgrad", "maximize"):  # a torch.optim state dict asking for what we do not do
            if theirs.get(option, False):
                raise ValueError(f"Param group {g} of the state dict has `{option}` {theirs[option]!r}; SuperOffload "
                                 f"optimizers support only {option}=False (the state was saved by another optimizer).")
    version = (sd.get("superoffload") or {}).get("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ValueError(f"State dict format_version {version}; this version of superoffload_hf reads {FORMAT_VERSION}.")


def _groups_with_indices(groups: list[dict]) -> list[dict]:
    out, start = [], 0
    for group in groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        out.append(entry)
    return out
