"""A device's speed, emulated by pacing: every stretch of compute takes its reference cost /
speed in wall time.

The worker computes at the speed of the core it runs on. To make it a device of speed s (a
fraction of that core), the compute thread, after each stretch of compute (an embedding, a
block's local projections, its attention, its FFN, the head), sleeps until the stretch's wall
time is its cost / s, and the core is free for others while the device sleeps, as it would be
while a slower core worked. A CPU quota gives the same mean but not the same blocks
(docs/devices.md, Speed).

The cost of a stretch is its *reference*, not the CPU time it happened to take: a stretch's CPU
time moves with the host (a cold core after a sleep, the neighbours' cache pressure, a busy
process on the other core), and a device's time must not. `Pace` learns each kind of stretch
(`key`: its run's kind, `kinds`, and the stretch's name) from the session's warm-ups, run back
to back at full speed (a warm core), as CPU time per unit of its size (`size`: keys attended
where the work follows the data, as Trace's unique remote keys do), and takes a low percentile
of those samples (REFERENCE_PERCENTILE) as the stretch's cost from then on: a warm core's,
without the slow tail. References can be given (`give`): the testbed keeps the first it learns
on a host, so that every later run paces to the same costs (testbed.sweep.stretch_costs).
Devices that share a host warm up at once, so one device's samples would hold what its peers
left of the cores (two 2-thread devices on two cores: an FFN's sample twice another's of the
same size): with a turn file (the session's, on one host), a sampled stretch runs only while
its device holds the file's lock, one device at a time (TURN_WAIT_S at most: past it, the
stretch runs and is sampled without its turn, so that no wait can hang the warm-ups). A stretch
the host could not deliver by its target (its own CPU time already past cost / s, more than
OVERRUN_TOLERANCE) is an *overrun*, counted per inference. A stretch with no key, or one not
learned yet, costs its own CPU time.

With one compute thread (torch's intra-op threads = 1, a device of one CPU) CPU time is the
compute thread's own (`time.thread_time`: the senders' and receivers' threads do not count).
With several threads the stretch's wall time is the measure (their CPU time would count a
GEMM's parallel threads, and its serial parts once).

The testbed's virtual time (docs/devices.md, Virtual time) gives the worker speed s / d, the
dilation d making room on the host for the fleet: the worker itself knows nothing of d.

The speed can change while the worker runs: the orchestrator writes it into the device's
control file (`Control`), which the worker maps and reads at every stretch (no system call).
The same file releases the worker at inference boundaries where an event must happen before
the inference starts (`Control.wait_released`), and the worker says which measured round it
starts in its `progress` file (`Progress`), which the orchestrator reads.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# speed, releases; written twice so that a reader never takes a torn write for a value
CONTROL = struct.Struct("<dqdq")
# the measured round a device has started (-1: none yet) and when (its clock, ns); the same
PROGRESS = struct.Struct("<qqqq")
PROGRESS_FILE = "progress"  # in the worker's output folder
HOLD_POLL_S = 0.0005


def write_control(path: Path, speed: float, released: int = 0) -> None:
    """Writes the control file in place (a reader's map keeps seeing this inode)."""
    data = CONTROL.pack(speed, released, speed, released)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)


class Progress:
    """Where the worker says which measured round it starts (`out/progress`)."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.write(-1, 0)

    def write(self, round_index: int, at_ns: int) -> None:
        os.pwrite(self.fd, PROGRESS.pack(round_index, at_ns, round_index, at_ns), 0)

    def close(self) -> None:
        os.close(self.fd)


def read_progress(path: Path) -> tuple[int, int] | None:
    """(round, its start ns) a worker reported, or None (no file yet, or a torn read)."""
    try:
        with path.open("rb") as stream:
            data = stream.read(PROGRESS.size)
    except OSError:
        return None
    if len(data) < PROGRESS.size:
        return None
    round_index, at_ns, again, at_again = PROGRESS.unpack(data)
    return (round_index, at_ns) if (round_index, at_ns) == (again, at_again) else None


class Control:
    """The worker's read-only view of its control file."""

    def __init__(self, path: Path):
        with path.open("rb") as stream:
            self.map = mmap.mmap(stream.fileno(), CONTROL.size, access=mmap.ACCESS_READ)
        self.last = (1.0, 0)
        self.read()

    def read(self) -> tuple[float, int]:
        speed, released, again, released_again = CONTROL.unpack_from(self.map)
        if (speed, released) == (again, released_again) and speed > 0:
            self.last = (speed, released)
        return self.last

    @property
    def speed(self) -> float:
        return self.read()[0]

    def wait_released(self, count: int, timeout_s: float) -> bool:
        """Blocks until the orchestrator has released `count` holds; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.read()[1] < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(HOLD_POLL_S)
        return True

    def close(self) -> None:
        self.map.close()


REFERENCE_PERCENTILE = 10  # of a stretch's warm samples: its cost from then on
LEAST_SAMPLES = 4  # a stretch's reference is kept from this many samples, at least
OVERRUN_TOLERANCE = 0.05  # of a stretch's target, and at least OVERRUN_MIN_S
OVERRUN_MIN_S = 0.0003
OVERSHOOT_WEIGHT = 0.1  # of each sleep's lateness in the running mean
TURN_WAIT_S = 2.0  # at most, for the turn file's lock before a sampled stretch


def run_kind(model: str, method: str, params: dict, tokens: int, batch: int, threads: int) -> str:
    """What a run's stretches of compute are, for their references: the same model, method,
    parameters, tokens, batch and threads do the same work on a host."""
    written = json.dumps(params, sort_keys=True, default=str)
    return f"{model}|{method}|{written}|{tokens} tokens|b{batch}|t{threads}"


def knows_run(references: dict[str, float], kind: str) -> bool:
    """Whether `references` hold the stretches a run of `kind` samples once an inference (its
    embedding, and its first block's, learned with it): a warm-up gives them one sample each,
    so the testbed gives a run that has none LEAST_SAMPLES warm-ups (testbed.sweep.sessions)."""
    return f"{kind}|embed|" in references


def low_percentile(samples: list[float], percent: float = REFERENCE_PERCENTILE) -> float:
    """The sample below which `percent` % of them lie (the nearest rank)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * percent / 100))]


def _units(size: Callable[[], float] | None) -> float:
    """A stretch's work in its kind's units (1 without a size)."""
    return 1.0 if size is None else max(float(size()), 1e-9)


class Pace:
    """Stretches of compute at the device's speed (1.0: as fast as the core)."""

    def __init__(
        self,
        speed: float = 1.0,
        control: Control | None = None,
        threads: int = 1,
        turn: Path | None = None,
    ):
        self.fixed, self.control = speed, control
        self.turn = None if turn is None else os.open(turn, os.O_RDONLY)
        clock = time.thread_time if threads == 1 else time.perf_counter
        self.cpu_clock: Callable[[], float] = clock
        self.slept_s = 0.0  # in all, for the session's facts
        self.samples: dict[str, list[float]] = {}  # CPU s per unit, by stretch kind
        self.reference: dict[str, float] = {}  # cost per unit, learned or given
        self.given: set[str] = set()  # kinds whose reference came with the spec
        self.kinds: dict[str, str] = {}  # a run's id -> what its stretches are (their kind)
        self.learning = True  # the warm-ups: at full speed, samples taken
        self.overruns = 0  # stretches that ended late, since the session began
        self.overshoot_s = 0.0  # how late a sleep wakes, on average: each sleep is that shorter

    @property
    def speed(self) -> float:
        return self.control.speed if self.control is not None else self.fixed

    def give(self, references: dict[str, float]) -> None:
        """References known before the session (this host's, testbed.sweep.stretch_costs)."""
        self.reference.update(references)
        self.given.update(references)

    def learned(self) -> None:
        """The warm-ups are over: every stretch they sampled has its reference from now on
        (the testbed keeps only those sampled LEAST_SAMPLES times: new_references)."""
        self.learning = False
        for key, samples in self.samples.items():
            if key not in self.reference:
                self.reference[key] = low_percentile(samples)

    def new_references(self) -> dict[str, dict[str, float]]:
        """What this session learned (not given): per kind, its cost per unit and samples."""
        return {
            key: {"per_unit_s": cost, "samples": len(self.samples.get(key, []))}
            for key, cost in self.reference.items()
            if key not in self.given
        }

    def kind(self, key: tuple[str, ...]) -> str:
        """A stretch's kind as a text: its run's kind (`kinds`), then the rest of the key."""
        run, *rest = key
        return "|".join([self.kinds.get(run, run), *rest])

    def cost_s(self, key: str | None, size: float, used_s: float) -> float:
        """What the stretch costs: its reference times its size, or its own CPU time where
        it has none yet (then it is a sample)."""
        if key is None:
            return used_s
        per_unit = self.reference.get(key)
        if per_unit is not None:
            return per_unit * size
        if len(self._sample(key, used_s / size)) >= LEAST_SAMPLES:
            self.reference[key] = low_percentile(self.samples[key])
        return used_s

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """The host's cores to this device alone, while its peers wait (the turn file's lock;
        none without a file, or once TURN_WAIT_S has passed)."""
        held = False
        if self.turn is not None:
            deadline = time.monotonic() + TURN_WAIT_S
            while not held and time.monotonic() < deadline:
                try:
                    fcntl.flock(self.turn, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                except BlockingIOError:
                    time.sleep(HOLD_POLL_S)
        try:
            yield
        finally:
            if held:
                fcntl.flock(self.turn, fcntl.LOCK_UN)

    def _sample(self, key: str, per_unit_s: float) -> list[float]:
        samples = self.samples.setdefault(key, [])
        samples.append(per_unit_s)
        return samples

    @contextmanager
    def stretch(
        self, key: tuple[str, ...] | None = None, size: Callable[[], float] | None = None
    ) -> Iterator[None]:
        """A stretch of compute; `key` names its kind (None: paced by its own CPU time) and
        `size()`, read once it is done, its work in the kind's units (1 without)."""
        kind = None if key is None else self.kind(key)
        if kind is not None and self.learning and kind not in self.reference:
            with self._turn():  # a warm core at full speed, its own: a sample
                cpu = self.cpu_clock()
                yield
                used_s = self.cpu_clock() - cpu
            self._sample(kind, used_s / _units(size))
            return
        cpu, wall = self.cpu_clock(), time.perf_counter()
        yield
        if kind is not None and self.learning:  # a warm-up, its reference given: unpaced
            return
        speed = self.speed
        units = _units(size)
        if speed >= 1.0:
            return
        target_s = self.cost_s(kind, units, self.cpu_clock() - cpu) / speed
        asleep = time.perf_counter()
        remaining = wall + target_s - asleep
        if remaining > self.overshoot_s:
            time.sleep(remaining - self.overshoot_s)  # the kernel wakes it a little late
            late = time.perf_counter() - asleep - (remaining - self.overshoot_s)
            self.overshoot_s += OVERSHOOT_WEIGHT * (max(0.0, late) - self.overshoot_s)
            self.slept_s += remaining
        elif -remaining > max(OVERRUN_TOLERANCE * target_s, OVERRUN_MIN_S):
            self.overruns += 1
