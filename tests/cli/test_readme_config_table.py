"""docs/config.md's SuperOffloadConfig table is generated from the field docstrings in config.py (the
one home of every default): this test regenerates it and fails when the page drifts.

    python tests/cli/test_readme_config_table.py --write    # rewrite the table in docs/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG_PAGE = REPO / "docs" / "config.md"
sys.path.insert(0, str(REPO))

from superoffload_hf.config import SuperOffloadConfig  # noqa: E402

HEADER = "| field | default | meaning |\n| --- | --- | --- |\n"
EXTRA = {"device_dtype": " Under the Trainer, when left out, it follows `bf16` / `fp16` (neither: fp32)."}


def field_docs() -> dict[str, str]:
    tree = ast.parse((REPO / "superoffload_hf" / "config.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SuperOffloadConfig")
    docs, body = {}, cls.body
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def table() -> str:
    docs = field_docs()
    rows = []
    for f in dataclasses.fields(SuperOffloadConfig):
        default = f.default
        shown = f'`"{default}"`' if isinstance(default, str) else f"`{list(default) if isinstance(default, tuple) else default}`"
        if default is None:
            shown = "`null`"
        rows.append(f"| `{f.name}` | {shown} | {docs[f.name]}{EXTRA.get(f.name, '')} |")
    return HEADER + "\n".join(rows) + "\n"


def readme_table(text: str) -> str:
    start = text.index(HEADER, text.index("## SuperOffloadConfig"))
    end = text.find("\n\n", start)
    return text[start:] if end < 0 else text[start:end + 1]  # the table may end the page


def test_every_config_field_is_documented_in_docs_config_as_in_config_py():
    text = CONFIG_PAGE.read_text()
    assert readme_table(text) == table(), "docs/config.md's config table drifted: run python tests/cli/test_readme_config_table.py --write"


if __name__ == "__main__" and "--write" in sys.argv:
    path = CONFIG_PAGE
    text = path.read_text()
    path.write_text(text.replace(readme_table(text), table()))
