"""A run's lock: which process orchestrates the run, so that cleanup can tell a live run from
the leftovers of a dead one.

The lock knows the run id, the orchestrator's pid, that process's start time (field 22 of
/proc/<pid>/stat, in clock ticks since boot, so a reused pid is told apart), the boot it
belongs to, the host name and the run directory. It is written twice: `run.lock` in the run
directory (for whoever looks at the results), and `<run-id>.lock` in the state directory,
where `testbed.clean` finds every run's lock from the run id alone (Docker labels carry the
run id, namespace names its tag `run_tag(run_id)`). The state directory is
`$TESTBED_STATE_DIR`, else /run/trace-testbed as root (gone at reboot, like the namespaces),
else `<tmp>/trace-testbed-<uid>`.

A lock is released when its run ends, Ctrl-C and SIGTERM included (testbed.run turns SIGTERM
into KeyboardInterrupt); a SIGKILLed run leaves a lock whose process is gone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from testbed.atomic import write_atomically
from testbed.errors import ConfigError, TestbedError
from testbed.experiment.names import SLUG_RULE, is_slug
from testbed.kernel.processes import boot_id, process_start_ticks

log = logging.getLogger(__name__)

STATE_DIR_ENV = "TESTBED_STATE_DIR"
RUN_DIR_LOCK = "run.lock"
LOCK_SUFFIX = ".lock"


def state_dir() -> Path:
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV])
    if os.geteuid() == 0:
        return Path("/run/trace-testbed")
    return Path(tempfile.gettempdir()) / f"trace-testbed-{os.getuid()}"


@dataclass(frozen=True)
class Holder:
    """Who holds a run's lock."""

    run_id: str
    pid: int
    start_ticks: int
    boot_id: str
    host: str
    run_dir: str

    @classmethod
    def this_process(cls, run_id: str, run_dir: Path) -> Holder:
        pid = os.getpid()
        ticks = process_start_ticks(pid)
        assert ticks is not None
        return cls(run_id, pid, ticks, boot_id(), socket.gethostname(), str(run_dir))

    def alive(self) -> bool | None:
        """True while the orchestrator runs, False once it is gone (its pid dead or reused, or
        the host rebooted), None when it ran on another host (it cannot be checked here)."""
        if self.host != socket.gethostname():
            return None
        if self.boot_id != boot_id():
            return False
        return process_start_ticks(self.pid) == self.start_ticks

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def read_holder(path: Path) -> Holder | None:
    """The lock at `path`, or None when there is none or it cannot be read as one."""
    try:
        return Holder(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def lock_path(run_id: str, directory: Path | None = None) -> Path:
    return (directory or state_dir()) / f"{run_id}{LOCK_SUFFIX}"


def read_locks(directory: Path | None = None) -> dict[str, Holder]:
    """Every run's lock in the state directory, by run id."""
    directory = directory or state_dir()
    holders = {}
    for path in sorted(directory.glob(f"*{LOCK_SUFFIX}")) if directory.is_dir() else []:
        holder = read_holder(path)
        if holder is not None:
            holders[holder.run_id] = holder
    return holders


def remove_lock(holder: Holder, directory: Path | None = None) -> None:
    """Removes a run's lock files (those naming this holder)."""
    for path in (lock_path(holder.run_id, directory), Path(holder.run_dir) / RUN_DIR_LOCK):
        if read_holder(path) == holder:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


class RunLock:
    """Held by the orchestrator for the whole run: `with RunLock(run_id, run_dir): ...`.

    Raises TestbedError when another live process holds the run (a second `--resume`).
    """

    def __init__(self, run_id: str, run_dir: Path, directory: Path | None = None):
        if not is_slug(run_id):
            raise ConfigError(f"run id {run_id!r}: a run id is {SLUG_RULE}")
        self.run_dir = Path(run_dir)
        self.directory = directory or state_dir()
        self.holder = Holder.this_process(run_id, self.run_dir)

    def __enter__(self) -> RunLock:
        path = lock_path(self.holder.run_id, self.directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(asdict(self.holder), indent=2) + "\n"
        while not _create_exclusively(path, text):
            earlier = read_holder(path)
            if earlier is not None and earlier.alive() is not False:
                raise TestbedError(
                    f"run {earlier.run_id} is held by {earlier.describe()} (lock {path}); "
                    "stop that process first"
                )
            log.info("run %s: taking over the lock of a process that is gone", earlier)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(self.run_dir / RUN_DIR_LOCK, lambda temporary: temporary.write_text(text))
        log.debug("run %s locked by pid %d (%s)", self.holder.run_id, self.holder.pid, path)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        remove_lock(self.holder, self.directory)
        log.debug("run %s unlocked", self.holder.run_id)


def _create_exclusively(path: Path, text: str) -> bool:
    """Writes `path` unless it exists (atomically: one of two racing runs wins)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    finally:
        temporary.unlink()
    return True
