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
Loading converts an entry of the other precision (fp32 <-> compact, either way, engine/state/precision.py)
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
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from superoffload_hf.engine.state.precision import convert, precision_of
from superoffload_hf.engine.state.saved import COMPACT_KEYS, FORMAT_VERSION, MASTER_KINDS, MOMENT_KEYS, tensor_crc32
from superoffload_hf.engine.dp.checkpoint import RangeSource, consolidate, is_sharded_input
from superoffload_hf.host.compact import scale_numel

from superoffload_hf.errors import CorruptStateError  # noqa: F401 (raised here, caught by the CLI)


logger = logging.getLogger("superoffload_hf")




def state_dict(buckets, groups: list[dict], extras: Mapping[str, Any]) -> dict:
    """The whole state (one process; the caller waited for the host's jobs). `extras`: the
    "superoffload" entries (engine/core.py Engine.checkpoint_extras), the checksums added here."""
    state, checksums = {}, {}
    for index, step in enumerate(buckets.param_steps):
        if step == 0:
            continue  # as torch.optim: no state before a parameter's first step
        values = buckets.export_param(index)
        keys = _entry_keys(values)
        state[index] = {"step": int(step), **{key: values[name] for key, name in keys.items()}}
        checksums[index] = {key: tensor_crc32(values[name]) for key, name in keys.items()}
    return {
        "state": dict(sorted(state.items())),
        "param_groups": _groups_with_indices(groups),
        "superoffload": {**extras, "checksums": dict(sorted(checksums.items()))},
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

    def __init__(self, route, params: list, index_of: Mapping, is_open: Callable[[], bool],
                 synchronize: Callable[[], None], codec):
        # the route's pieces (this process's, or this rank's shard), never the optimizer: no cycle
        self._route, self._params, self._index_of = route, params, index_of
        self._is_open, self._synchronize, self._codec = is_open, synchronize, codec

    def _index(self, p: Any) -> Optional[int]:
        if not self._is_open() or not isinstance(p, torch.Tensor):
            return None
        return self._index_of.get(p)

    def _stepped(self) -> list[int]:
        return self._route.stepped() if self._is_open() else []

    def __getitem__(self, p: Any) -> Mapping[str, torch.Tensor]:
        index = self._index(p)
        if index is None:
            raise KeyError("not a parameter of this optimizer" + ("" if self._is_open() else " (it is closed)"))
        if index not in self._stepped():
            return types.MappingProxyType({})
        self._synchronize()
        values, shape, step = self._route.param_values(index)
        return types.MappingProxyType(param_state(values, shape, step, self._codec))

    def __contains__(self, p: Any) -> bool:
        index = self._index(p)
        return index is not None and index in self._stepped()

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([self._params[i] for i in self._stepped()])

    def __len__(self) -> int:
        return len(self._stepped())

    def __repr__(self) -> str:
        return f"ParamStateView({len(self)} parameters with state)"


def param_state(values: Mapping[str, torch.Tensor], shape: tuple, step: int, codec) -> dict[str, torch.Tensor]:
    """A parameter's step and moments as new fp32 CPU tensors (ParamStateView), from its state
    `values` (any precision: `codec` decodes compact state)."""
    if precision_of(values) != "fp32":
        values = convert(values, "fp32", codec)
    out = {"step": torch.tensor(float(step), dtype=torch.float32)}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = values[key].detach().to("cpu", torch.float32, copy=True).reshape(shape)
    return out


def _entry_keys(values: Mapping[str, Any]) -> dict[str, str]:
    """Entry key -> buffer kind: the fp32 names torch.optim uses, or the compact kinds as they are."""
    return {key: key for key in COMPACT_KEYS} if "master_bf16" in values else MOMENT_KEYS


def load_state_dict(buckets, params: list, groups: list[dict], sd: Any, adopt_plan: Callable[[dict], None]) -> tuple:
    """Load a whole state dict (one process; or every rank's shard files, consolidated here) into
    `buckets`, checking everything before changing anything; the caller waited for the host's
    jobs. `adopt_plan`: the saved learned plan (the engine re-plans before the state moves in).
    Returns (saved param groups, the "superoffload" extras) for `load_extras`."""
    if is_sharded_input(sd):  # every rank's shard files, read in one process
        sd = consolidate(RangeSource.of(sd))
    _check_layout(sd, groups)
    saved_state = {int(index): entry for index, entry in sd["state"].items()}
    for index, entry in saved_state.items():  # check everything before changing anything
        if not 0 <= index < len(params):
            raise ValueError(f"The state dict has state for parameter {index}; this optimizer has "
                             f"{len(params)} parameters (0..{len(params) - 1}).")
        _check_entry(entry, index, tuple(params[index].shape))
    _check_checksums(saved_state, (sd.get("superoffload") or {}).get("checksums"))
    if any(any(rt.present) for rt in buckets.runtimes):
        raise RuntimeError("load_state_dict() was called between backward and step(); load a checkpoint "
                           "before the backward of the step that should use it (or call zero_grad() first).")
    extra = sd.get("superoffload") or {}
    if extra.get("plan"):
        adopt_plan(extra["plan"])
    converted: dict[tuple[str, str], int] = {}
    for index in range(len(params)):
        change = _load_param(buckets, index, saved_state.get(index, {}))
        if change is not None:
            converted[change] = converted.get(change, 0) + 1
    for (saved, ours), count in sorted(converted.items()):
        logger.warning("SuperOffload: converted the saved optimizer state of %d parameter%s from %s to %s "
                       "(this optimizer's state precision there)", count, "" if count == 1 else "s", saved, ours)
    return sd["param_groups"], extra


def by_position(sd: Any) -> Any:
    """A single-process state dict keyed as torch.optim reads it (shard inputs as they are)."""
    return sd if is_sharded_input(sd) else _state_by_position(sd)


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


def load_extras(groups: list[dict], saved_groups: list, extra: Mapping[str, Any], *, loss_scale, policy, counters,
                layout) -> None:
    """The saved hyperparameters into `groups`; the loss scale, the speculation policy's record
    and the counters; one notice where the saved layout differs from `layout`."""
    for group, saved in zip(groups, saved_groups):
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items() if k != "params"})
    if "loss_scale" in extra:
        loss_scale.load_state_dict(extra["loss_scale"])
    if "speculation" in extra:
        policy.load_state_dict(extra["speculation"])
    if "counters" in extra:
        counters.load_dict(extra["counters"])
    if extra.get("layout"):
        check_layout_change(layout, extra["layout"])


def check_layout_change(layout, saved: Mapping[str, Any]) -> list[str]:
    """One notice when the checkpoint's layout (`saved`, Layout.to_dict()) differs from this
    engine's; the differences, "decision: saved -> this" each."""
    changed = layout.differences(saved)
    if changed:
        logger.warning("SuperOffload: the checkpoint was saved under another layout; its state is per parameter "
                       "and loads into this one (%s)", "; ".join(changed))
    return changed


def _import(buckets, index: int, values: Mapping[str, torch.Tensor], step: int) -> bool:
    """Whether the state was converted (another state precision than its bucket's)."""
    converted = buckets.import_param(index, values)
    buckets.param_steps[index] = int(step)
    return converted


def _load_param(buckets, index: int, entry: Mapping[str, Any]):
    """An empty entry (no state saved: never stepped) resets the moments and the step count
    and keeps the current master weights; a torch.optim entry has no master either (the current
    one, as fp32). Returns (saved precision, this bucket's) where it converted, else None."""
    step = int(float(entry.get("step", 0)))
    if "master_bf16" in entry:
        return _converted(buckets, index, _import(buckets, index, {k: entry[k] for k in COMPACT_KEYS}, step), entry)
    current = buckets.export_param(index)
    if not entry:  # the current master (in its precision), zero moments
        values = {kind: (t if kind in MASTER_KINDS else torch.zeros_like(t)) for kind, t in current.items()}
        _import(buckets, index, values, step)
        return None
    if "master_param" not in entry:  # torch.optim
        master = convert(current, "fp32", buckets.codec)["master"] if precision_of(current) != "fp32" else current["master"]
        entry = {**entry, "master_param": master}
    values = {name: entry[key] for key, name in MOMENT_KEYS.items()}
    return _converted(buckets, index, _import(buckets, index, values, step), entry)


def _converted(buckets, index: int, converted: bool, entry: Mapping[str, Any]):
    if not converted:
        return None
    saved = precision_of({k: entry[k] for k in ("master_bf16", "master_err") if k in entry})
    return saved, buckets.precision_of(index)


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
