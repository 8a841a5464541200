"""What every backend offers: start P devices, run commands on them, hand out what shapes
their links (`traffic_control`, which the run's links use), share a run directory with them
(or copy to and from it), stop everything.

Devices know their rank, their address on the run's network, the interface that carries
their traffic, and their CPU allotment. A backend owns everything it creates and removes it
in `stop()`, which is idempotent and also runs when the backend is used as a context manager.

The run secret: every backend makes a fresh random secret when it is created (one per set of
devices: a run starts one backend per device count) and `start()` delivers it to each device
as a file only that device's worker can read, outside the run directory, recorded by rank in
`secret_files` as the device sees it. The session's specs name that file
(`RunSpec.secret_file`), and the workers prove in their handshake that they hold it
(`devices.handshake`). The secret itself is never written to the run directory (results),
never logged, never passed on a command line; `stop()` removes the files.
"""

from __future__ import annotations

import abc
import functools
import logging
import os
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from testbed.backends.traffic_control import TrafficControl
from testbed.experiment.resolved_fleet import worker_threads
from testbed.experiment.sections import SECTIONS

if TYPE_CHECKING:
    from testbed.experiment.schema import Experiment

from testbed.errors import DeviceError

log = logging.getLogger(__name__)

RUN_SECRET_BYTES = 32
SECRET_FILE_NAME = "run.key"


def write_secret(path: Path, secret: bytes, owner: tuple[int, int] | None = None) -> Path:
    """The secret as hex digits in a new file of mode 0600 (0400 when handed to another
    `owner`, uid and gid); it is never readable by anyone else, not even for a moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secret.hex().encode() + b"\n")
        if owner is not None:
            os.fchmod(fd, 0o400)
            os.fchown(fd, *owner)
    finally:
        os.close(fd)
    return path


@dataclass(frozen=True)
class DeviceSpec:
    """What a run asks of its devices: how many, and each one's CPUs and memory (one value
    for all, or one per rank)."""

    count: int
    cpus: float | Sequence[float] = 1.0
    memory_mb: int | Sequence[int] = 2048

    def cpus_of(self, rank: int) -> float:
        return float(self.cpus[rank] if isinstance(self.cpus, Sequence) else self.cpus)

    def memory_of(self, rank: int) -> int:
        return int(self.memory_mb[rank] if isinstance(self.memory_mb, Sequence) else self.memory_mb)

    @property
    def all_cpus(self) -> list[float]:
        return [self.cpus_of(rank) for rank in range(self.count)]


@dataclass(frozen=True)
class Device:
    rank: int
    name: str  # container or network-namespace name
    address: str  # IPv4 address on the run's network, reachable by every peer
    interface: str  # the device's interface on that network, as the device sees it
    cpus: float
    threads: int  # intra-op threads for the worker: matches the CPU allotment
    cpuset: str | None = None  # pinned cores, when the host has enough of them
    netns_path: str | None = None  # host path of its network namespace (for pyroute2)


@dataclass(frozen=True)
class Leftovers:
    """What a run left that one backend made, as found when the run is over: the run (its
    id, or only its tag where a name carries no more) and the things, one line each as
    `testbed.clean` lists them."""

    tag: str
    run_id: str | None
    items: tuple[str, ...]


@dataclass
class ExecResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, lines: int = 20) -> str:
        text = (self.stderr or self.stdout).strip().splitlines()
        return "\n".join(text[-lines:])


class Process(abc.ABC):
    """A command running on a device; a thread of ours waits for it and keeps its result.

    Subclasses set what `_collect` needs, then call this constructor, which starts the thread.
    """

    def __init__(self, label: str):
        self.label = label
        self.result: ExecResult | None = None
        self.thread = threading.Thread(target=self._collect, name=f"proc-{label}", daemon=True)
        self.thread.start()

    @abc.abstractmethod
    def _collect(self) -> None:
        """Wait for the command's end and set `self.result`."""

    def wait(self, timeout_s: float | None = None) -> ExecResult:
        """Wait for the end; raises TimeoutError when it is still running after timeout_s."""
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"{self.label} still running after {timeout_s} s")
        assert self.result is not None
        return self.result

    @abc.abstractmethod
    def kill(self) -> None: ...

    def terminate(self) -> None:
        """Ask the command to end (SIGTERM: a worker unwinds and keeps what it measured);
        where a backend cannot ask, it kills."""
        self.kill()


@dataclass
class CpuPlan:
    """How P devices, each with its CPUs, fit on the host's cores."""

    cpusets: list[str | None]  # by rank: pinned cores, or None (a quota)
    oversubscribed: bool
    host_cores: int
    threads: list[int] = field(default_factory=list)  # by rank: the worker's torch threads


def plan_cpus(count: int, cpus: float | Sequence[float], host_cores: int | None = None) -> CpuPlan:
    """Pin whole cores (of those this process may use) when every device asks for whole
    cores and there are enough of them; otherwise share by quota. `cpus`: one value for every
    device, or one per rank.

    Oversubscribed means the devices' allotments add up to more cores than the host has: the
    devices then compete for cores and their compute times are inflated.
    """
    cores = sorted(os.sched_getaffinity(0)) if host_cores is None else list(range(host_cores))
    each = [float(c) for c in cpus] if isinstance(cpus, Sequence) else [float(cpus)] * count
    threads = [worker_threads(c) for c in each]
    if all(c.is_integer() for c in each) and sum(each) <= len(cores):
        sets, first = [], 0
        for c in each:
            sets.append(",".join(str(core) for core in cores[first : first + int(c)]))
            first += int(c)
        return CpuPlan(list(sets), False, len(cores), threads)
    return CpuPlan([None] * count, sum(each) > len(cores), len(cores), threads)


class Backend(abc.ABC):
    """Base of every backend of the table (`testbed.backends.table`).

    What a backend can do is said by its class attributes, which the preflight, the links and
    the runner read instead of its name; what it cannot run, by its `refusal`.
    """

    name: str = ""
    python: str = "python3"  # the interpreter that runs the worker on a device
    # the devices share this host's kernel, clock and cores: their network namespaces can be
    # entered from here (the serial emulator needs that) and their CPUs are the host's
    on_this_host: bool = True
    default_emulator: str = "serial"  # when the experiment names none (testbed.link.emulators)
    shapes_downlinks: bool = True  # downlink and per-pair rates, not only uplinks
    # the experiment's top-level section it reads (testbed.experiment.sections), if any:
    # `inventory` (ssh), `provider` (enoslib)
    settings: str | None = None
    in_auto: bool = False  # `backend: auto` may take it (in the table's order) when available

    @classmethod
    def refusal(cls, experiment: Experiment) -> str | None:
        """Why this backend cannot run `experiment`, in one line naming the field (`field:
        what is wrong; what would be right`), or None: asked by the preflight before anything
        starts, which adds the file. Here: its section missing, then what the section must
        hold (`section_refusal`), then what only devices on this host can have (a timeline,
        speeds given as rates), then downlink and per-pair rates on a backend that shapes
        uplinks only."""
        if cls.settings is not None and experiment.section(cls.settings) is None:
            needed = SECTIONS[cls.settings].needed if cls.settings in SECTIONS else "it"
            return f"{cls.settings}: backend '{cls.name}' needs {needed}"
        refused = cls.section_refusal(experiment) or cls._fleet_refusal(experiment)
        if refused is not None or cls.shapes_downlinks:
            return refused
        able = " or ".join(name for name, kind in BACKENDS.items() if kind.shapes_downlinks)
        for field_name in ("downlink_mbit", "pair_mbit"):
            if getattr(experiment.link, field_name):
                return (
                    f"link.{field_name}: the {cls.name} backend shapes uplinks only "
                    f"(link.uplink_mbit); downlink and per-pair rates need the {able} backend"
                )
        return None

    @classmethod
    def _fleet_refusal(cls, experiment: Experiment) -> str | None:
        """Devices elsewhere (boards) are real: their speed is theirs (a fraction of it may
        still be asked, `devices.speed`), and the timeline needs their files live on this host."""
        if cls.on_this_host:
            return None
        if experiment.timeline:
            return (
                f"timeline: the {cls.name} backend's boards cannot be paused, slowed or left "
                "while they run (a timeline needs devices on this host: docker or local)"
            )
        for variant in [experiment.devices, *(experiment.devices.variants or [])]:
            for field_name in ("gflops", "profile"):
                if getattr(variant, field_name) is not None:
                    return (
                        f"devices.{field_name}: the {cls.name} backend's boards compute at "
                        "their own rate (measured when they start); a fraction of it is "
                        "devices.speed"
                    )
        return None

    @classmethod
    def section_refusal(cls, experiment: Experiment) -> str | None:
        """Why its section, given, cannot carry the experiment (files that are not there, too
        few boards), or None. Here: None."""
        return None

    @classmethod
    def create(cls, run_id: str, run_dir: Path, experiment: Experiment) -> Backend:
        """The backend for one set of devices of a run."""
        return cls(run_id, run_dir)

    @classmethod
    def available(cls) -> bool:
        """Whether it can start devices here (what `backend: auto` asks)."""
        return True

    @classmethod
    def versions(cls) -> dict[str, str]:
        """Versions of what it runs on, for environment.json."""
        return {}

    @classmethod
    def leftovers(cls, run_dirs: Mapping[str, Path]) -> list[Leftovers]:
        """What runs left of this backend's making, by run (what `stop` would have removed,
        had it run): `testbed.clean` removes what it finds once the run is over. `run_dirs`:
        the run directory of each run this host holds a lock of, by run id (a backend may
        keep a record there). Here: nothing."""
        return []

    @classmethod
    def remove(cls, leftovers: Leftovers) -> list[str]:
        """Removes what `leftovers` lists (one of `leftovers()`); returns what went, one line
        each."""
        return []

    def __init__(self, run_id: str, run_dir: Path):
        self.run_id = run_id
        self.run_dir = Path(run_dir).resolve()
        self.devices: list[Device] = []
        self.cpu_plan: CpuPlan | None = None
        # by rank: seconds added to every timestamp the worker takes, to emulate boards whose
        # clocks are off (tests of the clock alignment)
        self.clock_skews_s: dict[int, float] = {}
        self.secret = secrets.token_bytes(RUN_SECRET_BYTES)  # see the module's docstring
        self.secret_files: dict[int, str] = {}  # by rank, as the device sees it

    def prepare(self) -> None:  # noqa: B027 - optional hook
        """What must exist before devices can start and takes long to make the first time
        (the docker backend's worker image); `start` does it too when it was not called."""

    @abc.abstractmethod
    def start(self, spec: DeviceSpec) -> list[Device]:
        """Create the run's network and P devices; returns them in rank order.

        On any BaseException (Ctrl-C included) it calls `stop()` before re-raising.
        """

    @abc.abstractmethod
    def spawn(self, device: Device, argv: Sequence[str]) -> Process:
        """Start a command on a device without waiting for it."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Remove everything this backend created (idempotent)."""

    def gone(self, device: Device) -> str | None:
        """Why `device` no longer runs (killed, out of memory, removed), or None while it
        does: what a session that lost it says. Here: its network namespace is gone (the
        kind of path a container's or a held namespace's is); backends that know more say
        more."""
        path = device.netns_path
        if path is not None and not os.path.exists(path):
            return f"its network namespace {path} is gone"
        return None

    def pause(self, device: Device) -> None:
        """Freezes every process of the device (a timeline's pause) until `resume`."""
        raise DeviceError(f"the {self.name} backend cannot pause a device")

    def resume(self, device: Device) -> None:
        raise DeviceError(f"the {self.name} backend cannot resume a device")

    def live_output(self, device: Device, host_path: Path) -> Path | None:
        """Where the host can read, while the worker runs, what the device writes for the
        run-directory folder `host_path` (its `output_path`); None where it cannot (boards:
        their files come back only with `collect`)."""
        return Path(host_path) if self.on_this_host else None

    def out_of_memory(self, device: Device) -> bool:
        """Whether the kernel has killed a process of `device` for memory (its memory
        limit); False where the backend cannot tell."""
        return False

    def device_path(self, host_path: Path) -> str:
        """Path under which a device sees a file of the run directory."""
        return str(Path(host_path).resolve())

    def output_path(self, device: Device, host_path: Path) -> str:
        """Path under which `device` writes what belongs in the run-directory folder
        `host_path` (the worker's `out`); `collect` brings it back. The device_path by default."""
        return self.device_path(host_path)

    def collect(self, device: Device, host_path: Path) -> None:  # noqa: B027 - optional hook
        """Brings the device's copy of a run-directory folder (its `output_path`) back into
        `host_path`. A no-op where devices write straight into the shared run directory."""

    def for_each(self, devices: Sequence[Device], action: Callable[[Device], None]) -> None:
        """`action` on every device, in rank order; a backend whose devices answer slowly
        (boards over SSH) does them at once."""
        for device in devices:
            action(device)

    @functools.cached_property
    def traffic_control(self) -> TrafficControl:
        """What shapes the devices' links (`testbed.backends.traffic_control`), one per
        backend: the run's links shape through it. Here: this host's kernel, in each
        device's network namespace."""
        return TrafficControl()

    def run(self, device: Device, argv: Sequence[str], timeout_s: float = 60.0) -> ExecResult:
        process = self.spawn(device, argv)
        try:
            return process.wait(timeout_s)
        except TimeoutError:
            process.kill()
            raise

    @property
    def oversubscribed(self) -> bool:
        return bool(self.cpu_plan and self.cpu_plan.oversubscribed)

    def __enter__(self) -> Backend:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


BACKENDS: dict[str, type[Backend]] = {}  # the table, filled by testbed.backends.table
