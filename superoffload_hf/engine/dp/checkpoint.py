"""Optimizer state under data parallelism: one file per rank, independent of the world size.

Each rank saves only what it owns, as *pieces*: for every parameter its shard covers, the element
range `[start, end)` of the parameter's flattened values, with the fp32 master and both moments
of that range. A shard state dict (`torch.save`-able, `torch.load(weights_only=True)` readable):

    {"format": "superoffload-shard", "format_version": 1, "rank": r, "world": N,
     "pieces": {i: {"start", "end", "numel", "shape", "step",
                    "master_param": T, "exp_avg": T, "exp_avg_sq": T, "checksums": {key: crc32}}},
     "param_groups": [...], "superoffload": {loss_scale, speculation, counters}}

Nothing in it depends on the bucket layout or on N: a reader asks a `RangeSource` for any range
of any parameter, and the source assembles it from whichever pieces overlap it. So a checkpoint
saved by N ranks loads on M ranks (each rank reads only its own ranges: with
`torch.load(mmap=True)` only those pages are read), under another bucket size, and in one process
(`consolidate` turns the pieces into the single-process state dict of checkpoint.py, which is
also the consolidated export: every parameter's fp32 master and moments in one file). A
single-process state dict is a `RangeSource` too (1 -> N).

Step counts: every rank steps every parameter the same number of times, so each piece carries
its parameter's count; a parameter without state (never stepped) has no piece.

Compact state (engine/state/precision.py): a piece of a compact host bucket's parameter holds its
bytes instead, the six compact kinds (`master_bf16` ... `exp_avg_sq_scale`, the scales one per
group of 32 of the piece's elements). Compact shards start at group boundaries (shard.py
`align`), so every piece starts at a multiple of 32 of its parameter's elements and every piece
but the parameter's last ends at one: the pieces' scales concatenate to the parameter's.
`RangeSource.read_state` reads any range as either precision, converting (and, for a compact
source read at an unaligned range, decoding the groups around it) where they differ.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from superoffload_hf.engine.state.saved import tensor_crc32
from superoffload_hf.errors import CorruptStateError
from superoffload_hf.plan.memory import COMPACT_KINDS, SCALE_KINDS
from superoffload_hf.host.compact import COMPACT_GROUP, scale_numel

SHARD_FORMAT = "superoffload-shard"
SHARD_FORMAT_VERSION = 1
KEYS = ("master_param", "exp_avg", "exp_avg_sq")
FP32_KINDS = {"master_param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # key -> buffer kind
SHARD_FILE = "optimizer.shard-{rank:05d}-of-{world:05d}.pt"


def is_shard_state(sd: Any) -> bool:
    return isinstance(sd, Mapping) and sd.get("format") == SHARD_FORMAT


def is_sharded_input(state: Any) -> bool:
    """A list of shard state dicts, or one."""
    return is_shard_state(state) or (isinstance(state, (list, tuple)) and bool(state)
                                     and all(is_shard_state(s) for s in state))


def shard_state_dict(pieces: Iterable[tuple[int, int, int, tuple, int, Mapping[str, torch.Tensor]]], *,
                     rank: int, world: int, param_groups: list, extra: Mapping[str, Any]) -> dict:
    """`pieces`: (param index, start, end, param shape, step, values) per piece; values: {key: 1-d
    fp32 tensor} of KEYS, or a compact piece's six kinds (their bytes are saved as they are)."""
    out = {}
    for index, start, end, shape, step, values in pieces:
        if step == 0:
            continue  # as torch.optim: no state before a parameter's first step
        if "master_bf16" in values:
            tensors = {key: values[key].detach().to("cpu", copy=True) for key in COMPACT_KINDS}
        else:
            tensors = {key: values[key].detach().to("cpu", torch.float32, copy=True) for key in KEYS}
        out[int(index)] = {"start": int(start), "end": int(end), "numel": int(torch.Size(shape).numel()),
                           "shape": list(shape), "step": int(step), **tensors,
                           "checksums": {key: tensor_crc32(t) for key, t in tensors.items()}}
    return {"format": SHARD_FORMAT, "format_version": SHARD_FORMAT_VERSION, "rank": int(rank),
            "world": int(world), "pieces": dict(sorted(out.items())), "param_groups": param_groups,
            "superoffload": dict(extra)}


class RangeSource:
    """Read any element range of any parameter's saved state, from shard state dicts (any world
    size) or a single-process state dict."""

    def __init__(self, pieces: Mapping[int, list[Mapping[str, Any]]], param_groups: list,
                 extra: Mapping[str, Any], masters: bool = True):
        self.pieces = pieces  # param index -> its saved pieces, by start
        self.param_groups = param_groups
        self.extra = extra
        self.masters = masters  # False: a torch.optim state dict (no fp32 masters)

    @classmethod
    def of(cls, state: Any) -> "RangeSource":
        """From a single-process state dict, one shard state dict, or a list of them (every rank's)."""
        if isinstance(state, Mapping) and not is_shard_state(state):
            return cls._of_full(state)
        shards = [state] if is_shard_state(state) else list(state)
        if not shards or not all(is_shard_state(s) for s in shards):
            raise ValueError("Expected shard state dicts (format 'superoffload-shard'), e.g. from "
                             "`read_shards(checkpoint_dir)`.")
        worlds = {int(s["world"]) for s in shards}
        ranks = sorted(int(s["rank"]) for s in shards)
        if len(worlds) != 1 or ranks != list(range(worlds.pop())):
            raise ValueError(f"Incomplete or mixed sharded optimizer state: ranks {ranks} of worlds "
                             f"{sorted({int(s['world']) for s in shards})}; every rank's shard file is needed.")
        pieces: dict[int, list] = {}
        for s in shards:
            if s.get("format_version") != SHARD_FORMAT_VERSION:
                raise ValueError(f"Shard format_version {s.get('format_version')}; this version reads "
                                 f"{SHARD_FORMAT_VERSION}.")
            for index, piece in s["pieces"].items():
                pieces.setdefault(int(index), []).append(piece)
        for index, found in pieces.items():
            found.sort(key=lambda p: int(p["start"]))
            _check_coverage(index, found)
        return cls(pieces, shards[0]["param_groups"], shards[0].get("superoffload") or {})

    @classmethod
    def _of_full(cls, sd: Mapping[str, Any]) -> "RangeSource":
        pieces, masters = {}, True
        for index, entry in sd["state"].items():
            compact = "master_bf16" in entry  # flat: its shape is not saved
            any_tensor = entry["master_bf16" if compact else "exp_avg"]
            masters &= compact or "master_param" in entry
            flat = {key: entry[key].reshape(-1) for key in (COMPACT_KINDS if compact else KEYS) if key in entry}
            pieces[int(index)] = [{"start": 0, "end": any_tensor.numel(), "numel": any_tensor.numel(),
                                   "shape": list(any_tensor.shape), "step": int(float(entry.get("step", 0))),
                                   **flat}]
        return cls(pieces, sd["param_groups"], sd.get("superoffload") or {}, masters)

    def indices(self) -> list[int]:
        return sorted(self.pieces)

    def step(self, index: int) -> int:
        found = self.pieces.get(index)
        return int(found[0]["step"]) if found else 0

    def numel(self, index: int) -> Optional[int]:
        found = self.pieces.get(index)
        return int(found[0]["numel"]) if found else None

    def precision(self, index: int) -> str:
        """"fp32", "compact" or "compact32": the precision parameter `index` was saved in."""
        from superoffload_hf.engine.state.precision import precision_of

        return precision_of(self.pieces[index][0])

    def read(self, index: int, start: int, end: int) -> dict[str, torch.Tensor]:
        """CPU tensors of elements [start, end) of parameter `index` as saved: fp32 (keys:
        master_param when saved, exp_avg, exp_avg_sq), or compact bytes (the six kinds; then
        `start` is a multiple of the group and `end` one or the parameter's end); checksums of
        the pieces read are verified."""
        compact = "master_bf16" in self.pieces[index][0]
        numel = int(self.pieces[index][0]["numel"])
        if compact and (start % COMPACT_GROUP or (end % COMPACT_GROUP and end != numel)):
            raise ValueError(f"Elements [{start}, {end}) of parameter {index}'s compact state: a compact range "
                             f"starts at a multiple of {COMPACT_GROUP} and ends at one or at the parameter's end "
                             f"({numel}); read it with read_state() to get any range.")
        out: dict[str, list] = {}
        for piece in self.pieces[index]:
            lo, hi = max(start, int(piece["start"])), min(end, int(piece["end"]))
            if lo >= hi:
                continue
            _verify(index, piece)
            base = int(piece["start"])
            for key in (COMPACT_KINDS if compact else KEYS):
                if key not in piece:
                    continue
                if key in SCALE_KINDS:  # pieces start at group boundaries (module docstring)
                    part = piece[key][(lo - base) // COMPACT_GROUP:scale_numel(hi - base)]
                else:
                    part = piece[key][lo - base:hi - base]
                out.setdefault(key, []).append(part if compact else part.to(torch.float32))
        return {key: torch.cat(parts) for key, parts in out.items()}

    def read_state(self, index: int, start: int, end: int, precision: str, codec) -> tuple[dict, bool]:
        """Elements [start, end) of parameter `index` as `precision` state, in buffer kinds
        (memory.py: fp32 `master` (when saved) / `exp_avg` / `exp_avg_sq`, or the compact six),
        and whether it was converted from the other precision (`codec`: a host Adam back end,
        engine/state/precision.py). A compact target range starts at a group boundary (shard.py)."""
        from superoffload_hf.engine.state.precision import convert

        saved = self.precision(index)
        if saved == precision:
            values = self.read(index, start, end)
            return ({FP32_KINDS[k]: v for k, v in values.items()} if saved == "fp32" else values), False
        if saved == "fp32":  # to compact: the range is group-aligned, so its groups are the parameter's
            fp32 = {FP32_KINDS[k]: v for k, v in self.read(index, start, end).items()}
            if "master" not in fp32:
                raise ValueError(f"The saved state of parameter {index} has no fp32 master (a torch.optim "
                                 "state dict): it cannot be converted to compact state here; load it into "
                                 "fp32 state (`state_precision: fp32`), or save it with superoffload first.")
            return convert(fp32, precision, codec), True
        numel = int(self.pieces[index][0]["numel"])
        lo, hi = start - start % COMPACT_GROUP, min(-(-end // COMPACT_GROUP) * COMPACT_GROUP, numel)
        values = convert(self.read(index, lo, hi), "fp32" if precision == "fp32" else precision, codec)
        if precision != "fp32":  # compact <-> compact32 (the range is aligned)
            return values, True
        return {k: v[start - lo:end - lo] for k, v in values.items()}, True


def consolidate(source: RangeSource, num_params: Optional[int] = None) -> dict:
    """The single-process state dict (checkpoint.py's format) of everything `source` holds."""
    state = {}
    for index in source.indices():
        piece = source.pieces[index][0]
        values = source.read(index, 0, int(piece["numel"]))
        shape = tuple(piece["shape"])
        if "master_bf16" not in values:  # compact entries stay flat (checkpoint.py)
            values = {k: v.view(shape) for k, v in values.items()}
        state[index] = {"step": source.step(index), **values}
    extra = {k: v for k, v in source.extra.items() if k in ("loss_scale", "speculation", "counters")}
    extra["format_version"] = 1
    return {"state": state, "param_groups": source.param_groups, "superoffload": extra}


# ---- files ---------------------------------------------------------------------------------------


def shard_path(directory: str, rank: int, world: int) -> str:
    return os.path.join(directory, SHARD_FILE.format(rank=rank, world=world))


def shard_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "optimizer.shard-*-of-*.pt")))


def read_shards(directory: str) -> list[dict]:
    """Every rank's shard state dict in `directory`, memory-mapped: tensors are read only when
    a range of them is (each rank of a resumed run touches only its own ranges)."""
    files = shard_files(directory)
    index = os.path.join(directory, OPTIMIZER_FILE)
    if os.path.exists(index):  # the index save_sharded wrote: exactly its files
        listed = torch.load(index, map_location="cpu", weights_only=True).get(INDEX_KEY)
        if listed is not None:
            files = [os.path.join(directory, name) for name in listed["files"]]
    if not files:
        raise FileNotFoundError(f"No sharded optimizer state (optimizer.shard-*-of-*.pt) in {directory}.")
    return [torch.load(f, map_location="cpu", weights_only=True, mmap=True) for f in files]


INDEX_KEY = "superoffload_sharded"
OPTIMIZER_FILE = "optimizer.pt"


def write_shards(coll, directory: str, state_dict: Callable[[], dict]) -> list[str]:
    """Under data parallelism (see SuperOffloadAdamW.save_sharded): this rank's shard file (one
    of each shard's replicas writes it), then rank 0's index once every shard is on disk. A
    collective: every rank calls it. Returns the files written here."""
    os.makedirs(directory, exist_ok=True)
    t = coll.topology
    world = t.shard_world
    written = []
    if t.rank in t.shard_groups[0]:  # replicas hold the same shards
        path = shard_path(directory, t.shard_rank, world)
        torch.save(state_dict(), path)
        written.append(path)
    coll.barrier()  # every shard is on disk before the index says the set is complete
    if t.rank == 0:
        index_path = os.path.join(directory, OPTIMIZER_FILE)
        names = [os.path.basename(shard_path(directory, r, world)) for r in range(world)]
        torch.save({INDEX_KEY: {"world": world, "files": names, "format_version": SHARD_FORMAT_VERSION}},
                   index_path)
        written.append(index_path)
    coll.barrier()
    return written


def write_whole(directory: str, state_dict: Callable[[], dict]) -> list[str]:
    """One process: optimizer.pt is the whole state dict."""
    os.makedirs(directory, exist_ok=True)
    index_path = os.path.join(directory, OPTIMIZER_FILE)
    torch.save(state_dict(), index_path)
    return [index_path]


def read_saved(directory: str) -> Any:
    """Every rank's shards (memory-mapped) if `directory` has them, else its optimizer.pt."""
    if shard_files(directory):
        return read_shards(directory)
    return torch.load(os.path.join(directory, OPTIMIZER_FILE), map_location="cpu", weights_only=True, mmap=True)


def export_consolidated(directory: str, path: str) -> dict:
    """Write one file with every parameter's fp32 master and moments (single-process format) from
    the shard files in `directory`; returns the state dict. Offline: no process group needed."""
    sd = consolidate(RangeSource.of(read_shards(directory)))
    torch.save(sd, path)
    return sd


def _check_coverage(index: int, pieces: Sequence[Mapping[str, Any]]) -> None:
    position = 0
    for piece in pieces:
        if int(piece["start"]) != position:
            raise ValueError(f"The sharded optimizer state of parameter {index} misses elements "
                             f"[{position}, {int(piece['start'])}); is a shard file missing or from another run?")
        position = int(piece["end"])
    if position != int(pieces[0]["numel"]):
        raise ValueError(f"The sharded optimizer state of parameter {index} covers {position} of "
                         f"{int(pieces[0]['numel'])} elements; is a shard file missing?")


def _verify(index: int, piece: Mapping[str, Any]) -> None:
    for key, expected in (piece.get("checksums") or {}).items():
        if key in piece and tensor_crc32(piece[key]) != int(expected):
            raise CorruptStateError(
                f"The optimizer state is corrupt: elements [{piece['start']}, {piece['end']}) of parameter "
                f"{index} ({key!r}) do not match the checksum saved with them. Resume from an earlier "
                "checkpoint, or, deliberately, resume the model weights only with a fresh optimizer.")
