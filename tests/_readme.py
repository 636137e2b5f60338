"""The README's code blocks and the commands they show, for the tests that run them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def shown_commands(program: str) -> list[list[str]]:
    """Every `program ...` command of the README's bash blocks (continuation lines joined,
    comments dropped), as argument lists after the program name."""
    commands = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == [program]:
                commands.append(words[1:])
    return commands


def from_anywhere(argv: list[str]) -> list[str]:
    """The command's repository files as absolute paths, so it can run from a scratch directory."""
    return [str(REPO / a) if (REPO / a).is_file() else a for a in argv]
