"""The serial link's per-frame core in C (`core.c`, with netem's draws in `impair.c`), built
from the checkout with the machine's gcc on first use and loaded with ctypes; None where it
cannot be (no gcc), and the program then runs its Python loop.

Built once per version of the sources into `.cache/serial-core/` (the name carries their
hash; a build writes a temporary file and renames it, so that two switches starting at once
do not load a half-written library). A call into it releases the interpreter's lock, so each
port's thread clocks its frames without waiting for another's Python.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from testbed.atomic import write_atomically
from testbed.link.serial.netem_draws import Copy, Impairments
from testbed.source import CACHE_DIR

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("core.c", "impair.c"))
HEADERS = (Path(__file__).with_name("impair.h"),)
BUILD_DIR = CACHE_DIR / "serial-core"
GCC_FLAGS = ["-O2", "-shared", "-fPIC", "-pthread", "-Wall"]
STALL_LOG = 10_000  # core.c's rings
EVENT_LOG = 100_000
LOSS_KINDS = {"RandomLoss": 1, "GilbertElliott": 2, "FourState": 3}  # impair.h's LOSS_*


class Counters(ctypes.Structure):
    """core.c's `struct counters`: keep in step."""

    _fields_ = (
        [
            (name, ctypes.c_uint64)
            for name in (
                "frames",
                "bytes",
                "send_errors",
                "stalls",
                "stall_logged",
                "clock_fallbacks",
            )
        ]
        + [
            (name, ctypes.c_int64)
            for name in (
                "queued_ns_sum",
                "queued_ns_max",
                "late_ns_sum",
                "late_ns_max",
                "stalled_ns",
            )
        ]
        + [
            (name, ctypes.c_uint64)
            for name in ("lost", "duplicated", "reordered", "queue_drops", "event_logged")
        ]
    )


class ImpairmentSpec(ctypes.Structure):
    """impair.h's `struct impairment_spec`: keep in step."""

    _fields_ = [
        ("delay_ns", ctypes.c_int64),
        ("jitter_ns", ctypes.c_int64),
        ("gap", ctypes.c_int64),
        ("table", ctypes.POINTER(ctypes.c_int32)),
        ("table_size", ctypes.c_int32),
        ("loss_kind", ctypes.c_int32),
        ("delay_rho", ctypes.c_uint32),
        ("duplicate", ctypes.c_uint32),
        ("duplicate_rho", ctypes.c_uint32),
        ("reorder", ctypes.c_uint32),
        ("reorder_rho", ctypes.c_uint32),
        ("loss", ctypes.c_uint32 * 5),
    ]


def library_path() -> Path:
    text = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    digest = hashlib.sha256(text + " ".join(GCC_FLAGS).encode()).hexdigest()
    return BUILD_DIR / f"serial-core-{digest[:16]}.so"


def build() -> Path:
    """The library for this `core.c`, compiled unless already there. Raises OSError or
    CalledProcessError where it cannot be."""
    path = library_path()
    if path.exists():
        return path
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise OSError("no C compiler (gcc) on this host")
    path.parent.mkdir(parents=True, exist_ok=True)

    def compile_into(temporary: Path) -> None:
        argv = [gcc, *GCC_FLAGS, "-o", str(temporary), *map(str, SOURCES)]
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=120)

    return write_atomically(path, compile_into)


def load() -> ctypes.CDLL | None:
    """The core, built if needed; None (with the reason logged) where it cannot be."""
    try:
        library = ctypes.CDLL(str(build()))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("the serial link's C core is unavailable (%s): the Python loop runs", detail)
        return None
    library.serial_counters_size.restype = ctypes.c_size_t
    if library.serial_counters_size() != ctypes.sizeof(Counters):
        log.warning("the serial link's C core does not match Counters: the Python loop runs")
        return None
    library.serial_rate.argtypes = library.serial_down.argtypes = [ctypes.c_int, ctypes.c_double]
    library.serial_port.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_double]
    library.serial_spin.argtypes = [ctypes.c_int64]
    library.serial_medium.argtypes = [ctypes.c_int, ctypes.c_int64]
    library.serial_ends_message.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t, ctypes.c_int]
    library.serial_pair.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_double]
    library.serial_impairments.restype = ctypes.c_void_p
    library.serial_impairments.argtypes = [
        ctypes.POINTER(ImpairmentSpec),
        ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int,
    ]
    library.serial_impairments_free.argtypes = [ctypes.c_void_p]
    library.serial_impair.argtypes = library.serial_impair_down.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    library.serial_impair_pair.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    library.serial_mode.argtypes = [ctypes.c_int] * 4
    library.serial_impair_draw.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int),
    ]
    library.serial_events.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int),
        ctypes.c_int,
    ]
    library.serial_counters.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(Counters),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.c_int,
    ]
    return library


def counters(library: ctypes.CDLL, index: int) -> tuple[Counters, list[tuple[int, int]]]:
    """A port's counters and its logged stalls, (start ns, length ns), oldest first."""
    out = Counters()
    starts, lengths = (ctypes.c_int64 * STALL_LOG)(), (ctypes.c_int64 * STALL_LOG)()
    kept = library.serial_counters(index, ctypes.byref(out), starts, lengths, STALL_LOG)
    if kept < 0:
        raise OSError(-kept, os.strerror(-kept))
    return out, [(starts[k], lengths[k]) for k in range(kept)]


def events(library: ctypes.CDLL, index: int) -> list[tuple[int, int]]:
    """A port's logged impairment events, (time ns, code of port.IMPAIRED), oldest first."""
    times, codes = (ctypes.c_int64 * EVENT_LOG)(), (ctypes.c_int * EVENT_LOG)()
    kept = library.serial_events(index, times, codes, EVENT_LOG)
    if kept < 0:
        raise OSError(-kept, os.strerror(-kept))
    return list(zip(times[:kept], codes[:kept], strict=True))


def seed_key(seed: int) -> list[int]:
    """The key `random.seed(seed)` gives MT19937's init_by_array: the 32-bit words of |seed|,
    least significant first."""
    value, key = abs(seed), []
    while value:
        key.append(value & 0xFFFF_FFFF)
        value >>= 32
    return key or [0]


def impairments(library: ctypes.CDLL, drawn: Impairments) -> int:
    """The core's generator for what `drawn` (checked, converted to netem's thresholds, not
    yet drawn from) describes, seeded alike: a handle the core owns once given to a port."""
    spec = ImpairmentSpec()
    delay = drawn.delay
    spec.delay_ns, spec.jitter_ns, spec.delay_rho = delay.mu, delay.sigma, delay.random.rho
    if delay.table is not None:
        spec.table = (ctypes.c_int32 * len(delay.table))(*delay.table)
        spec.table_size = len(delay.table)
    loss = drawn.loss
    if loss is not None:
        spec.loss_kind = LOSS_KINDS[type(loss).__name__]
        spec.loss[:] = {
            1: lambda: (loss.threshold, loss.random.rho, 0, 0, 0),
            2: lambda: (loss.p, loss.r, loss.h, loss.k1, 0),
            3: lambda: (loss.p13, loss.p31, loss.p32, loss.p23, loss.p14),
        }[spec.loss_kind]()
    spec.duplicate, spec.duplicate_rho = drawn.duplicate, drawn.duplicate_random.rho
    spec.reorder, spec.reorder_rho, spec.gap = drawn.reorder, drawn.reorder_random.rho, drawn.gap
    key = seed_key(drawn.seed)
    handle = library.serial_impairments(
        ctypes.byref(spec), (ctypes.c_uint32 * len(key))(*key), len(key)
    )
    if not handle:
        raise ValueError(f"the C core refuses the impairments {drawn.parameters}")
    return int(handle)


def draw(library: ctypes.CDLL, handle: int, frames: int) -> list[list[Copy]]:
    """The core's copies of the next `frames` frames, as `Impairments.frame()` gives them."""
    counts = (ctypes.c_int * frames)()
    delays, reordered = (ctypes.c_int64 * (2 * frames))(), (ctypes.c_int * (2 * frames))()
    library.serial_impair_draw(handle, frames, counts, delays, reordered)
    return [
        [Copy(delays[2 * f + c] / 1e9, bool(reordered[2 * f + c])) for c in range(counts[f])]
        for f in range(frames)
    ]
