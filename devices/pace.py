"""A device's speed, emulated by dilation: every stretch of compute takes 1/speed times the CPU
it used.

The worker computes at the speed of the core it runs on. To make it a device of speed s (a
fraction of that core), the compute thread, after each stretch of compute (an embedding, a
block's local projections, its attention, its FFN, the head), sleeps until the stretch's wall
time is its CPU time / s. A block that needs 10 ms of CPU then takes 20 ms at s = 0.5, every
time, and the core is free for others while the device sleeps, as it would be while a slower
core worked. A CPU quota gives the same mean but not the same blocks (docs/devices.md, Speed:
at Docker's 100 ms period most blocks run at full speed and some wait 50 ms).

With one compute thread (torch's intra-op threads = 1, a device of one CPU), CPU time, not
wall time, measures the stretch: when devices that share the host's cores compute at once
(sequence parallelism makes them), each one's stretch takes longer in wall time than its CPU
time, and the sleep shrinks by as much, so the device still takes what its speed says as long
as the contention leaves it at least its speed of a core. The clock is the compute thread's
own (`time.thread_time`: the senders' and receivers' threads do not count). With several
threads the stretch's wall time is the measure (their CPU time would count a GEMM's parallel
threads, and its serial parts once): the device sleeps (1/speed - 1) times it.

The speed can change while the worker runs: the orchestrator writes it into the device's
control file (`Control`), which the worker maps and reads at every stretch (no system call).
The same file releases the worker at inference boundaries where an event must happen before
the inference starts (`Control.wait_released`), and the worker says which measured round it
starts in its `progress` file (`Progress`), which the orchestrator reads.
"""

from __future__ import annotations

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


class Pace:
    """Stretches of compute at the device's speed (1.0: as fast as the core)."""

    def __init__(self, speed: float = 1.0, control: Control | None = None, threads: int = 1):
        self.fixed, self.control = speed, control
        clock = time.thread_time if threads == 1 else time.perf_counter
        self.cpu_clock: Callable[[], float] = clock
        self.slept_s = 0.0  # in all, for the session's facts

    @property
    def speed(self) -> float:
        return self.control.speed if self.control is not None else self.fixed

    @contextmanager
    def stretch(self) -> Iterator[None]:
        cpu, wall = self.cpu_clock(), time.perf_counter()
        yield
        speed = self.speed
        if speed >= 1.0:
            return
        remaining = wall + (self.cpu_clock() - cpu) / speed - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
            self.slept_s += remaining
