"""`patch_trainer()`: superoffload for `transformers.Trainer` and every subclass of it (TRL's
SFTTrainer and DPOTrainer, ...) built afterwards in this process, without the launcher.

    import superoffload_hf
    superoffload_hf.patch_trainer(speculation="auto")     # SuperOffloadConfig fields, or config=...
    trainer = DPOTrainer(model=model, ref_model=ref, args=DPOConfig(...), ...)
    trainer.train()                                       # SuperOffloadAdamW, host Adam state

It wraps `trainer_cls.__init__` (once, however often it is called): at the end of each Trainer's
construction it binds the `SuperOffloadHooks` our own `Trainer` uses (optimizer creation,
clipping, grad-norm reporting, sharded optimizer state, resume checks) and the
`SuperOffloadCallback`. Nothing else in transformers changes. `superoffload launch` installs the
same wrapper on `transformers.Trainer` with its config block (autopatch.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

PATCH_MARK = "_superoffload_patch"  # the wrapper's attribute: a _Patch


class _Patch:
    """What a patched `__init__` knows: the settings it binds, and what to restore on unpatch."""

    def __init__(self, settings: Callable[[], Any], own_init: Optional[Callable]):
        self.settings = settings  # called at each construction: a re-patch changes later Trainers
        self.own_init = own_init  # the class's own __init__, None when it inherited one


def patch_trainer(trainer_cls: Optional[type] = None, *, config: Any = None, **fields: Any):
    """Train every `trainer_cls` (default `transformers.Trainer`, so every subclass: TRL's
    SFTTrainer, DPOTrainer, ...) built from now on in this process with superoffload.

    `config`: SuperOffloadConfig fields as a dict, a YAML/JSON path, a `SuperOffloadConfig` or a
    `SuperOffloadPlugin`; `fields`: SuperOffloadConfig fields as keywords (they win over `config`).
    A misspelled field fails here, with the valid names. Calling it again only replaces the
    settings (idempotent); `unpatch_trainer()` undoes it. Trainers already built keep what they
    have. The device dtype follows the TrainingArguments' `bf16` / `fp16` unless `device_dtype`
    is set. Our own `superoffload_hf.Trainer` follows its own arguments and is left alone.
    Returns the settings, a `SuperOffloadPlugin`.
    """
    from superoffload_hf.integrations.accelerate import SuperOffloadPlugin
    from superoffload_hf.integrations.trainer_hooks import check_hook_points

    trainer_cls = _trainer_class(trainer_cls)
    check_hook_points(trainer_cls)  # a transformers without the methods superoffload replaces: fail now
    plugin = SuperOffloadPlugin.from_value(config)
    if fields:
        plugin = SuperOffloadPlugin.from_dict({**plugin.explicit_fields(), **fields})
    wrap_trainer_init(trainer_cls, lambda: plugin)
    return plugin


def unpatch_trainer(trainer_cls: Optional[type] = None) -> bool:
    """Undo `patch_trainer(trainer_cls)`: Trainers built afterwards are stock again (the ones
    built before keep superoffload). True when there was a patch to undo."""
    trainer_cls = _trainer_class(trainer_cls)
    init = vars(trainer_cls).get("__init__")
    patch = getattr(init, PATCH_MARK, None)
    if patch is None:
        return False
    if patch.own_init is None:
        delattr(trainer_cls, "__init__")
    else:
        trainer_cls.__init__ = patch.own_init
    return True


def wrap_trainer_init(trainer_cls: type, settings: Callable[[], Any]) -> None:
    """Wrap `trainer_cls.__init__` so that each Trainer built afterwards gets superoffload with
    `settings()` (a SuperOffloadPlugin). Patching a patched class replaces only the settings."""
    own_init = vars(trainer_cls).get("__init__")  # not getattr: a patched base's wrapper is no patch of this class
    if own_init is not None and hasattr(own_init, PATCH_MARK):
        getattr(own_init, PATCH_MARK).settings = settings
        return
    patch = _Patch(settings, own_init)

    @functools.wraps(own_init or trainer_cls.__init__)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if patch.own_init is not None:
            patch.own_init(self, *args, **kwargs)
        else:  # the inherited one, looked up now: a base unpatched later is stock here too
            super(trainer_cls, self).__init__(*args, **kwargs)
        _bind(self, patch.settings())

    setattr(__init__, PATCH_MARK, patch)
    trainer_cls.__init__ = __init__


def _bind(trainer: Any, plugin: Any) -> None:
    from superoffload_hf.integrations.trainer_hooks import SuperOffloadHooks

    if getattr(trainer, "_superoffload_attaches_itself", False):  # ours: its own arguments first
        return
    hooks = getattr(trainer, "superoffload", None)
    if isinstance(hooks, SuperOffloadHooks):
        # A patched base class bound them inside this subclass's __init__: the settings given
        # for the most derived class win (the optimizer is built later, by train()).
        hooks.plugin = plugin
        return
    SuperOffloadHooks(trainer, plugin).bind_to_trainer()


def _trainer_class(trainer_cls: Optional[type]) -> type:
    import transformers

    if trainer_cls is None:
        return transformers.Trainer
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(
            f"patch_trainer() takes a subclass of transformers.Trainer, got {trainer_cls!r}. Pass the class "
            "(e.g. trl.DPOTrainer, not an instance), or nothing to patch transformers.Trainer and all its subclasses."
        )
    return trainer_cls
