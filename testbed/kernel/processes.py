"""Processes on this host: whether one is alive and since when, the boot it belongs to, a
command (an argument list, never a shell) run to its end with its failure raised as an error
that says where it ran and what it was doing, and a command started in a process group of its
own, which `kill_group` ends with everything it started. Standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from testbed.errors import ShapingError, TestbedError

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 30.0


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks since boot), or None when there is no such pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields follow the last ')'
    return int(stat.rsplit(")", 1)[1].split()[19])


def boot_id() -> str:
    """This boot's id (empty where the kernel does not say)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def run_checked(
    argv: Sequence[str],
    where: str,
    doing: str,
    error: type[TestbedError] = ShapingError,
    quiet: bool = False,
) -> str:
    """Runs `argv` and returns its stdout; on failure raises `error` as `WHERE: DOING: `argv`
    failed: STDERR`. `quiet`: a failure is expected (nothing logged beyond the command)."""
    text = " ".join(argv)
    log.debug("%s: %s", where, text)
    try:
        result = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as problem:
        raise error(f"{where}: {doing}: `{text}` failed: {problem}") from None
    if result.returncode != 0:
        if not quiet:
            log.debug("%s: failed: %s", where, result.stderr.strip())
        raise error(f"{where}: {doing}: `{text}` failed: {result.stderr.strip()}")
    return result.stdout


def start_group(argv: Sequence[str], label: str, **popen: Any) -> subprocess.Popen[Any]:
    """`argv` started in a session (and process group) of its own, led by the process
    returned; `popen`: subprocess.Popen's other arguments (pipes, env, text)."""
    log.debug("start %s: %s", label, " ".join(argv))
    return subprocess.Popen(list(argv), start_new_session=True, **popen)


def kill_group(pid: int, label: str, sig: int = signal.SIGKILL) -> None:
    """`sig` (SIGKILL) to the process group led by `pid`, also when its leader has ended."""
    log.debug("kill -%d -%d (%s)", sig, pid, label)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
