"""Ctrl-C and SIGTERM in `testbed.run`: both unwind as KeyboardInterrupt, so the backend
removes what it made, and neither can be lost.

A signal's Python handler runs wherever the main thread is. When that is inside a fork's
at-fork callback (pyroute2 forks to enter namespaces; logging registers such callbacks), the
KeyboardInterrupt it raises is printed as "Exception ignored" and dropped: a Ctrl-C in that
instant let a run go on to its end (seen in CI). So the handler also leaves the interrupt
pending, and the runner calls `check()` between its steps.
"""

from __future__ import annotations

import os
import signal

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


def install() -> None:
    signal.signal(signal.SIGTERM, _handle)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored
        signal.signal(signal.SIGINT, _handle)


def check() -> None:
    """Raise the interrupt that arrived where it could not be raised."""
    if _pending:
        raise KeyboardInterrupt
