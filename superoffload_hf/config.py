"""SuperOffloadConfig: the one home of every default.

Each field is documented once, here. The config is frozen and validated on construction;
errors name the field, the value, what was expected and how to fix it. It loads from a dict,
a YAML file or a JSON file; unknown keys are an error (a typo must not silently keep a default).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Union

AUTO = "auto"

SPECULATION_CHOICES = ("auto", "on", "off")
ROLLBACK_CHOICES = ("inverse", "snapshot")
CAST_CHOICES = ("auto", "device", "host")
DEVICE_DTYPE_CHOICES = ("bf16", "fp16", "fp32")
PIN_METHOD_CHOICES = (AUTO, "alloc", "register")
HOST_KERNEL_CHOICES = ("auto", "cpp", "reference")
STATE_PRECISION_CHOICES = ("fp32", "compact", "compact32")
WEIGHTS_CHOICES = ("stationary", "flow", "auto")
ACTIVATION_OFFLOAD_CHOICES = ("auto", "on", "off")
TILED_CHOICES = ("auto", "on", "off")
TILED_LOSS_CHUNK_TOKENS = 1024  # at a 128K vocabulary: 0.5 GiB of fp32 logits per chunk
TILED_MLP_CHUNK_TOKENS = 4096
TILED_AUTO_SHARE = 0.125  # "auto" tiles a term larger than this share (1/8) of the free device memory


class ConfigError(ValueError):
    """A SuperOffloadConfig field has a value it cannot take."""


@dataclass(frozen=True)
class SuperOffloadConfig:
    bucket_size_mb: Union[float, str] = AUTO
    """Size of one bucket, in MB of fp32 master weights (1 MB = 2**20 bytes, so 262144
    parameters). A bucket is the unit that moves to the host and is stepped there as soon as
    backward has produced all of its gradients. "auto": a fixed heuristic, 32 MB, shrunk so
    that a model has at least 4 buckets when it is small (not measured; `superoffload probe`
    shows what the measured cost model would choose on this machine); on the CPU as the device
    (one process) never shrunk, since host jobs run inline there and more buckets overlap
    nothing."""

    device_buckets: Union[int, str] = AUTO
    """How many of the last buckets to receive gradients (the first layers) keep their fp32
    master and Adam state on the device and are stepped there, so the device does not idle at
    the end of backward. "auto": a heuristic after the first step, from host timestamps of the
    host step time against backward, within a quarter of the free device memory counted with
    the buckets' real sizes (0 when the device is the CPU); see superoffload_hf/plan/layout.py."""

    speculation: str = AUTO
    """"on": step each bucket on the host as soon as its gradients arrive, validate at
    `step()` (global norm, finiteness) and roll back / replay when validation fails. "off":
    step only after validation. "auto": speculate, but stop while recent steps roll back often
    (early training) and resume once they stop; never on the CPU device, where nothing can
    overlap the host step."""

    rollback: str = "inverse"
    """How a speculative step is undone. "inverse": invert the Adam update algebraically (a few
    ulp, see `superoffload_hf.host.reference.adam_rollback_`). "snapshot": keep a copy of the state
    before each speculative step and restore it bit-exactly (costs one extra copy of the host
    state in memory traffic and 12 bytes per parameter of host memory)."""

    cast: str = AUTO
    """Where precision casts happen. "device": move fp32 over the link and cast on the device
    (best on fast links such as NVLink-C2C). "host": cast on the host (the kernel writes the
    low-precision copy in the same pass) and move half the bytes (best on PCIe). "auto": from
    a host-to-device bandwidth measured at construction ("device" at >= 100 GB/s)."""

    device_dtype: str = "bf16"
    """Precision of the parameters the device computes with: "bf16", "fp16" (with dynamic loss
    scaling owned by the optimizer) or "fp32" (lets tests compare against a plain fp32
    reference exactly)."""

    state_precision: str = "fp32"
    """How the host buckets store the master weights and Adam moments. "fp32": fp32 master,
    exp_avg and exp_avg_sq (12 B/param of state). "compact": a 24-bit master (the bf16 weight
    the device computes with plus an int8 error term of its rounding remainder), exp_avg as int8
    and exp_avg_sq as uint8 of sqrt(v), each with a bf16 scale per group of 32 elements (5.125
    B/param of state; superoffload_hf/host/compact.py defines the format). "compact32": as
    "compact" with an int16 error term (6.125 B/param), for low learning rates, where a 24-bit
    master loses updates. Compact state needs `device_dtype: bf16` (the bf16 part of the master
    is the device copy, sent back as it is). Every host-bucket parameter is compact, norms and
    biases included, each slot padded to a multiple of 32 elements; device-resident buckets
    keep fp32 state on the device. A speculative step of a compact bucket is undone by
    restoring the bytes it had before (whatever `rollback` says: quantisation is not
    invertible)."""

    weights: str = "stationary"
    """Where the low-precision weights the device computes with live between uses.
    "stationary": on the device, all of them, all the time. "flow": on the host (the copy the
    host Adam writes: the low-precision copy under cast "host", the fp32 master under fp32, the
    bf16 part of the master under compact state), streamed in per unit (a decoder block; the
    embedding and the head, a tied pair as one unit) on a side stream before its forward,
    prefetched ahead, released after it (storage resized to 0), fetched again in reverse order
    for its backward and released when its gradients have left. Under data parallelism each
    fetch all-gathers the unit's buckets from the ranks' shards (a collective: every rank runs
    the same forwards, and calls `model.state_dict()` together, or `optimizer.fetch_weights()`
    together and then `model.state_dict()` on rank 0 alone); between uses a flowing parameter is
    released: the model's state dict holds host copies of its weights, `p.copy_(x)` /
    `load_state_dict` write the host copy, other reads of it raise naming `model.state_dict()`.
    "auto": flow when the weights, the engine's device buffers and `device_activation_bytes` do
    not fit in the free device memory, else stationary (under data parallelism: flow on every
    rank, every unit, when they do not fit on some rank's device); in one process, when it flows,
    per unit: the fewest units flowing that fit, the units whose fetch hides best behind their
    compute first
    (the others stay on the device), prefetched as deep as the link speed and the forward time
    measured in the first step call for (plan/flow.py). "auto" keeps a margin of the
    device free: 5% of it, or the caching allocator's measured slack where larger (the flow and
    compute streams' pools cannot serve each other). `device_dtype` fp32 or bf16
    (docs/weight-flow.md)."""

    device_activation_bytes: int = 0
    """Device bytes the activations of one step take at the configured batch, sequence length and
    checkpointing, counted by `weights` "auto" (and the refusal of "stationary") against the free
    device memory together with the weights and the engine's buffers. 0: not counted (the
    simulated device does not count activations either). `superoffload train` (and its
    `--dry-run`, which prints the device peak with and without flow) sets it from the activation
    estimate (plan/activations.py) at the recipe's batch, sequence length and
    checkpointing, where `weights` is "auto" or "flow" on an accelerator and the recipe does not
    set it; the Trainer (`TrainingArguments(superoffload=True)`, `superoffload launch`) likewise,
    at `per_device_train_batch_size` x the longest `input_ids` among the train dataset's first 64
    samples (logged; an iterable dataset is not counted); plain loops take the number given here."""

    activation_offload: str = AUTO
    """Under gradient checkpointing each decoder block keeps its input for the backward (at long
    sequences the device's largest cost). "on": copy each checkpointed block's input to pinned
    host memory on a side stream as the forward produces it, free its device copy, and bring it
    back one block ahead of its recomputation (superoffload_hf/parallel/activation_offload.py;
    the same numbers, bitwise). "off". "auto": on when, at the first training forward, the
    checkpointed blocks' inputs together exceed a quarter of the free device memory. Never on the
    CPU device, where the host is the device: "on" is a no-op there, said in the log. Needs
    gradient checkpointing (`gradient_checkpointing=True`): "on" without it is refused, "auto"
    stays off. Applied by the Trainer integration; plain loops call
    `apply_activation_offload(model)`."""

    tiled_loss: str = AUTO
    """Compute a causal LM's head and cross-entropy `tiled_loss_chunk_tokens` tokens at a time,
    the gradient produced per chunk, so that the full logits (tokens x vocabulary, 12 bytes per
    logit at their peak) never exist (superoffload_hf/parallel/tiled_loss.py; exact to rounding;
    costs one more head matmul in backward). The model's output then has no `logits`. "on",
    "off", or "auto": on when what it saves (the logits' part of the activation estimate,
    plan/activations.py) exceeds 1/8 of the free device memory at the first training
    forward with labels; never on the CPU device; a model it cannot wrap is left alone. Applied
    by the Trainer integration (parallel/tiling.py); plain loops call
    `superoffload_hf.parallel.tiled_loss.apply_tiled_loss(model)`."""

    tiled_loss_chunk_tokens: int = TILED_LOSS_CHUNK_TOKENS
    """Tokens per chunk of the tiled loss (1024: 0.5 GiB of fp32 logits at a 128K vocabulary)."""

    tiled_mlp: str = AUTO
    """Compute each decoder layer's MLP `tiled_mlp_chunk_tokens` tokens at a time, recomputing
    each chunk in backward, so that the intermediate (tokens x intermediate size) exists one
    chunk at a time (superoffload_hf/parallel/tiled_mlp.py; exact to rounding; costs one more
    MLP forward in backward). "on", "off", or "auto": on when what it saves in one block's
    backward (less its fp32 sums of the MLP weights' gradients) exceeds 1/8 of the free device
    memory at the first training forward with labels; never on the CPU device. Plain loops
    call `superoffload_hf.parallel.tiled_mlp.apply_tiled_mlp(model)`."""

    tiled_mlp_chunk_tokens: int = TILED_MLP_CHUNK_TOKENS
    """Tokens per chunk of the tiled MLP."""

    host_threads: Union[int, str] = AUTO
    """Threads of the host Adam kernel's own pool. "auto": the cores this process may run on
    (sched_getaffinity) but one, left for the training thread, whatever OMP_NUM_THREADS says
    (accelerate launch sets it to 1); at least one; all of them when the device is the CPU (host
    jobs run inline there, while the training thread waits). The summary says what was chosen."""

    host_cores: Optional[tuple] = None
    """The cores the host Adam threads run on (a list of core ids), one thread per core; the
    kernel's pool and the host worker thread are bound to them. None: under data parallelism,
    this rank's share of the cores it may run on (ranks on one host get disjoint shares, on the
    NUMA node nearest the rank's GPU when the topology is known), one core of it left for the
    training thread; in one process, as `host_threads` says. The summary says what was chosen."""

    pin_memory: Union[bool, str] = AUTO
    """Page-lock the host buffers so copies are asynchronous. "auto": when the device is CUDA.
    Forked data-loader workers (`num_workers > 0`, "fork" start method) do not double the host
    arenas: they share them copy-on-write, and a child copies a page only when it writes it;
    touching a tensor object (its refcount) writes the Python object, not its storage (measured:
    a child that sums a 200 MB tensor and touches 100 views of it adds 0 MB private memory;
    one that writes it, 191 MB). Page-locked arenas were not measured (no GPU here)."""

    pin_method: str = AUTO
    """How the page-locked host arenas are pinned on CUDA (torch's caching host allocator either
    way). "alloc": cudaHostAlloc, torch's default. "register": malloc, the pages faulted in by the
    host Adam's thread count, then cudaHostRegister (torch's `pinned_use_cuda_host_register`),
    often several times faster for the tens of GB a large model pins. "auto": where the plan
    pins 1 GB or more, page-lock 64 MiB by each method at construction and keep the one that
    pins faster without losing over 5% of the other's copy bandwidth; else "alloc". Set only while
    the engine allocates its arenas (the allocator setting is global to the process). A setting
    the user made is never changed: where the user's allocator settings (`PYTORCH_CUDA_ALLOC_CONF`,
    `PYTORCH_ALLOC_CONF`, `torch._C._accelerator_setAllocatorSettings`) name
    `pinned_use_cuda_host_register` or `pinned_num_register_threads`, the engine pins as they say
    and writes nothing; otherwise each switch writes the user's other settings again (torch resets
    `max_split_size_mb`, `roundup_power2_divisions` and `garbage_collection_threshold` to their
    defaults at every parse). The log's page-locking line says which method ran, why, and how long
    it took; nothing to choose on the CPU."""

    host_memory_check: bool = True
    """Before allocating the host buffers (and before a re-plan), compare what the plan needs,
    per buffer kind, plus the re-plan's transient with the memory this process may use and refuse
    with the table, the fixes and the figure used when it does not fit: `host_memory_budget` if
    set, else the smallest of the cgroup limit less its usage, MemTotal less every process's
    resident memory, and (under strict overcommit) CommitLimit less Committed_AS; never
    MemAvailable, which on a VM whose memory grows as it is used starts far below what it can
    take (engine/host_limit.py). false: skip the check (the kernel may then end the process)."""

    host_memory_budget: Optional[Union[int, str]] = None
    """The host memory this process may use in all, its resident memory included: bytes, or a
    string such as "100GB" or "96GiB". Set: the host check compares against it less the process's
    resident memory, instead of what it reads from the machine (for a host whose limits it cannot
    read, e.g. a VM that grows its memory on use). The same figure bounds the activation offload's
    pinned pool reserved before training (its refusal names it) and the snapshot trade of
    `speculation: auto`, in the engine and in `superoffload train --dry-run`. null: read the
    machine."""

    host_kernel: str = AUTO
    """Which host Adam implementation to use. "cpp": the JIT-built GraceAdam kernel (error if it
    cannot be built). "reference": the plain PyTorch reference. "auto": the kernel, falling back
    to the reference with a warning when it cannot be built."""

    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step in a plain training loop: the engine steps a bucket once
    it has received its gradients this many times. Under Accelerate and the HF Trainer the
    integration reads the accumulation boundary from Accelerate's gradient state instead."""

    sequence_parallel_size: int = 1
    """Ranks that split each sequence (Ulysses sequence parallelism: superoffload_hf.parallel).
    The world is data parallel x sequence parallel: consecutive groups of this many ranks hold
    one data-parallel replica's batch, each rank 1/N of every sequence; it must divide the
    world size (the number of processes). 1: off."""

    resume_weights_only: bool = False
    """Under the Trainer, with `resume_from_checkpoint`: load only the model weights of the
    checkpoint and train from step 0 with a fresh optimizer and LR schedule (for a checkpoint whose
    optimizer state is missing or corrupt). The same as `TrainingArguments(resume_weights_only=True)`;
    this field is how a stock script under `superoffload launch`, whose argument parser knows no
    such flag, asks for it (with the script's own `--resume_from_checkpoint`). A run from step 0
    may not write into an output_dir that holds checkpoints (its saves would overwrite them and
    `save_total_limit` rotate them away): give the script a new `--output_dir`."""

    timeline_dir: Optional[str] = None
    """Write a step timeline of `timeline_steps` to this directory: trace.json (Chrome trace
    format: open it in Perfetto or chrome://tracing) and timeline.png (needs matplotlib: the
    `timeline` extra). Written when the optimizer closes or the Trainer ends. None: off."""

    timeline_steps: tuple = (2, 3)
    """The optimizer steps (1-based `step()` calls) the timeline records."""

    speculation_window: int = 20
    """Number of recent steps the "auto" speculation policy looks at."""

    speculation_max_rollback_rate: float = 0.25
    """With speculation "auto": stop speculating while more than this fraction of the last
    `speculation_window` steps rolled back; resume when the rate falls below it."""

    loss_scale_init: float = 2.0**16
    """fp16 only: initial dynamic loss scale."""

    loss_scale_growth_factor: float = 2.0
    """fp16 only: factor applied to the loss scale after `loss_scale_growth_interval` good steps."""

    loss_scale_backoff_factor: float = 0.5
    """fp16 only: factor applied to the loss scale after a step with non-finite gradients."""

    loss_scale_growth_interval: int = 2000
    """fp16 only: consecutive finite steps before the loss scale grows."""

    def __post_init__(self) -> None:
        _check_auto_or_positive("bucket_size_mb", self.bucket_size_mb, float)
        _check_auto_or_int("device_buckets", self.device_buckets, minimum=0)
        _check_choice("speculation", self.speculation, SPECULATION_CHOICES)
        _check_choice("rollback", self.rollback, ROLLBACK_CHOICES)
        _check_choice("cast", self.cast, CAST_CHOICES)
        _check_choice("device_dtype", self.device_dtype, DEVICE_DTYPE_CHOICES)
        _check_choice("state_precision", self.state_precision, STATE_PRECISION_CHOICES)
        if self.state_precision != "fp32" and self.device_dtype != "bf16":
            raise ConfigError(
                f"`state_precision` is {self.state_precision!r} but `device_dtype` is {self.device_dtype!r}: "
                "compact state stores the master weight as the bf16 weight the device computes with plus "
                "an error term, so it needs `device_dtype: bf16` (under Accelerate / the Trainer: bf16 "
                "mixed precision). Set `device_dtype: bf16`, or `state_precision: fp32`.")
        _check_choice("weights", self.weights, WEIGHTS_CHOICES)
        if self.weights == "flow" and self.device_buckets not in (AUTO, 0):
            raise ConfigError(
                f"`weights: flow` with `device_buckets: {self.device_buckets}`: a device-resident bucket keeps its "
                "weights and state on the device, which weight-flow frees for activations. Set "
                "`device_buckets: 0` (or \"auto\": none under flow), or `weights: stationary`.")
        if self.weights != "stationary" and self.device_dtype == "fp16":
            raise ConfigError(
                f"`weights` is {self.weights!r} with `device_dtype: fp16`: weight-flow is implemented and "
                "tested for fp32 and bf16 device weights. Use `device_dtype: bf16` (or fp32), or "
                "`weights: stationary`.")
        _check_int("device_activation_bytes", self.device_activation_bytes, minimum=0)
        _check_choice("activation_offload", self.activation_offload, ACTIVATION_OFFLOAD_CHOICES)
        _check_choice("tiled_loss", self.tiled_loss, TILED_CHOICES)
        _check_int("tiled_loss_chunk_tokens", self.tiled_loss_chunk_tokens, minimum=1)
        _check_choice("tiled_mlp", self.tiled_mlp, TILED_CHOICES)
        _check_int("tiled_mlp_chunk_tokens", self.tiled_mlp_chunk_tokens, minimum=1)
        _check_auto_or_int("host_threads", self.host_threads, minimum=1)
        if self.host_cores is not None:
            cores = self.host_cores
            if isinstance(cores, list):
                object.__setattr__(self, "host_cores", tuple(cores))
                cores = self.host_cores
            if (not isinstance(cores, tuple) or not cores or not all(_is_int(c) and c >= 0 for c in cores)
                    or len(set(cores)) != len(cores)):
                raise ConfigError(f"`host_cores` is {cores!r}; expected null or a non-empty list of distinct core "
                                  "ids >= 0, e.g. [0, 1, 2, 3].")
        if not (self.pin_memory == AUTO or isinstance(self.pin_memory, bool)):
            raise ConfigError(
                f"`pin_memory` is {self.pin_memory!r}; expected true, false or \"auto\"."
            )
        _check_choice("pin_method", self.pin_method, PIN_METHOD_CHOICES)
        if not isinstance(self.host_memory_check, bool):
            raise ConfigError(f"`host_memory_check` is {self.host_memory_check!r}; expected true or false.")
        if self.host_memory_budget is not None:
            object.__setattr__(self, "host_memory_budget", _parse_bytes("host_memory_budget", self.host_memory_budget))
        _check_choice("host_kernel", self.host_kernel, HOST_KERNEL_CHOICES)
        _check_int("gradient_accumulation_steps", self.gradient_accumulation_steps, minimum=1)
        _check_int("sequence_parallel_size", self.sequence_parallel_size, minimum=1)
        if not isinstance(self.resume_weights_only, bool):
            raise ConfigError(f"`resume_weights_only` is {self.resume_weights_only!r}; expected true or false.")
        if self.timeline_dir is not None and not isinstance(self.timeline_dir, str):
            raise ConfigError(f"`timeline_dir` is {self.timeline_dir!r}; expected a directory path (a string) or null.")
        steps = self.timeline_steps
        if isinstance(steps, list):
            object.__setattr__(self, "timeline_steps", tuple(steps))
            steps = self.timeline_steps
        if not isinstance(steps, tuple) or not steps or not all(_is_int(s) and s >= 1 for s in steps):
            raise ConfigError(f"`timeline_steps` is {steps!r}; expected a non-empty list of step numbers >= 1, "
                              "e.g. [2, 3].")
        _check_int("speculation_window", self.speculation_window, minimum=1)
        _check_number("speculation_max_rollback_rate", self.speculation_max_rollback_rate, 0.0, 1.0)
        _check_number("loss_scale_init", self.loss_scale_init, 0.0, float("inf"), open_low=True)
        _check_number("loss_scale_growth_factor", self.loss_scale_growth_factor, 1.0, float("inf"), open_low=True)
        _check_number("loss_scale_backoff_factor", self.loss_scale_backoff_factor, 0.0, 1.0, open_low=True, open_high=True)
        _check_int("loss_scale_growth_interval", self.loss_scale_growth_interval, minimum=1)

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "SuperOffloadConfig":
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            import difflib

            close = {k: difflib.get_close_matches(str(k), cls.field_names(), n=1) for k in unknown}
            hint = "".join(f" Did you mean `{match[0]}` for `{k}`?" for k, match in close.items() if match)
            raise ConfigError(
                f"Unknown SuperOffloadConfig key(s) {unknown};{hint} valid keys are "
                f"{sorted(cls.field_names())}. Check the spelling in your superoffload config."
            )
        return cls(**values)

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "SuperOffloadConfig":
        """Load from a .yaml/.yml or .json file holding the fields at its top level."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"SuperOffload config file {str(path)!r} does not exist.")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            from superoffload_hf.yaml12 import load_yaml  # YAML 1.2: `speculation: off` is a string

            data = load_yaml(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(
                f"SuperOffload config file {str(path)!r} has suffix {path.suffix!r}; "
                "expected .yaml, .yml or .json."
            )
        if data is not None and not isinstance(data, Mapping):
            raise ConfigError(
                f"SuperOffload config file {str(path)!r} must hold a mapping of fields, "
                f"got {type(data).__name__}."
            )
        return cls.from_dict(data)

    @classmethod
    def coerce(cls, value: Union["SuperOffloadConfig", Mapping[str, Any], str, Path, None]) -> "SuperOffloadConfig":
        """Accept a config, a dict of fields, a path to a YAML/JSON file, or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        if isinstance(value, (str, Path)):
            return cls.from_file(value)
        raise ConfigError(
            f"Cannot make a SuperOffloadConfig from {type(value).__name__}; pass a "
            "SuperOffloadConfig, a dict of its fields, or a path to a YAML/JSON file."
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "SuperOffloadConfig":
        return dataclasses.replace(self, **changes)


def check_sequence_parallel_size(size: Any, world: int) -> None:
    """`sequence_parallel_size` against the world size, once it is known (at launch)."""
    _check_int("sequence_parallel_size", size, minimum=1)
    if world % size:
        raise ConfigError(
            f"`sequence_parallel_size` is {size} but the world has {world} processes: it must divide the world "
            f"size (world = data parallel x sequence parallel). Launch a multiple of {size} processes, or set "
            f"`sequence_parallel_size` to a divisor of {world}.")


# ---- validation helpers ----------------------------------------------------------------------


BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _parse_bytes(name: str, value) -> int:
    """A positive byte count: an int, or a number with a unit of BYTE_UNITS ("100GB", "96 GiB")."""
    if _is_int(value) and value > 0:
        return int(value)
    if isinstance(value, str):
        text = value.strip().upper()
        unit = next((u for u in sorted(BYTE_UNITS, key=len, reverse=True) if text.endswith(u)), None)
        try:
            number = float(text[:-len(unit)]) if unit else None
        except ValueError:
            number = None
        if number is not None and number > 0:
            return int(number * BYTE_UNITS[unit])
    raise ConfigError(f"`{name}` is {value!r}; expected a positive number of bytes or a size with a unit "
                      f"({', '.join(u.replace('I', 'i') for u in BYTE_UNITS)}), e.g. \"100GB\".")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"`{name}` is {value!r}; valid choices are {list(choices)}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ConfigError(f"`{name}` is {value!r}; expected an integer >= {minimum}.")


def _check_auto_or_int(name: str, value: Any, minimum: int) -> None:
    if value == AUTO:
        return
    if not _is_int(value) or value < minimum:
        raise ConfigError(f"`{name}` is {value!r}; expected \"auto\" or an integer >= {minimum}.")


def _check_auto_or_positive(name: str, value: Any, kind: type) -> None:
    if value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"`{name}` is {value!r}; expected \"auto\" or a number > 0.")


def _check_number(
    name: str, value: Any, low: float, high: float, open_low: bool = False, open_high: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        lo = "(" if open_low else "["
        hi = ")" if open_high else "]"
        raise ConfigError(f"`{name}` is {value!r}; expected a number in {lo}{low}, {high}{hi}.")
