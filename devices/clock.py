"""The clock of every mark a device records, and the kernel's receive timestamps.

Marks are nanoseconds of CLOCK_REALTIME (`time.time_ns`), because that is the clock of the
kernel's software receive timestamps (`SO_TIMESTAMPNS`), which say when a message's last byte
reached this host, not when a busy thread got round to reading it. Containers and network
namespaces on one host share that clock; across machines the handshake measures each peer's
offset (devices.handshake) and the testbed aligns the records with it.

`Clock.skew_ns` is added to every reading, the kernel's timestamps included: a test can give a
device a clock that is off, as a real board's may be, and check that the alignment works.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterable

SO_TIMESTAMPNS_NEW = 64  # struct __kernel_timespec (two 64-bit fields) on every ABI; Linux 5.1+
SO_TIMESTAMPNS_OLD = 35  # struct timespec of the ABI (asm-generic value: x86-64, arm, arm64)
TIMESPECS = {SO_TIMESTAMPNS_NEW: struct.Struct("=qq"), SO_TIMESTAMPNS_OLD: struct.Struct("@ll")}
ANCILLARY_BYTES = socket.CMSG_SPACE(16)


class Clock:
    """CLOCK_REALTIME in nanoseconds, plus an optional skew (for tests)."""

    def __init__(self, skew_s: float = 0.0):
        self.skew_ns = round(skew_s * 1e9)

    def now_ns(self) -> int:
        return time.time_ns() + self.skew_ns

    def kernel_ns(self, ancillary: list[tuple[int, int, bytes]]) -> int | None:
        """The receive timestamp in a `recvmsg` call's ancillary data, on this clock."""
        stamp_ns = kernel_timestamp_ns(ancillary)
        return None if stamp_ns is None else stamp_ns + self.skew_ns


def kernel_timestamp_ns(ancillary: Iterable[tuple[int, int, bytes]]) -> int | None:
    """The kernel's receive timestamp (CLOCK_REALTIME ns) in a `recvmsg` call's ancillary
    data, either layout; None when it holds none. The one parser of these timestamps: the
    serial emulator and the benchmarks read theirs here too."""
    for level, kind, data in ancillary:
        layout = TIMESPECS.get(kind)
        if level == socket.SOL_SOCKET and layout is not None and len(data) >= layout.size:
            seconds, nanoseconds = layout.unpack_from(data)
            return seconds * 1_000_000_000 + nanoseconds
    return None


def enable_rx_timestamps(sock: socket.socket) -> bool:
    """Ask the kernel to stamp every received segment; False where it cannot."""
    for option in (SO_TIMESTAMPNS_NEW, SO_TIMESTAMPNS_OLD):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, 1)
            return True
        except OSError:
            continue
    return False
