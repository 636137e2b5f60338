"""What `superoffload launch` handed this process: the `superoffload:` block of its accelerate
config and the launch command itself, read from the environment once by
`autopatch.install_from_environment()`."""

from __future__ import annotations

from typing import Any, Optional

CONFIG_ENV_VAR = "SUPEROFFLOAD_CONFIG_JSON"
LAUNCH_COMMAND_ENV_VAR = "SUPEROFFLOAD_LAUNCH_COMMAND"  # shell-quoted, for the resume hint after Ctrl-C
# A file the launched ranks append their one-line error to: the launcher repeats it after torchrun's
# failure report, so that a multi-process launch's output ends with it too.
LAUNCH_ERROR_FILE_ENV_VAR = "SUPEROFFLOAD_LAUNCH_ERROR_FILE"

_launch_block: Optional[dict[str, Any]] = None
_launch_command: Optional[str] = None


def set_launch_block(block: Optional[dict[str, Any]]) -> None:
    global _launch_block
    _launch_block = block


def set_launch_command(command: Optional[str]) -> None:
    global _launch_command
    _launch_command = command


def launch_command() -> Optional[str]:
    """The `superoffload launch ...` command line that started this process, or None."""
    return _launch_command


def launch_plugin():
    """The `superoffload:` block this process was launched with (a SuperOffloadPlugin), or None."""
    if _launch_block is None:
        return None
    from superoffload_hf.integrations.accelerate import SuperOffloadPlugin

    return SuperOffloadPlugin.from_dict(_launch_block)
