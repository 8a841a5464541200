"""A device's control groups (cgroup v1): its cores, its CPU quota, its memory, and a freezer.

One group per device and controller, `/sys/fs/cgroup/<controller>/testbed/<name>`: `cpuset`
(whole cores: `cpuset.cpus`, with the parent's memory nodes), `cpu` (a quota of
`cpu.cfs_quota_us` per `cpu.cfs_period_us`: fractional CPUs), `memory`
(`memory.limit_in_bytes`, swap included where the kernel accounts it; the kernel's OOM
killer ends a process that goes over, and `memory.oom_control` counts it) and `freezer`
(`freezer.state` FROZEN / THAWED: a pause). A process joins all of them when it starts
(`DeviceGroups.join`, called in the child between fork and exec) so that nothing it
allocates is charged elsewhere. Removing a group needs it empty: `remove` kills what is left.

The kernel's rules this module follows: a quota is at least 1 ms (`MIN_QUOTA_US`), a period
1 ms to 1 s; a cpuset child needs `cpuset.cpus` and `cpuset.mems` before a task may join;
groups are directories, created with mkdir and removed with rmdir.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from testbed.errors import DeviceError

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
PARENT = "testbed"
CONTROLLERS = ("cpuset", "cpu", "memory", "freezer")
MIN_QUOTA_US, MIN_PERIOD_US, MAX_PERIOD_US = 1000, 1000, 1_000_000
DEFAULT_PERIOD_US = 100_000  # the kernel's, and Docker's
FREEZE_WAIT_S = 2.0


def available() -> str | None:
    """Why this host cannot give devices control groups, or None."""
    missing = [c for c in CONTROLLERS if not (ROOT / c / "cgroup.procs").is_file()]
    if missing:
        return f"no cgroup v1 hierarchy for {', '.join(missing)} under {ROOT}"
    if os.geteuid() != 0:
        return "control groups need root"
    return None


def _write(path: Path, value: str) -> None:
    log.debug("echo %s > %s", value, path)
    try:
        path.write_text(value)
    except OSError as error:
        raise DeviceError(f"cgroup: cannot write {value!r} to {path}: {error}") from None


def group_names() -> list[str]:
    """The device groups that exist now (in any controller), e.g. for `testbed.clean`."""
    names: set[str] = set()
    for controller in CONTROLLERS:
        parent = ROOT / controller / PARENT
        if parent.is_dir():
            names.update(p.name for p in parent.iterdir() if p.is_dir())
    return sorted(names)


class DeviceGroups:
    """The groups of one device, named `name` (unique per run and rank)."""

    def __init__(self, name: str):
        self.name = name
        self.paths = {c: ROOT / c / PARENT / name for c in CONTROLLERS}

    def create(
        self,
        cpuset: str | None = None,
        quota_cpus: float | None = None,
        memory_mb: int | None = None,
        period_us: int = DEFAULT_PERIOD_US,
    ) -> DeviceGroups:
        """Makes the groups with their limits (None: that limit is not set)."""
        for controller, path in self.paths.items():
            parent = path.parent
            if not parent.is_dir():
                parent.mkdir(exist_ok=True)
                if controller == "cpuset":  # a cpuset child inherits nothing: copy the root's
                    for key in ("cpuset.cpus", "cpuset.mems"):
                        _write(parent / key, (ROOT / controller / key).read_text().strip())
            path.mkdir(exist_ok=True)
        cpus = self.paths["cpuset"]
        _write(cpus / "cpuset.mems", (cpus.parent / "cpuset.mems").read_text().strip())
        _write(cpus / "cpuset.cpus", cpuset or (cpus.parent / "cpuset.cpus").read_text().strip())
        self.set_quota(quota_cpus, period_us)
        if memory_mb is not None:
            limit = str(memory_mb * 2**20)
            _write(self.paths["memory"] / "memory.limit_in_bytes", limit)
            swap = self.paths["memory"] / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no swapping past the limit either
                _write(swap, limit)
        return self

    def set_quota(self, cpus: float | None, period_us: int = DEFAULT_PERIOD_US) -> None:
        """A quota of `cpus` cores per period (None: no quota); may change while tasks run."""
        path = self.paths["cpu"]
        if cpus is None:
            _write(path / "cpu.cfs_quota_us", "-1")
            return
        if not MIN_PERIOD_US <= period_us <= MAX_PERIOD_US:
            raise DeviceError(f"cgroup {self.name}: period {period_us} us is not in 1 ms..1 s")
        quota = round(cpus * period_us)
        if quota < MIN_QUOTA_US:
            raise DeviceError(
                f"cgroup {self.name}: a quota of {cpus:g} CPU at a {period_us} us period is "
                f"{quota} us, under the kernel's least of {MIN_QUOTA_US} us"
            )
        _write(path / "cpu.cfs_quota_us", "-1")  # the period may not drop under the quota
        _write(path / "cpu.cfs_period_us", str(period_us))
        _write(path / "cpu.cfs_quota_us", str(quota))

    def join(self, pid: int = 0) -> None:
        """Moves `pid` (0: the calling process) into every group. Safe between fork and exec:
        plain system calls only."""
        data = str(pid or os.getpid()).encode()
        for path in self.paths.values():
            fd = os.open(path / "cgroup.procs", os.O_WRONLY)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    def pids(self) -> list[int]:
        path = self.paths["cpuset"] / "cgroup.procs"
        try:
            return [int(line) for line in path.read_text().split()]
        except OSError:
            return []

    def freeze(self) -> None:
        self._freezer("FROZEN")

    def thaw(self) -> None:
        self._freezer("THAWED")

    def _freezer(self, state: str) -> None:
        path = self.paths["freezer"] / "freezer.state"
        _write(path, state)
        deadline = time.monotonic() + FREEZE_WAIT_S
        while path.read_text().strip() != state:  # FREEZING while tasks are stopped
            if time.monotonic() > deadline:
                raise DeviceError(f"cgroup {self.name}: not {state} after {FREEZE_WAIT_S:g} s")
            time.sleep(0.001)

    def oom_kills(self) -> int:
        """How many processes the kernel killed for the memory limit (0 where it does not
        count them)."""
        with contextlib.suppress(OSError):
            text = (self.paths["memory"] / "memory.oom_control").read_text()
            counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
            return int(counts.get("oom_kill", "0"))
        return 0

    def remove(self) -> None:
        """Kills what runs in the groups (thawed first), then removes them."""
        with contextlib.suppress(DeviceError, OSError):
            if self.paths["freezer"].is_dir():
                self.thaw()
        for _ in _tries(20):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for path in self.paths.values():
            for _ in _tries(20):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as error:  # busy: a killed task not yet gone
                    log.debug("rmdir %s: %s", path, error)


def _tries(count: int, pause_s: float = 0.05) -> Iterator[int]:
    for attempt in range(count):
        yield attempt
        time.sleep(pause_s)
