"""The one place where an unmodified script's stock `transformers.Trainer` gets superoffload.

Active only in processes started by `superoffload launch`:

1. The launcher puts the `superoffload:` block of the accelerate config, as JSON, into the
   environment variable `SUPEROFFLOAD_CONFIG_JSON`, and puts the directory of
   `launch_site/sitecustomize.py` first on `PYTHONPATH`.
2. Python runs that sitecustomize at start-up; it calls `install_from_environment()`, which
   reads the variable once and waits for `transformers.trainer` to be imported (an import hook;
   nothing is imported early, so the `accelerate launch` process itself is untouched).
3. Right after `transformers.trainer` has been imported, `patch_trainer_class` wraps
   `Trainer.__init__` (patch.py, the wrapper the public `superoffload_hf.patch_trainer()`
   installs in-process): every Trainer built afterwards (subclasses included) gets the same
   `SuperOffloadHooks` our own `Trainer` uses (optimizer creation, clipping, grad-norm
   reporting) and the `SuperOffloadCallback`. Nothing else in transformers is changed.

In launched processes an uncaught Ctrl-C prints one line, not a traceback, and so does a checkpoint
that cannot be resumed (ResumeError, CorruptStateError: the message names the fix; exit status 1), and the
`superoffload_hf` logger prints INFO records on stderr (what the
engine decided: buckets, device dtype, host Adam and its thread count). Without the variable
none of this happens. Our own `superoffload_hf.Trainer` reads the launch
settings through `launch_plugin()` when its arguments do not turn superoffload on themselves.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
from typing import Any, Callable, Mapping

from superoffload_hf.errors import CorruptStateError
from superoffload_hf.integrations import launch_env
from superoffload_hf.integrations.launch_env import (CONFIG_ENV_VAR, LAUNCH_ERROR_FILE_ENV_VAR,  # noqa: F401
                                                     launch_plugin)
from superoffload_hf.integrations.patch import wrap_trainer_init
from superoffload_hf.integrations.resume import ResumeError

TRAINER_MODULE = "transformers.trainer"


def install_from_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """Arm the Trainer patch when `SUPEROFFLOAD_CONFIG_JSON` is set; True when armed."""
    raw = environ.get(CONFIG_ENV_VAR)
    if raw is None:
        return False
    block = json.loads(raw)
    if not isinstance(block, dict):
        raise ValueError(f"{CONFIG_ENV_VAR} must hold a JSON object of SuperOffloadConfig fields, got {raw!r}.")
    launch_env.set_launch_block(block)
    launch_env.set_launch_command(environ.get(launch_env.LAUNCH_COMMAND_ENV_VAR))
    _show_superoffload_logs()
    _install_interrupt_hook()
    if TRAINER_MODULE in sys.modules:
        _patch_trainer_module(sys.modules[TRAINER_MODULE])
    else:
        sys.meta_path.insert(0, _AfterImport(TRAINER_MODULE, _patch_trainer_module))
    return True


def _show_superoffload_logs() -> None:
    """Print what superoffload decided (bucket plan, device dtype, host Adam and its threads) on
    stderr: an unmodified script does not configure logging, so INFO records would be lost."""
    package_logger = logging.getLogger("superoffload_hf")
    if not package_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[superoffload] %(message)s"))
        package_logger.addHandler(handler)
        package_logger.setLevel(logging.INFO)


def _install_interrupt_hook() -> None:
    """An uncaught Ctrl-C prints one line instead of a traceback; the Trainer, if one was training,
    has already logged where it stopped and what to resume from. Python still exits by SIGINT (130).
    A checkpoint that cannot be resumed prints its one-line message (which names the fix) instead
    of a traceback through the Trainer and the script; the exit status stays 1."""
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if issubclass(kind, KeyboardInterrupt):
            sys.stderr.write("superoffload launch: the training script was interrupted (Ctrl-C)\n")
            return
        if issubclass(kind, (ResumeError, CorruptStateError)):
            line = f"superoffload launch: error: {value}"
            sys.stderr.write(line + "\n")
            record_launch_error(line)
            return
        previous(kind, value, traceback)

    sys.excepthook = excepthook


def record_launch_error(line: str, environ: Mapping[str, str] = os.environ) -> None:
    """Append the one-line error to the launcher's file (several ranks may: one line each)."""
    path = environ.get(LAUNCH_ERROR_FILE_ENV_VAR)
    if path:
        with open(path, "a", encoding="utf-8") as errors:
            errors.write(" ".join(line.split()) + "\n")


def _patch_trainer_module(module: Any) -> None:
    patch_trainer_class(module.Trainer)


def patch_trainer_class(trainer_cls: type) -> None:
    """Wrap `trainer_cls.__init__` so that each new Trainer gets superoffload with the launch
    block (idempotent; patch.py, the same wrapper as the public `patch_trainer()`)."""
    wrap_trainer_init(trainer_cls, launch_plugin)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `callback(module)` once `module_name` has been executed by a normal import."""

    def __init__(self, module_name: str, callback: Callable[[Any], None]):
        self.module_name = module_name
        self.callback = callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module_name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderThen(spec.loader, self._loaded)
        return spec

    def _loaded(self, module: Any) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.callback(module)


class _LoaderThen(importlib.abc.Loader):
    """Runs the original loader, gives the module its original loader back, then the callback."""

    def __init__(self, loader: Any, then: Callable[[Any], None]):
        self.loader = loader
        self.then = then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # tracebacks, inspect, resources
        self.loader.exec_module(module)
        self.then(module)
