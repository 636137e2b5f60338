"""Hub names in a recipe, checked before anything loads: a name that is neither a local directory nor
in the local hub cache needs the network, and without it (HF_HUB_OFFLINE=1, or the hub cannot be
reached) `from_pretrained` would retry for half a minute and end in a long traceback. Instead: one
line naming what is missing, `hf download` on a connected machine, or a local directory."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from superoffload_hf.train.recipe import Recipe, RecipeError

NETWORK_PROBE_SECONDS = 3.0
# The file from_pretrained reads first, per kind of name.
FIRST_FILE = {"model.name_or_path": "config.json", "tokenizer.name_or_path": "tokenizer_config.json"}


def check_hub_names_reachable(recipe: Recipe) -> None:
    """Raise a RecipeError for a hub name of `recipe` that is not cached while the hub is out of reach."""
    names = {"model.name_or_path": recipe.model.name_or_path}
    if not recipe.tokenizer.shipped:
        names["tokenizer.name_or_path"] = recipe.tokenizer_name_or_path
    for key, name in names.items():
        if name is not None and not Path(name).expanduser().is_dir():
            check_cached_or_reachable(name, key)


def check_cached_or_reachable(name: str, key: str = "model.name_or_path") -> None:
    from huggingface_hub import constants, try_to_load_from_cache

    cache = constants.HF_HUB_CACHE
    if isinstance(try_to_load_from_cache(name, FIRST_FILE[key], cache_dir=cache), str):
        return
    why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else hub_unreachable(constants.ENDPOINT)
    if why is None:
        return  # from_pretrained downloads it
    raise RecipeError(
        f"`{key}` is {name!r}, which is not in the local hub cache ({cache}) and {why}. On a machine with "
        f"network run `hf download {name}` (and copy the cache here, or add `--local-dir DIR` and set "
        f"`--{key} DIR`), or set `--{key}` to a local directory written by save_pretrained.")


def hub_unreachable(endpoint: str) -> Optional[str]:
    """Why `endpoint` cannot be reached within a few seconds, or None when it can."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=NETWORK_PROBE_SECONDS).close()
    except OSError as error:
        return f"the hub ({endpoint}) cannot be reached: {error.strerror or error}"
    return None
