"""The small English corpus shipped with the package (written for it; public domain, CC0).

Each .txt file beside this one is a short essay; paragraphs are separated by blank lines. The
tiny recipe trains its tokenizer and its model on it, so `superoffload train` needs no network.
"""

from __future__ import annotations

from importlib import resources


def corpus_files() -> list[str]:
    """Names of the corpus files, sorted (the order documents are read in)."""
    root = resources.files(__name__)
    return sorted(entry.name for entry in root.iterdir() if entry.name.endswith(".txt"))


def corpus_texts() -> list[str]:
    """The text of every corpus file, in `corpus_files()` order."""
    root = resources.files(__name__)
    return [root.joinpath(name).read_text(encoding="utf-8") for name in corpus_files()]
