"""Ctrl-C during `superoffload train` always stops the run.

Python raises KeyboardInterrupt in whatever code the main thread runs when SIGINT arrives. When
that is a finalizer (a `weakref.finalize` callback such as the Ledger's accounting of a freed
buffer, a `__del__`, which a training step runs many of as tensors are freed), Python prints
"Exception ignored in ..." and carries on: the interrupt is lost and training continues. The
handler here records every Ctrl-C, does not raise inside a finalizer, and the Trainer callback
raises the recorded one at the end of the current (micro-)step instead.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import weakref
from typing import Iterator


class CtrlC:
    def __init__(self) -> None:
        self.pending = False

    def handle(self, signum, frame) -> None:
        self.pending = True
        if not in_finalizer(frame):
            raise KeyboardInterrupt

    def raise_if_pending(self) -> None:
        """A Ctrl-C that arrived inside a finalizer (it could not raise there): raised now."""
        if self.pending:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator["CtrlC"]:
        """The handler for SIGINT while inside; the previous one after. Not installed where SIGINT
        is ignored (a process started in the background or under nohup keeps ignoring it) or off
        the main thread (Python delivers signals to the main thread only)."""
        if (threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
            yield self
            return
        previous = signal.signal(signal.SIGINT, self.handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def in_finalizer(frame) -> bool:
    """Whether `frame` (where the main thread was when the signal arrived) runs inside a finalizer,
    where an exception is printed and ignored: a `__del__` or a weakref.finalize callback."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_name == "__call__" and code.co_filename == weakref.__file__):
            return True
        frame = frame.f_back
    return False
