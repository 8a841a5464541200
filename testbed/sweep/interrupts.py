"""Ctrl-C and SIGTERM in `testbed.run`: both unwind as KeyboardInterrupt, so the backend
removes what it made, and neither can be lost.

A signal's Python handler runs wherever the main thread is. When that is inside a fork's
at-fork callback (pyroute2 forks to enter namespaces; logging registers such callbacks), the
KeyboardInterrupt it raises is printed as "Exception ignored" and dropped: a Ctrl-C in that
instant let a run go on to its end (seen in CI). So the handler also leaves the interrupt
pending, and the runner calls `check()` between its steps; and the interpreter's report of
the dropped interrupt (a traceback from logging's `_releaseLock`, once in two fresh-clone
test runs) is logged at debug level instead of printed: the interrupt is not lost.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

log = logging.getLogger(__name__)

_MAIN_PID = os.getpid()
_pending: list[int] = []


def _handle(signum: int, frame: object) -> None:
    """Only in this process: a child forked by a library inherits the handler and must simply
    die, not run our clean-up on its copy of the stack."""
    if os.getpid() != _MAIN_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _pending.append(signum)
    raise KeyboardInterrupt


def _unraisable(unraisable: Any) -> None:
    """A KeyboardInterrupt the interpreter had to drop is pending here: logged, not printed;
    anything else as the interpreter reports it."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _pending:
        log.debug("interrupt kept pending, raised in %r", unraisable.object)
        return
    sys.__unraisablehook__(unraisable)


def install() -> None:
    sys.unraisablehook = _unraisable
    signal.signal(signal.SIGTERM, _handle)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored
        signal.signal(signal.SIGINT, _handle)


def check() -> None:
    """Raise the interrupt that arrived where it could not be raised."""
    if _pending:
        raise KeyboardInterrupt
