"""The `accelerate launch` process that `superoffload launch` starts: Accelerate's own launcher,
except that it outlives a Ctrl-C and reports the training script's failure as an exit status.

Ctrl-C in a terminal interrupts every process of the foreground group at once: this one and the
training script it started. Left alone, this one would die first with a traceback from inside
its wait, and the script's own last lines (where it stopped, what to resume from) would come after
the shell prompt. So it ignores the interrupt and waits; when the script exits non-zero,
Accelerate raises CalledProcessError (a second traceback): the script has said why, so this exits
with the script's status instead (128 + N for a script killed by signal N: 130 for SIGINT).

    python -m superoffload_hf.integrations.launch_child [accelerate launch arguments ...]
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Optional, Sequence


def exit_status(returncode: int) -> int:
    """A subprocess return code as a shell reports it (a negative code: killed by that signal)."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: Optional[Sequence[str]] = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser

    args = launch_command_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    # A Python handler, not SIG_IGN: an ignored SIGINT would be inherited by the training script,
    # which then could not be interrupted; a handler is reset to the default in the child.
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as error:
        return exit_status(error.returncode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
