"""The serial link's per-frame core in C (`core.c`), built from the checkout with the
machine's gcc on first use and loaded with ctypes; None where it cannot be (no gcc), and the
program then runs its Python loop.

Built once per version of `core.c` into `.cache/serial-core/` (the name carries the source's
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
import tempfile
from pathlib import Path

from testbed.source import CACHE_DIR

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("core.c")
BUILD_DIR = CACHE_DIR / "serial-core"
GCC_FLAGS = ["-O2", "-shared", "-fPIC", "-pthread", "-Wall"]
STALL_LOG = 10_000  # core.c's ring


class Counters(ctypes.Structure):
    """core.c's `struct counters`: keep in step."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("frames", "bytes", "send_errors", "stalls", "stall_logged", "clock_fallbacks")
    ] + [
        (name, ctypes.c_int64)
        for name in ("queued_ns_sum", "queued_ns_max", "late_ns_sum", "late_ns_max", "stalled_ns")
    ]


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(GCC_FLAGS).encode()).hexdigest()
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
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(handle)
    try:
        subprocess.run(
            [gcc, *GCC_FLAGS, "-o", temporary, str(SOURCE)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


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
    library.serial_pair.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_double]
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
