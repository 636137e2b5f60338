"""The keys a recipe's `training:` takes, read without importing transformers.

Importing transformers (and torch with it) takes 3-10 s; reading the field names of
TrainingArguments from the sources takes a few milliseconds, so a misspelled key is reported
before anything heavy loads. The full check (types, ranges) still runs on the imported class.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path
from typing import Optional

OUR_TRAINING_ARGUMENTS = Path(__file__).resolve().parents[1] / "integrations" / "trainer.py"


@lru_cache(maxsize=None)
def training_argument_names() -> Optional[frozenset]:
    """The init fields of superoffload_hf's TrainingArguments (transformers' plus ours), or None
    when the sources cannot be read this way (then only the check after the import runs)."""
    spec = importlib.util.find_spec("transformers")  # a top-level find_spec does not import it
    if spec is None or not spec.submodule_search_locations:
        return None
    hf_source = Path(list(spec.submodule_search_locations)[0]) / "training_args.py"
    try:
        hf_fields = dataclass_init_fields(hf_source, "TrainingArguments", bases=())
        our_fields = dataclass_init_fields(OUR_TRAINING_ARGUMENTS, "TrainingArguments", bases=("HFTrainingArguments",))
    except (OSError, SyntaxError, LookupError):
        return None
    return frozenset(hf_fields | our_fields)


def dataclass_init_fields(source: Path, class_name: str, bases: tuple) -> set:
    """Names of the annotated class-level fields of `class_name` in `source`, less `init=False`
    ones. Raises LookupError unless the class derives from exactly `bases` (fields a base class
    of another file declares would be missed)."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            if tuple(ast.unparse(base) for base in node.bases) != bases:
                raise LookupError(f"{class_name} in {source} derives from {[ast.unparse(b) for b in node.bases]}")
            return {statement.target.id for statement in node.body
                    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and "ClassVar" not in ast.unparse(statement.annotation) and _in_init(statement.value)}
    raise LookupError(f"no class {class_name} in {source}")


def _in_init(value: Optional[ast.expr]) -> bool:
    return not (isinstance(value, ast.Call) and any(
        keyword.arg == "init" and isinstance(keyword.value, ast.Constant) and keyword.value.value is False
        for keyword in value.keywords))
