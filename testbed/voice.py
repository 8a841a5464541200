"""What a run says while it runs: one line on stderr per step, with the time since the run
started, and for a phase how long it took.

    [ 0:02] codebooks K=1024: fitting for vit-b16 (astra, trace-b, trace-nb) ...
    [ 0:27] codebooks K=1024: fitted in 25 s (cached for later runs)

Lines go through `tqdm.write`, so they never break a progress bar. `quiet()` silences them
(`testbed.run --quiet`); errors are not said here, they are raised.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tqdm import tqdm

_state = {"start": time.monotonic(), "on": True}


def restart() -> None:
    """Count the run's clock from now."""
    _state["start"] = time.monotonic()


def quiet(silent: bool = True) -> None:
    _state["on"] = not silent


def speaking() -> bool:
    return bool(_state["on"])


def duration(seconds: float) -> str:
    """'0.4 s', '25 s', '3m05s', '1h02m'."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def say(text: str) -> None:
    if not _state["on"]:
        return
    minutes, seconds = divmod(int(time.monotonic() - _state["start"]), 60)
    tqdm.write(f"[{minutes:2d}:{seconds:02d}] {text}", file=sys.stderr)


@dataclass
class Phase:
    """A phase being run; `outcome` (set by the caller) is said with its duration."""

    name: str
    outcome: str = "done"


@contextmanager
def phase(name: str, doing: str) -> Iterator[Phase]:
    """Say `name: doing ...`, run the block, then `name: <outcome> in <time>`. A block that
    raises says nothing more: its error is reported by whoever catches it."""
    say(f"{name}: {doing} ...")
    started = time.monotonic()
    step = Phase(name)
    yield step
    say(f"{name}: {step.outcome} in {duration(time.monotonic() - started)}")
