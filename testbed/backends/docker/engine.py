"""The Docker engine: tell whether it answers, and start it when it does not.

`python -m testbed.backends.docker.engine up` starts `dockerd` detached (its own session, so it
outlives this process) with the default storage driver, logs to /var/log/trace-testbed-dockerd.log
and waits until `docker info` answers. Standard library only: CI calls it before the venv exists.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from testbed.errors import TestbedError
from testbed.kernel.processes import pid_alive

log = logging.getLogger(__name__)

DOCKERD_LOG = Path("/var/log/trace-testbed-dockerd.log")
DOCKERD_PIDFILE = Path("/var/run/docker.pid")
START_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.5
LOG_TAIL_LINES = 30


def engine_answers(timeout_s: float = 15.0) -> bool:
    """True when `docker info` reaches a daemon."""
    args = ["docker", "info", "--format", "{{.ServerVersion}}"]
    log.debug("check engine: %s", " ".join(args))
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and bool(proc.stdout.strip())


def server_version() -> str | None:
    """The engine's version, or None when none answers."""
    args = ["docker", "version", "--format", "{{.Server.Version}}"]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=15)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _remove_stale_pidfile(pidfile: Path) -> None:
    """dockerd refuses to start while a pid file of a dead daemon is left behind."""
    try:
        pid = int(pidfile.read_text().strip() or "0")
    except (FileNotFoundError, ValueError):
        return
    if pid <= 0 or not pid_alive(pid):
        log.debug("removing stale %s (pid %d)", pidfile, pid)
        pidfile.unlink(missing_ok=True)


def _log_tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as error:
        return f"(cannot read {path}: {error})"
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(empty log)"


def start_engine(log_path: Path = DOCKERD_LOG, timeout_s: float = START_TIMEOUT_S) -> int:
    """Starts dockerd in the background and waits until it answers; returns its pid."""
    if shutil.which("docker") is None or shutil.which("dockerd") is None:
        raise TestbedError("docker/dockerd not installed: apt-get install docker.io")
    if os.geteuid() != 0:
        raise TestbedError("starting dockerd needs root; run `sudo make docker-up`")
    _remove_stale_pidfile(DOCKERD_PIDFILE)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        log.debug("start engine: dockerd (log %s)", log_path)
        daemon = subprocess.Popen(
            ["dockerd"],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # detached: survives this process and its terminal
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine_answers(timeout_s=5.0):
            return daemon.pid
        if daemon.poll() is not None:
            raise TestbedError(
                f"dockerd exited with code {daemon.returncode} while starting; "
                f"tail of {log_path}:\n{_log_tail(log_path)}"
            )
        time.sleep(POLL_INTERVAL_S)
    raise TestbedError(
        f"dockerd (pid {daemon.pid}) did not answer within {timeout_s:.0f} s; "
        f"tail of {log_path}:\n{_log_tail(log_path)}"
    )


def ensure_engine() -> str:
    """Starts the engine unless it already answers; returns what was done."""
    if engine_answers():
        return "Docker engine already answering"
    started = time.monotonic()
    pid = start_engine()
    return f"started dockerd (pid {pid}) in {time.monotonic() - started:.1f} s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.backends.docker.engine", description=__doc__
    )
    parser.add_argument("command", choices=["up", "status"])
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    if args.command == "status":
        answering = engine_answers()
        print("Docker engine answering" if answering else "Docker engine not answering")
        return 0 if answering else 1
    try:
        print(ensure_engine())
    except TestbedError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
