"""Recipes: one YAML file holds everything `superoffload train` needs.

Every recipe in `recipes/` has the same five top-level sections::

    model:        config: {LlamaConfig fields}   # random init ...
                  name_or_path: hub id or path   # ... or pretrained weights (exactly one of the two)
                  dtype, attn_implementation     # optional
    tokenizer:    shipped: true | name_or_path   # optional; default: model.name_or_path
    data:         shipped_corpus: true | name: hub id | files: [a.txt, b.jsonl]   (exactly one)
                  seq_len (required), text_column, split, config, streaming, max_examples
    training:     any transformers TrainingArguments field; output_dir is required
    superoffload: SuperOffloadConfig fields ({} for the defaults), or false for the stock optimizer

A recipe may start with `base: parent.yaml` (relative to the recipe, or a shipped recipe's name) and hold only the keys
it changes: mappings merge key by key, other values replace, and null removes a parent's key.

Command-line overrides (`--training.max_steps 5`, `--data.seq_len=64`) replace single keys
before validation. Relative paths are resolved against the current directory. Every error
names the key, the value, what was expected and how to fix it.
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import enum
import inspect
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import yaml

from superoffload_hf.config import ConfigError, SuperOffloadConfig
from superoffload_hf.train.schema import training_argument_names
from superoffload_hf.yaml12 import load_yaml as parse_yaml

SECTIONS = ("model", "tokenizer", "data", "training", "superoffload")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICE_DTYPE_TO_TORCH = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DATA_FILE_SUFFIXES = (".txt", ".md", ".json", ".jsonl")
# Set by the CLI from the `superoffload:` section; a recipe must not set them in `training:`.
TRAINING_KEYS_OWNED_BY_RECIPE = ("superoffload", "superoffload_config")
# Top-level keys of an accelerate config file (`accelerate config` writes them), never of a recipe.
ACCELERATE_CONFIG_KEYS = ("compute_environment", "distributed_type", "mixed_precision", "num_processes")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class RecipeError(ValueError):
    """A recipe key is missing, unknown, or has a value it cannot take."""


# ---- command-line overrides -------------------------------------------------------------------


def parse_overrides(tokens: Sequence[str]) -> list[tuple[str, Any]]:
    """`["--training.max_steps", "5", "--data.seq_len=64", "--training.bf16"]` ->
    `[("training.max_steps", 5), ("data.seq_len", 64), ("training.bf16", True)]`."""
    overrides, i = [], 0
    while i < len(tokens):
        key, eq, text = _override_key(tokens[i]).partition("=")
        if not eq:
            has_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
            text = tokens[i + 1] if has_value else "true"
            i += int(has_value)
        overrides.append((key, _parse_override_value(key, text)))
        i += 1
    return overrides


def _override_key(token: str) -> str:
    key = token[2:] if token.startswith("--") else ""
    if not key.partition("=")[0] or any(not part for part in key.partition("=")[0].split(".")):
        raise RecipeError(
            f"Unexpected argument {token!r}; overrides look like `--training.max_steps 5` "
            "or `--training.max_steps=5` (a dotted key into the recipe, then its value)."
        )
    return key


def _parse_override_value(key: str, text: str) -> Any:
    try:
        return parse_yaml(text) if text.strip() else text
    except yaml.YAMLError as exc:
        raise RecipeError(f"Override `--{key}` has value {text!r}, which is not valid YAML: {exc}") from exc


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Return a copy of `raw` with each dotted key set to its value (missing levels are created)."""
    result = _deep_copy(raw)
    for dotted, value in overrides:
        node, parts = result, dotted.split(".")
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                prefix = ".".join(parts[: depth + 1])
                raise RecipeError(
                    f"Cannot apply override `--{dotted}`: `{prefix}` is {node!r}, not a mapping. "
                    f"Set the whole section instead, e.g. `--{prefix} '{{{parts[depth + 1]}: ...}}'`."
                )
        node[parts[-1]] = value
    return result


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


# ---- type checks ------------------------------------------------------------------------------


def check_type(key: str, value: Any, annotation: Any) -> Any:
    """Return `value` if it fits `annotation` (a float field also takes an int, kept as is, or
    a numeric string, returned as a float); otherwise raise a RecipeError naming `key`."""
    ok, converted = _fits(value, annotation)
    if not ok:
        named = _enum_of(annotation)
        if named is not None and isinstance(value, str):
            raise RecipeError(bad_choice(key, value, [m.value for m in named], named.__name__))
        raise RecipeError(
            f"`{key}` is {value!r} ({type(value).__name__}); expected {_describe(annotation)}."
        )
    return converted


def bad_choice(key: str, value: str, choices: Sequence[str], names: str = "names") -> str:
    """`key` is `value`, not a choice: all of them where they are few, else how many there are
    and the closest one (or the first two)."""
    if len(choices) <= 6:
        return f"`{key}` is {value!r}; expected one of {', '.join(repr(c) for c in choices)}."
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    such = f"{close[0]!r}" if close else f"{choices[0]!r} or {choices[1]!r}"
    return f"`{key}` is {value!r}; expected one of the {len(choices)} {names} values, such as {such}."


def _enum_of(annotation: Any) -> Optional[type]:
    members = _union_args(annotation) or (annotation,)
    return next((m for m in members if isinstance(m, type) and issubclass(m, enum.Enum)), None)


def _union_args(annotation: Any) -> Optional[tuple]:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return None


def _fits(value: Any, annotation: Any) -> tuple[bool, Any]:
    members = _union_args(annotation)
    if members is not None:
        if _enum_of(annotation) is not None:
            members = tuple(m for m in members if m is not str)  # `Enum | str`: the str is a member's value
        for member in members:
            ok, converted = _fits(value, member)
            if ok:
                return True, converted
        return False, value
    return _fits_one(value, typing.get_origin(annotation) or annotation)


def _fits_one(value: Any, kind: Any) -> tuple[bool, Any]:
    if kind is type(None):
        return value is None, value
    if kind is bool:
        return isinstance(value, bool), value
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if kind is float:
        return _as_float(value)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return isinstance(value, str) and value in {m.value for m in kind}, value
    if kind is str:
        return isinstance(value, str), value
    if kind in (dict, Mapping):
        return isinstance(value, Mapping), value
    if kind in (list, tuple, Sequence):
        return isinstance(value, (list, tuple)), value
    return True, value  # an annotation this checker does not model: the consumer validates it


def _as_float(value: Any) -> tuple[bool, Any]:
    if isinstance(value, bool):
        return False, value
    if isinstance(value, (int, float)):
        return True, value  # an int stays an int: TrainingArguments treats 10 and 10.0 alike
    if isinstance(value, str):
        try:
            return True, float(value)
        except ValueError:
            return False, value
    return False, value


def _describe(annotation: Any) -> str:
    members = _union_args(annotation)
    if members is not None:
        return " or ".join(_describe(m) for m in members)
    kind = typing.get_origin(annotation) or annotation
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a number",
             str: "a string", dict: "a mapping", list: "a list", tuple: "a list"}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "one of " + str([m.value for m in kind])
    return names.get(kind, getattr(kind, "__name__", str(kind)))


def check_keys(section: str, values: Mapping[str, Any], allowed: Sequence[str]) -> None:
    """Raise on keys of `values` not in `allowed`, suggesting close matches."""
    for key in values:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=3)
            hint = (f" Did you mean {close}?" if close else f" Valid keys: {sorted(allowed)}." if len(allowed) <= 12
                    else f" `superoffload train --help` lists the keys of `{section}`; docs/config.md explains them.")
            raise RecipeError(f"Unknown key `{section}.{key}`.{hint}")


def _section_from_mapping(cls: type, section: str, values: Any) -> Any:
    """Build the section dataclass `cls` from a mapping: unknown keys, missing required keys
    and wrong types raise with the dotted key."""
    if not isinstance(values, Mapping):
        raise RecipeError(f"`{section}` is {values!r}; expected a mapping of keys (see recipes/*.yaml).")
    hints = typing.get_type_hints(cls)
    specs = [f for f in dataclasses.fields(cls) if f.init]
    check_keys(section, values, [f.name for f in specs])
    kwargs = {}
    for spec in specs:
        if spec.name in values:
            kwargs[spec.name] = check_type(f"{section}.{spec.name}", values[spec.name], hints[spec.name])
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise RecipeError(f"Missing key `{section}.{spec.name}`: {_field_doc(cls, spec.name)}")
    return cls(**kwargs)


def _field_doc(cls: type, name: str) -> str:
    return getattr(cls, "FIELD_HELP", {}).get(name, "it is required.")


# ---- sections ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """Which model to train: a random init from `config`, or pretrained `name_or_path`."""

    config: Optional[dict] = None
    """LlamaConfig fields (any transformers config with `model_type:`, default "llama")."""
    name_or_path: Optional[str] = None
    """A hub id (e.g. meta-llama/Llama-3.2-1B) or a local directory written by save_pretrained."""
    dtype: str = "auto"
    """Dtype the model is created in. "auto": the dtype the device computes in (superoffload's
    device_dtype, else bfloat16 with training.bf16, float16 with training.fp16, else float32), so
    a large model is never materialized in fp32 first."""
    attn_implementation: Optional[str] = None
    """transformers attention backend ("eager", "sdpa", ...); None: the library's default."""

    def __post_init__(self) -> None:
        if (self.config is None) == (self.name_or_path is None):
            raise RecipeError(
                "`model` needs exactly one of `config` (random init from LlamaConfig fields) or "
                f"`name_or_path` (hub id or local path); got {'both' if self.config is not None else 'neither'}."
                + (" On the command line, drop the other with e.g. `--model.config null`." if self.config is not None else "")
            )
        if self.dtype not in MODEL_DTYPES:
            raise RecipeError(f"`model.dtype` is {self.dtype!r}; valid choices are {list(MODEL_DTYPES)}.")
        if self.name_or_path is not None:
            check_model_location(self.name_or_path)
        if self.config is not None:
            validate_model_config(self.config)


def validate_model_config(values: Mapping[str, Any]) -> None:
    """Keys of `model.config` must be fields of the config class of its `model_type`
    (default "llama"), with the type of the field's default value."""
    from transformers import AutoConfig

    model_type = values.get("model_type", "llama")
    try:
        default = AutoConfig.for_model(model_type)
    except (ValueError, KeyError) as exc:
        raise RecipeError(
            f"`model.config.model_type` is {model_type!r}; expected a transformers model type such as \"llama\"."
        ) from exc
    allowed = set(inspect.signature(type(default).__init__).parameters) | set(vars(default))
    allowed = sorted((allowed | {"model_type", "attn_implementation"}) - {"self", "kwargs"})
    check_keys("model.config", values, [k for k in allowed if not k.startswith("_")])
    for key, value in values.items():
        default_value = getattr(default, key, None)
        if type(default_value) in (bool, int, float):
            check_type(f"model.config.{key}", value, float if type(default_value) is float else type(default_value))
    _check_attention_shape(values, default)


def _check_attention_shape(values: Mapping[str, Any], default: Any) -> None:
    """Head counts that divide what they split (the model would fail in its first forward)."""
    def get(key):
        return values.get(key, getattr(default, key, None))

    hidden, heads, kv_heads = get("hidden_size"), get("num_attention_heads"), get("num_key_value_heads")
    if not all(isinstance(v, int) for v in (hidden, heads)):
        return
    if heads < 1 or hidden < 1:
        raise RecipeError(f"`model.config.hidden_size` is {hidden} and `num_attention_heads` {heads}; expected both >= 1.")
    if values.get("head_dim") is None and hidden % heads:
        raise RecipeError(
            f"`model.config.hidden_size` is {hidden}, not divisible by `num_attention_heads` ({heads}); "
            f"expected a multiple of {heads}, e.g. {hidden // heads * heads or heads} (or set `head_dim`)."
        )
    if isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise RecipeError(
            f"`model.config.num_key_value_heads` is {kv_heads}; expected a divisor of `num_attention_heads` ({heads})."
        )


@dataclass(frozen=True)
class TokenizerSpec:
    """Which tokenizer: the one built from the shipped corpus, or a pretrained one."""

    shipped: bool = False
    """Train a byte-level BPE on the corpus shipped in superoffload_hf/train/corpus (offline, <1 s)."""
    name_or_path: Optional[str] = None
    """A hub id or a local directory; default: the model's name_or_path."""
    vocab_size: int = 2048
    """Vocabulary size of the shipped tokenizer (ignored for a pretrained one)."""

    def __post_init__(self) -> None:
        if self.shipped and self.name_or_path is not None:
            raise RecipeError(
                "`tokenizer` has both `shipped: true` and `name_or_path`; keep one of them."
            )
        if self.vocab_size < 260:
            raise RecipeError(
                f"`tokenizer.vocab_size` is {self.vocab_size}; expected >= 260 (256 bytes + special tokens)."
            )
        if self.name_or_path is not None:
            check_model_location(self.name_or_path, key="tokenizer.name_or_path")


@dataclass(frozen=True)
class DataSpec:
    """What text to train on, and how it is cut into training sequences."""

    FIELD_HELP = {"seq_len": "the length of each packed training sequence, e.g. `seq_len: 128`."}

    seq_len: int
    """Tokens per training sequence: documents are tokenized, joined with EOS and cut into
    blocks of this length (the remainder is dropped)."""
    shipped_corpus: bool = False
    """Train on the small English corpus in superoffload_hf/train/corpus (no network)."""
    name: Optional[str] = None
    """A `datasets` hub id (needs the `datasets` package and network or its cache)."""
    config: Optional[str] = None
    """The hub dataset's configuration name (e.g. wikitext-103-raw-v1)."""
    split: str = "train"
    """The hub dataset's split."""
    streaming: bool = False
    """Stream the hub dataset instead of downloading it whole (use with max_examples)."""
    files: Optional[list] = None
    """Local .txt/.md files (one document per paragraph) or .json/.jsonl files (one per record)."""
    text_column: str = "text"
    """The field holding the text in hub datasets and JSON records."""
    max_examples: Optional[int] = None
    """Read at most this many documents (None: all)."""

    def __post_init__(self) -> None:
        sources = [k for k in ("shipped_corpus", "name", "files") if getattr(self, k)]
        if len(sources) != 1:
            raise RecipeError(
                "`data` needs exactly one source: `shipped_corpus: true`, `name: <hub id>` or "
                f"`files: [...]`; got {sources or 'none'}."
            )
        if self.seq_len < 2:
            raise RecipeError(f"`data.seq_len` is {self.seq_len}; expected an integer >= 2.")
        if self.max_examples is not None and self.max_examples < 1:
            raise RecipeError(f"`data.max_examples` is {self.max_examples}; expected an integer >= 1 or null.")
        for path in self.files or ():
            _check_data_file(path)


def _check_data_file(path: Any) -> None:
    if not isinstance(path, str):
        raise RecipeError(f"`data.files` holds {path!r}; expected file paths (strings).")
    if Path(path).suffix not in DATA_FILE_SUFFIXES:
        raise RecipeError(
            f"`data.files` holds {path!r} with suffix {Path(path).suffix!r}; expected one of "
            f"{list(DATA_FILE_SUFFIXES)}."
        )
    if not Path(path).expanduser().is_file():
        raise RecipeError(
            f"`data.files` holds {path!r}, which does not exist (relative to {os.getcwd()}). "
            "Fix the path, or run from the directory it is relative to."
        )
    _check_utf8(path)


def _check_utf8(path: str, chunk_bytes: int = 1 << 20) -> None:
    """The whole file decodes as UTF-8 (read in chunks: GB/s, and the data is read anyway)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(Path(path).expanduser(), "rb") as handle:
        while True:
            chunk = handle.read(chunk_bytes)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                raise RecipeError(
                    f"`data.files` holds {path!r}, which is not UTF-8 text (byte {offset + exc.start:,}: "
                    f"{exc.reason}); convert it (e.g. `iconv -t utf-8`) or drop it."
                ) from None
            if not chunk:
                return
            offset += len(chunk)


def check_model_location(name_or_path: str, key: str = "model.name_or_path") -> None:
    """An existing directory must hold config.json (or tokenizer files); a string that looks
    like a path must exist; anything else must look like a hub id (`org/name`)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise RecipeError(
                f"`{key}` is {name_or_path!r}, a file; expected a directory written by "
                "save_pretrained (holding config.json) or a hub id like `meta-llama/Llama-3.2-1B`."
            )
        return
    if _looks_like_path(name_or_path):
        raise RecipeError(
            f"`{key}` is {name_or_path!r}, which looks like a local path but does not exist "
            f"(relative to {os.getcwd()}). Fix the path, or give a hub id like `meta-llama/Llama-3.2-1B`."
        )
    if not _HUB_ID.match(name_or_path):
        raise RecipeError(
            f"`{key}` is {name_or_path!r}, which is neither an existing directory nor a hub id "
            "(expected `org/name`, e.g. `meta-llama/Llama-3.2-1B`)."
        )


def _looks_like_path(text: str) -> bool:
    return (
        text.startswith(("/", "./", "../", "~", "."))
        or text.count("/") > 1
        or text.endswith("/")
        or "\\" in text
        or text.endswith((".json", ".safetensors", ".bin"))
    )


# ---- the recipe -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """A validated recipe. `training` holds TrainingArguments keywords; `superoffload` holds
    SuperOffloadConfig fields, or None to train with the stock optimizer."""

    model: ModelSpec
    tokenizer: TokenizerSpec
    data: DataSpec
    training: dict = field(default_factory=dict)
    superoffload: Optional[dict] = None
    source: str = "<dict>"
    warnings: tuple = ()
    """Settings that will run, but probably not as meant (printed by the CLI)."""

    @property
    def model_dtype(self) -> str:
        """torch dtype name the model is created in ("auto" resolved)."""
        if self.model.dtype != "auto":
            return self.model.dtype
        if self.superoffload is None:
            return "float32"  # the stock optimizer: fp32 weights (bf16/fp16 training autocasts)
        if "device_dtype" in self.superoffload:
            return DEVICE_DTYPE_TO_TORCH[self.superoffload["device_dtype"]]
        # As the integration resolves it: bf16 -> bf16 weights, fp16 -> fp16, neither -> fp32.
        return "bfloat16" if self.training.get("bf16") else "float16" if self.training.get("fp16") else "float32"

    @property
    def resume_weights_only(self) -> bool:
        """`training.resume_weights_only`, or the `superoffload:` section's field of that name."""
        return bool(self.training.get("resume_weights_only") or (self.superoffload or {}).get("resume_weights_only"))

    def resume_plan(self) -> Any:
        """What `training.resume_from_checkpoint` loads (superoffload_hf.integrations.resume)."""
        from superoffload_hf.integrations.resume import ResumeError, resolve_resume

        try:
            return resolve_resume(self.training.get("resume_from_checkpoint"), self.training["output_dir"],
                                  weights_only=self.resume_weights_only)
        except ResumeError as exc:
            raise RecipeError(f"`training.resume_from_checkpoint`: {exc}") from exc

    @property
    def tokenizer_name_or_path(self) -> Optional[str]:
        return self.tokenizer.name_or_path or (None if self.tokenizer.shipped else self.model.name_or_path)

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe, as the sections a YAML recipe would hold."""
        return {
            "model": _drop_none(dataclasses.asdict(self.model)),
            "tokenizer": _drop_none(dataclasses.asdict(self.tokenizer)),
            "data": _drop_none(dataclasses.asdict(self.data)),
            "training": dict(self.training),
            "superoffload": False if self.superoffload is None else dict(self.superoffload),
        }


def _drop_none(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def load_recipe(path: Union[str, Path], overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe YAML (and the chain of `base:` recipes it derives from), apply
    command-line override tokens, and validate it."""
    path = Path(path)
    parsed: list[tuple[str, Any]] = []
    try:
        raw = read_recipe_yaml(path)
        parsed = parse_overrides(overrides)
        return recipe_from_dict(apply_overrides(raw, parsed), source=str(path))
    except (RecipeError, ConfigError) as exc:
        raise RecipeError(f"{_blamed(exc, parsed, path)}: {exc}") from exc


def _blamed(error: Exception, overrides: Sequence[tuple[str, Any]], path: Path) -> str:
    """Where the bad key came from: the command-line override the error names, else the recipe file."""
    message = str(error)
    for key, _ in overrides:
        leaf = key.rsplit(".", 1)[-1]
        if f"`{key}`" in message:
            return "on the command line"  # the message names the key
        if key.startswith("superoffload.") and f"'{leaf}'" in message:
            return f"on the command line, `--{key}`"
    return str(path)


def read_recipe_yaml(path: Path, derived_from: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The raw mapping of a recipe file, merged over its `base:` recipe (a path relative to
    the file): mappings merge key by key, other values replace, null removes the base's key."""
    if not path.is_file():
        raise RecipeError(f"Recipe file {str(path)!r} does not exist; pass a YAML recipe file or the name of a shipped "
                          "recipe, e.g. `tiny_llama_cpu` (`superoffload recipes` lists them).")
    if path.resolve() in derived_from:
        raise RecipeError(f"Recipe {str(path)!r} derives from itself through `base:`; break the cycle.")
    try:
        raw = parse_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"Recipe file {str(path)!r} is not valid YAML: {exc}") from exc
    if not isinstance(raw, Mapping):
        raise RecipeError(f"Recipe file {str(path)!r} must hold a mapping with sections {list(SECTIONS)}.")
    accelerate_keys = [key for key in ACCELERATE_CONFIG_KEYS if key in raw]
    if accelerate_keys:
        raise RecipeError(
            f"{str(path)!r} is an accelerate config (it has `{accelerate_keys[0]}`), not a recipe. Start a "
            f"training script with it: `superoffload launch --config_file {path} train.py ...`; "
            "`superoffload train` takes a recipe such as recipes/tiny_llama_cpu.yaml."
        )
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise RecipeError(f"`base` is {base!r} in {str(path)!r}; expected the path of the parent recipe.")
    parent = path.parent / base
    if not parent.is_file():  # `base: tiny_llama_cpu`: a shipped recipe by name
        from superoffload_hf.train.catalog import resolve_recipe

        parent = resolve_recipe(base)
    return merge_recipes(read_recipe_yaml(parent, derived_from + (path.resolve(),)), raw)


def merge_recipes(base: Mapping[str, Any], derived: Mapping[str, Any]) -> dict[str, Any]:
    """`derived` over `base`: nested mappings merge, other values replace, None deletes."""
    merged = _deep_copy(base)
    for key, value in derived.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_recipes(merged[key], value)
        else:
            merged[key] = _deep_copy(value)
    return merged


def recipe_from_dict(raw: Mapping[str, Any], source: str = "<dict>") -> Recipe:
    """Validate the sections of a recipe (already parsed and overridden)."""
    check_keys("<top level>", raw, SECTIONS)
    for section in ("model", "data", "training"):
        if section not in raw:
            raise RecipeError(f"Missing section `{section}:`; every recipe has {list(SECTIONS)} (tokenizer and superoffload optional).")
    check_section_keys(raw)
    recipe = Recipe(
        model=_section_from_mapping(ModelSpec, "model", raw["model"]),
        tokenizer=_section_from_mapping(TokenizerSpec, "tokenizer", raw.get("tokenizer") or {}),
        data=_section_from_mapping(DataSpec, "data", raw["data"]),
        training=validate_training(raw["training"]),
        superoffload=validate_superoffload(raw.get("superoffload", {})),
        source=source,
        warnings=_superoffload_warnings(raw.get("superoffload")),
    )
    _check_cross_section(recipe)
    return recipe


def check_section_keys(raw: Mapping[str, Any]) -> None:
    """Unknown keys of every section, before the checks that import transformers (seconds)."""
    for section, cls in (("model", ModelSpec), ("tokenizer", TokenizerSpec), ("data", DataSpec)):
        if isinstance(raw.get(section), Mapping):
            check_keys(section, raw[section], [f.name for f in dataclasses.fields(cls) if f.init])
    training_names = training_argument_names()
    if training_names is not None and isinstance(raw["training"], Mapping):
        check_keys("training", checkpointing_keys(raw["training"], training_names), list(training_names))
    validate_superoffload(raw.get("superoffload", {}))


def _superoffload_warnings(values: Any) -> tuple:
    threads = values.get("host_threads") if isinstance(values, Mapping) else None
    cores = len(os.sched_getaffinity(0))
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > cores:
        return (f"`superoffload.host_threads` is {threads} but this process may run on {cores} cores; threads "
                "beyond that only compete for them (use `auto`).",)
    return ()


def _check_cross_section(recipe: Recipe) -> None:
    if recipe.model.config is not None and recipe.tokenizer_name_or_path is None and not recipe.tokenizer.shipped:
        raise RecipeError(
            "`model.config` builds a model without a tokenizer; set `tokenizer: {shipped: true}` "
            "or `tokenizer: {name_or_path: <hub id or path>}`."
        )
    recipe.resume_plan()  # an incomplete checkpoint or missing optimizer state fails here, not after loading
    max_positions = (recipe.model.config or {}).get("max_position_embeddings")
    if isinstance(max_positions, int) and recipe.data.seq_len > max_positions:
        raise RecipeError(
            f"`data.seq_len` is {recipe.data.seq_len} but `model.config.max_position_embeddings` "
            f"is {max_positions}; lower seq_len or raise max_position_embeddings."
        )


def validate_superoffload(values: Any) -> Optional[dict]:
    """`false` -> None (stock optimizer); a mapping -> its fields, checked by SuperOffloadConfig."""
    if values is False:
        return None
    if values is None or values is True:
        values = {}
    if not isinstance(values, Mapping):
        raise RecipeError(
            f"`superoffload` is {values!r}; expected a mapping of SuperOffloadConfig fields "
            "({} for the defaults) or false to train with the stock optimizer."
        )
    try:
        SuperOffloadConfig.from_dict(values)
    except ConfigError as exc:
        raise RecipeError(f"In the `superoffload:` section: {exc}") from exc
    return dict(values)


def validate_training(values: Any) -> dict:
    """Check `training:` against transformers.TrainingArguments: known keys, right types,
    output_dir present, values in range. Returns the keywords, floats coerced."""
    from superoffload_hf.integrations.trainer import TrainingArguments  # transformers' + resume_weights_only

    if not isinstance(values, Mapping):
        raise RecipeError(f"`training` is {values!r}; expected a mapping of TrainingArguments fields.")
    for key in TRAINING_KEYS_OWNED_BY_RECIPE:
        if key in values:
            raise RecipeError(
                f"`training.{key}` is set by `superoffload train` from the top-level `superoffload:` "
                "section; move the settings there (or set `superoffload: false`)."
            )
    fields_by_name = {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}
    values = checkpointing_keys(values, fields_by_name)
    check_keys("training", values, list(fields_by_name))
    if not values.get("output_dir"):
        raise RecipeError("Missing key `training.output_dir`: where checkpoints are saved, e.g. `output_dir: out/tiny`.")
    # The annotations, not Field.type: transformers' HfArgumentParser rewrites a dict-or-str field's
    # Field.type to str in place, so after any parse in this process the fields would say str.
    hints = typing.get_type_hints(TrainingArguments)
    checked = {key: _check_training_value(key, value, hints.get(key, fields_by_name[key].type))
               for key, value in values.items()}
    for key, value in checked.items():
        _check_training_range(key, value)
    return checked


# (new name, old name): transformers 5.24 renamed gradient checkpointing and warns on the old name;
# before 5.24 the old name is the only one.
CHECKPOINTING_KEYS = (("activation_checkpointing", "gradient_checkpointing"),
                      ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"))


def checkpointing_keys(values: Mapping[str, Any], fields: Any) -> dict:
    """`values` with its checkpointing keys under the name the installed TrainingArguments reads
    without a deprecation warning: a recipe may use either name on every supported version."""
    renamed = {}
    for new, old in CHECKPOINTING_KEYS:
        if new in values and old in values:
            raise RecipeError(f"`training.{new}` and `training.{old}` are one setting (the second is its old "
                              f"name); keep `training.{new}`.")
        renamed[new if new not in fields else old] = new if new in fields else old
    return {renamed.get(key, key): value for key, value in values.items()}


def checkpointing_on(training: Mapping[str, Any]) -> bool:
    """Whether a validated `training:` section turns gradient (activation) checkpointing on."""
    return bool(training.get("activation_checkpointing") or training.get("gradient_checkpointing"))


# key -> (test, what is expected): values TrainingArguments accepts but training fails on later.
TRAINING_RANGES = {
    "learning_rate": (lambda v: v >= 0, "a number >= 0"),
    "weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "adam_beta1": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "adam_beta2": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "adam_epsilon": (lambda v: v >= 0, "a number >= 0"),
    "max_grad_norm": (lambda v: v >= 0, "a number >= 0 (0: no clipping)"),
    "per_device_train_batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "gradient_accumulation_steps": (lambda v: v >= 1, "an integer >= 1"),
    "max_steps": (lambda v: v == -1 or v >= 1, "an integer >= 1 (or -1: use num_train_epochs)"),
    "num_train_epochs": (lambda v: v > 0, "a number > 0"),
    "warmup_steps": (lambda v: v >= 0, "a number >= 0"),
    "logging_steps": (lambda v: v > 0, "a number > 0"),
    "save_steps": (lambda v: v > 0, "a number > 0"),
}


def _check_training_range(key: str, value: Any) -> None:
    if key not in TRAINING_RANGES or value is None or isinstance(value, bool):
        return
    test, expected = TRAINING_RANGES[key]
    try:
        ok = test(float(value))
    except (TypeError, ValueError):
        return  # not a number: the type check has spoken
    if not ok:
        raise RecipeError(f"`training.{key}` is {value!r}; expected {expected}.")


def _check_training_value(key: str, value: Any, annotation: Any) -> Any:
    if key == "resume_from_checkpoint":
        return _check_resume(value)
    if key == "optim" and isinstance(value, str):  # a plain str field: transformers checks it after loading
        from transformers.training_args import OptimizerNames

        from superoffload_hf.integrations.trainer_hooks import OPTIM_SYNONYM

        choices = [*(m.value for m in OptimizerNames), OPTIM_SYNONYM]
        if value not in choices:
            raise RecipeError(bad_choice(f"training.{key}", value, choices, "OptimizerNames"))
    return check_type(f"training.{key}", value, annotation)


def _check_resume(value: Any) -> Any:
    """true: the last checkpoint in output_dir; a string: that checkpoint directory."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if not Path(value).expanduser().is_dir():
            raise RecipeError(
                f"`training.resume_from_checkpoint` is {value!r}, which is not a directory; give a "
                "checkpoint directory (output_dir/checkpoint-N) or `true` for the last one in output_dir."
            )
        return value
    raise RecipeError(
        f"`training.resume_from_checkpoint` is {value!r}; expected true, false, or a checkpoint directory."
    )
