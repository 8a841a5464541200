"""A port of the serial link's switch: one veth end in the switch namespace, its socket (the
queue), rate, schedule, impairments and counters, and the Python loop that serves it (the
decisions are `testbed.link.serial.program`'s docstring; the C loop is `core.c`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from devices.clock import ANCILLARY_BYTES, enable_rx_timestamps, kernel_timestamp_ns
from testbed.errors import ShapingError
from testbed.link.serial.core import counters as core_counters
from testbed.link.serial.core import events as core_events
from testbed.link.serial.core import impairments as core_impairments
from testbed.link.serial.netem_draws import Copy, Impairments
from testbed.link.wire import (
    MIN_QUEUE_FRAMES,
    departure_s,
    queue_frames,
    rcvbuf_request_bytes,
    wire_time_s,
)

log = logging.getLogger(__name__)

# Kernel constants the socket module does not export (asm-generic values: x86-64, arm64).
ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_STATISTICS = 6
PACKET_IGNORE_OUTGOING = 23
SO_RCVBUFFORCE = 33
PACKET_STATS = struct.Struct("=II")  # tpacket_stats: packets, drops (reset when read)
SO_MEMINFO = 55  # u32 array, SK_MEMINFO_RMEM_ALLOC first
MEMINFO_BYTES = 36  # SK_MEMINFO_VARS (9) x u32

FRAME_BUFFER_BYTES = 65536
DEFAULT_SPIN_US = 0.0
SPIN_SHARE = 0.5  # of a wait, polled at most
# a frame this late was held up by the machine, not by a wake-up (those are 5-150 us late)
STALL_S = 1e-3
STALL_LOG = 10_000  # stalls kept with their times (a run sees one every few seconds at most)
EVENT_LOG = 100_000  # impairment events kept with their times
IMPAIRED = ("lost", "duplicated", "reordered")
TIMESTAMP_SANITY_S = 60.0
UNIMPAIRED = (Copy(0.0),)  # a frame sent once, without delay


def wait_until(deadline_s: float, spin_s: float) -> None:
    """Sleeps until shortly before the deadline (time.time() clock), then polls.

    The poll covers the last `spin_s`, or `SPIN_SHARE` of the wait when that is shorter: a
    short sleep wakes up on time, a long one (deeper CPU idle) is the one that wakes late.
    """
    wait_s = deadline_s - time.time()
    rest_s = wait_s - min(spin_s, SPIN_SHARE * wait_s)
    if rest_s > 0:
        time.sleep(rest_s)
    while time.time() < deadline_s:
        time.sleep(0)  # lets another port's thread take the GIL


def enable_timestamps(sock: socket.socket) -> None:
    """Turns kernel receive timestamps on (SO_TIMESTAMPNS_NEW, else SO_TIMESTAMPNS)."""
    if not enable_rx_timestamps(sock):
        raise ShapingError("the kernel refuses SO_TIMESTAMPNS on packet sockets")


@dataclass
class PortCounters:
    """What a port has done: frames and bytes its device sent, drops, timing of its frames."""

    frames: int = 0
    bytes: int = 0
    drops: int = 0  # the queue was full (PACKET_STATISTICS)
    queue_drops: int = 0  # likewise, while frames are read ahead (reordering)
    lost: int = 0  # frames the impairments' loss model dropped
    duplicated: int = 0  # frames sent twice
    reordered: int = 0  # copies sent ahead of the delayed ones
    send_errors: int = 0
    queued_s_sum: float = 0.0  # start - arrival: waiting behind earlier frames
    queued_s_max: float = 0.0
    late_s_sum: float = 0.0  # sent - scheduled end: this program's lateness
    late_s_max: float = 0.0
    # stalls: runs of frames each more than STALL_S late (the machine did not run this
    # program: a VM's vCPU held by its host, kernel work); a stall's length is its first
    # frame's lateness, the link's time lost at most (less where queued frames catch up)
    stalls: int = 0
    stalled_s: float = 0.0
    stalling: bool = False
    stall_log: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=STALL_LOG))
    # what the impairments did and when (time.time(), a code of IMPAIRED), the last EVENT_LOG
    event_log: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=EVENT_LOG))

    def impaired(self, arrival_s: float, lost: bool, duplicated: bool) -> None:
        self.lost += lost
        self.duplicated += duplicated
        self.event_log.append((arrival_s, IMPAIRED.index("lost" if lost else "duplicated")))

    def reorder(self, arrival_s: float) -> None:
        self.reordered += 1
        self.event_log.append((arrival_s, IMPAIRED.index("reordered")))

    def record(self, frame_bytes: int, queued_s: float, late_s: float, due_s: float) -> None:
        """A frame sent `late_s` after `due_s`, its scheduled end (time.time())."""
        self.frames += 1
        self.bytes += frame_bytes
        self.queued_s_sum += queued_s
        self.queued_s_max = max(self.queued_s_max, queued_s)
        self.late_s_sum += late_s
        self.late_s_max = max(self.late_s_max, late_s)
        if late_s > STALL_S and not self.stalling:
            self.stalls += 1
            self.stalled_s += late_s
            self.stall_log.append((due_s, late_s))
        self.stalling = late_s > STALL_S

    def as_dict(self) -> dict[str, Any]:
        frames = max(self.frames, 1)
        return {
            "frames": self.frames,
            "bytes": self.bytes,
            "drops": self.drops + self.queue_drops,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "reordered": self.reordered,
            "send_errors": self.send_errors,
            "queued_us_mean": round(1e6 * self.queued_s_sum / frames, 1),
            "queued_us_max": round(1e6 * self.queued_s_max, 1),
            "late_us_mean": round(1e6 * self.late_s_sum / frames, 1),
            "late_us_max": round(1e6 * self.late_s_max, 1),
            "stalls": self.stalls,
            "stalled_ms": round(1e3 * self.stalled_s, 3),
            "stall_log": [[round(start, 6), round(1e3 * s, 3)] for start, s in self.stall_log],
            "event_log": [[round(at, 6), IMPAIRED[code]] for at, code in self.event_log],
        }


class Port:
    """One veth end of the switch: its socket (the queue), rate, schedule and counters."""

    def __init__(
        self,
        name: str,
        rate_bit_s: float,
        queue_ms: float,
        spin_s: float,
        cpus: set[int] | None = None,
    ):
        self.name, self.rate_bit_s, self.queue_ms, self.spin_s = name, rate_bit_s, queue_ms, spin_s
        self.cpus = cpus  # where this port's thread runs: the CPUs of the device sending into it
        self.down_bit_s: float | None = None  # what its device receives at most (None: any)
        self.down_impairments: Impairments | None = None  # what its device receives meets
        # whether its frames may meet later hops, and the longest delay of those (the switch's)
        self.hops, self.hop_delay_s = False, 0.0
        self.sock: socket.socket | None = None
        self.free_at_s = 0.0
        self.counters = PortCounters()
        self.impairments: Impairments | None = None
        self.pending: list[tuple[float, int, bytes, float]] = []  # (send at, order, frame, queued)
        self.order = itertools.count()
        self.queue_limit = MIN_QUEUE_FRAMES
        self.queue_share = 1  # on a shared medium, the ports that take turns with this one
        self._warned_clock = False
        self.core: Any = None  # the C core that serves it, and its index there
        self.index = 0

    def open(self) -> None:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # receives nothing until bound
        try:
            sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        except OSError as error:
            log.debug("%s: PACKET_IGNORE_OUTGOING unavailable (%s)", self.name, error)
        enable_timestamps(sock)
        sock.bind((self.name, ETH_P_ALL))
        self.sock = sock
        self.set_rate(self.rate_bit_s)

    def set_rate(self, rate_bit_s: float) -> None:
        """Applies to frames scheduled from now on; resizes the queue."""
        assert self.sock is not None
        self.rate_bit_s = rate_bit_s
        if self.core is not None:
            self.core.serial_rate(self.index, rate_bit_s)
        self._size_queue()

    def set_down(self, rate_bit_s: float | None) -> None:
        """What its device receives at most (None: unshaped), from the next frame on."""
        self.down_bit_s = rate_bit_s
        if self.core is not None:
            self.core.serial_down(self.index, rate_bit_s or 0.0)

    def serve_in_core(self) -> None:
        """The C core's loop for this port, on its device's CPUs; it returns only when the
        socket fails."""
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)  # this thread only
        failed = self.core.serial_serve(self.index)
        raise OSError(-failed, f"{self.name}: the C core stopped: {os.strerror(-failed)}")

    def impair(self, parameters: dict[str, Any], seed: int) -> None:
        """netem's impairments on the frames of this port from now on, drawn from `seed`
        (none: parameters that impair nothing); resizes the queue for the delay."""
        impairments = Impairments(parameters, seed)
        self.impairments = impairments if impairments.impairing else None
        if self.core is not None:
            handle = None if self.impairments is None else core_impairments(self.core, impairments)
            self.core.serial_impair(self.index, handle)
        self._size_queue()

    def _size_queue(self) -> None:
        """The queue holds `queue_ms` at the rate, and the frames in flight during the
        longest delay the port may draw, its own and a later hop's (they wait in it while
        their delay runs)."""
        assert self.sock is not None
        delay_s = self.hop_delay_s
        if self.impairments is not None:
            delay_s += self.impairments.max_delay_s
        delay_ms = 1e3 * delay_s
        frames = queue_frames(self.rate_bit_s, self.queue_ms * self.queue_share + delay_ms)
        self.queue_limit = frames
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf_request_bytes(frames))
        log.debug("%s: rate %.0f bit/s, queue %d frames", self.name, self.rate_bit_s, frames)
        self.tell_core()

    def tell_core(self) -> None:
        """The C core's copy of how this port serves its frames (`reads_ahead`, `hops`, its
        queue), where the core serves it."""
        if self.core is not None:
            self.core.serial_mode(self.index, self.reads_ahead, self.hops, self.queue_limit)

    def transmit(self, frame: bytes) -> None:
        assert self.sock is not None
        try:
            self.sock.send(frame)
        except OSError as error:
            self.counters.send_errors += 1
            log.debug("%s: send failed: %s", self.name, error)

    def arrival_s(self, ancillary: list[tuple[int, int, bytes]]) -> float:
        now_s = time.time()
        stamp_ns = kernel_timestamp_ns(ancillary)
        stamp_s = None if stamp_ns is None else stamp_ns / 1e9
        if stamp_s is not None and abs(stamp_s - now_s) < TIMESTAMP_SANITY_S:
            return stamp_s
        if not self._warned_clock:
            log.warning(
                "%s: kernel timestamp %s unusable, timing by time.time()", self.name, stamp_s
            )
            self._warned_clock = True
        return now_s

    @property
    def reads_ahead(self) -> bool:
        """Whether frames are read as they come (one may overtake another): reordering, or
        later hops whose delays differ by receiver."""
        reorders = self.impairments is not None and self.impairments.reorder
        return bool(reorders or self.hop_delay_s)

    def serve(self, forward: Any, route: Any = None) -> None:
        """Reads, schedules, clocks out and forwards this port's frames, forever;
        `route(port, frame)` gives a frame's rate and later hops (else the port's rate, no
        hops). Frames leave in the order of their schedule (`pending`); a frame is read only
        once the one before it has left (it waits in the socket's queue, with its kernel
        timestamp), unless the port `reads_ahead`."""
        assert self.sock is not None
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)  # this thread only
        buffer = bytearray(FRAME_BUFFER_BYTES)
        view = memoryview(buffer)
        while True:
            if not self.pending:
                self._read(buffer, view, route)
                continue
            due_s = self.pending[0][0]
            if self.reads_ahead:
                wait_s = due_s - time.time()
                if wait_s > 0 and select.select([self.sock], [], [], wait_s)[0]:
                    self._read(buffer, view, route)
                    continue
            else:  # only a frame that found the line free polls: see "Waiting"
                wait_until(due_s, self.spin_s if self.pending[0][3] == 0.0 else 0.0)
            _, _, frame, queued_s = heapq.heappop(self.pending)
            late_s = time.time() - due_s
            forward(self, frame)
            self.counters.record(len(frame), queued_s, late_s, due_s)

    def _read(self, buffer: bytearray, view: memoryview, route: Any) -> None:
        """One frame from the socket, scheduled: each copy it is sent as gets its time."""
        assert self.sock is not None
        size, ancillary, _, address = self.sock.recvmsg_into([buffer], ANCILLARY_BYTES)
        if address[2] == socket.PACKET_OUTGOING:
            return
        arrival_s = self.arrival_s(ancillary)
        rate_bit_s, hops = route(self, view) if route else (self.rate_bit_s, ())
        impairments = self.impairments
        copies = UNIMPAIRED if impairments is None else impairments.frame()
        if len(copies) != 1:
            self.counters.impaired(arrival_s, lost=not copies, duplicated=len(copies) > 1)
        if len(self.pending) + len(copies) > self.queue_limit:
            self.counters.queue_drops += len(copies)  # reading ahead: this queue is ours
            return
        frame = bytes(view[:size])
        for copy in copies:
            if copy.reordered:  # a path of its own: no delay, the line's schedule untouched
                self.counters.reorder(arrival_s)
                send_s, queued_s = arrival_s + wire_time_s(size, rate_bit_s), 0.0
            else:
                ready_s = arrival_s + copy.delay_s
                start_s, send_s = departure_s(ready_s, self.free_at_s, size, rate_bit_s)
                self.free_at_s, queued_s = send_s, start_s - ready_s
            for after_s in self._hop_delays(hops, arrival_s) if hops else (0.0,):
                heapq.heappush(self.pending, (send_s + after_s, next(self.order), frame, queued_s))

    def _hop_delays(self, hops: Sequence[Impairments], arrival_s: float) -> list[float]:
        """What one copy meets after the line: the delay of each copy the later hops send of
        it (none: a hop lost it), each hop drawing for every copy the one before let through."""
        delays = [0.0]
        for hop in hops:
            with hop.lock:  # a downlink's generator is every sender's
                drawn = [(before, hop.frame()) for before in delays]
            delays = []
            for before, copies in drawn:
                if len(copies) != 1:
                    self.counters.impaired(arrival_s, lost=not copies, duplicated=len(copies) > 1)
                for copy in copies:
                    if copy.reordered:
                        self.counters.reorder(arrival_s)
                    delays.append(before + copy.delay_s)  # a reordered copy's is 0
        return delays

    def _from_core(self) -> None:
        """The C core's counters of this port, as the Python loop keeps them."""
        done, stalls = core_counters(self.core, self.index)
        counters = self.counters
        counters.frames, counters.bytes = done.frames, done.bytes
        counters.send_errors = done.send_errors
        counters.queued_s_sum, counters.queued_s_max = (
            done.queued_ns_sum / 1e9,
            done.queued_ns_max / 1e9,
        )
        counters.late_s_sum, counters.late_s_max = done.late_ns_sum / 1e9, done.late_ns_max / 1e9
        counters.stalls, counters.stalled_s = done.stalls, done.stalled_ns / 1e9
        counters.stall_log = deque(((start / 1e9, ns / 1e9) for start, ns in stalls), STALL_LOG)
        counters.lost, counters.duplicated = done.lost, done.duplicated
        counters.reordered, counters.queue_drops = done.reordered, done.queue_drops
        events = core_events(self.core, self.index)
        counters.event_log = deque(((at / 1e9, code) for at, code in events), EVENT_LOG)

    def stats(self) -> dict[str, Any]:
        """The counters (drops read from the kernel), the rate and the queue's kernel memory."""
        assert self.sock is not None
        if self.core is not None:
            self._from_core()
        _, dropped = PACKET_STATS.unpack(
            self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, PACKET_STATS.size)
        )
        self.counters.drops += dropped
        meminfo = self.sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, MEMINFO_BYTES)
        (queue_bytes,) = struct.unpack_from("=I", meminfo)
        return {
            **self.counters.as_dict(),
            "rate_bit_s": self.rate_bit_s,
            "down_bit_s": self.down_bit_s,
            "queue_bytes": queue_bytes,
        }
