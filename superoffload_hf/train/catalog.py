"""The recipes that ship with the package, found by name: `superoffload train tiny_llama_cpu`.

They live at the repository root in recipes/; a wheel build (setup.py) copies them to
superoffload_hf/_recipes/, where an installed package finds them (an editable install and a
checkout read recipes/ itself). The accelerate configs of recipes/accelerate/ travel with them,
and so do the config.json files of recipes/models/ (the architectures of the large recipes'
models, so that `--dry-run` sizes them offline: `shipped_model_dir`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def recipes_dir() -> Optional[Path]:
    """Where the shipped recipes are: the installed copy, else the checkout's recipes/."""
    for candidate in (PACKAGE_DIR / "_recipes", PACKAGE_DIR.parent / "recipes"):
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    return None


def shipped_recipes() -> dict[str, Path]:
    """name -> file of every shipped recipe (accelerate configs excluded)."""
    directory = recipes_dir()
    return {} if directory is None else {p.stem: p for p in sorted(directory.glob("*.yaml"))}


def resolve_recipe(name_or_path: str) -> Path:
    """An existing file as given; otherwise a shipped recipe of that name (`tiny_llama_cpu`, with or
    without `.yaml`, or `recipes/tiny_llama_cpu.yaml` run outside the checkout); otherwise the path
    as given, for the recipe loader to report as missing."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_recipes()
    name = path.name[:-len(".yaml")] if path.name.endswith(".yaml") else path.name
    if name in shipped and (path.parent == Path(".") or path.parent.name == "recipes"):
        return shipped[name]
    return path


def shipped_model_dir(name_or_path: str) -> Optional[Path]:
    """The shipped recipes/models/ directory whose config.json names `name_or_path` as its
    `_name_or_path` (a hub id), or is that directory's name; None if none does."""
    directory = recipes_dir()
    if directory is None:
        return None
    import json

    for config in sorted((directory / "models").glob("*/config.json")):
        names = {config.parent.name, json.loads(config.read_text()).get("_name_or_path")}
        if name_or_path in names:
            return config.parent
    return None


def describe(path: Path) -> str:
    """The first sentence of a recipe file's opening comment (what it trains), whole even where
    it runs over several comment lines; an indented comment line (a command) ends it."""
    words = []
    for line in path.read_text().splitlines():
        text = line[1:] if line.startswith("#") else None
        if text is None or not text.strip() or text.startswith("   "):
            break
        words.append(text.strip())
    paragraph = " ".join(words)
    end = re.search(r"\.(\s|$)|:$", paragraph)  # a colon ends it where a command follows
    return paragraph[:end.start()] + "." if end else paragraph


def recipes_listing() -> str:
    """What `superoffload recipes` prints: each shipped recipe's name, file and first comment line."""
    shipped = shipped_recipes()
    if not shipped:
        return "superoffload recipes: none found (the package was installed without its recipes/)"
    width = max(len(name) for name in shipped)
    lines = [f"shipped recipes (in {recipes_dir()}); run one with `superoffload train NAME`:"]
    lines += [f"  {name:<{width}}  {describe(path)}" for name, path in shipped.items()]
    return "\n".join(lines)
