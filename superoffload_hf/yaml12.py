"""YAML with YAML 1.2 scalars, for every config file a person writes (recipes, superoffload configs).

PyYAML implements YAML 1.1, where `off`, `on`, `yes` and `no` are booleans (so `speculation: off`
arrives as False) and `1e-3` is a string (no dot). This loader is yaml.SafeLoader with only those
two resolvers replaced: booleans are true/false, and floats include exponents without a dot.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

_BOOL = "tag:yaml.org,2002:bool"
_FLOAT = "tag:yaml.org,2002:float"


class Yaml12Loader(yaml.SafeLoader):
    """yaml.SafeLoader with YAML 1.2 booleans and floats."""


# A fresh resolver table (the SafeLoader's own lists must not change), minus the 1.1 rules.
Yaml12Loader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] not in (_BOOL, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
Yaml12Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse YAML text with YAML 1.2 booleans and floats; same safety as yaml.safe_load."""
    return yaml.load(text, Loader=Yaml12Loader)
