"""A userspace serial link: a switch that clocks every frame out at its port's rate.

A token bucket (tbf) lets a frame through at once while its bucket holds tokens, so after an
idle gap a 200-byte message crosses a 1 Mbit/s link in 0.05 ms, where its wire time is 2.1 ms.
A serial line clocks every bit out at the rate, and this kernel has no netem. This program
(stdlib only) runs as root in a "switch" network namespace that holds one veth end, a *port*,
per device; `testbed.link.serial.switch` builds the namespace and starts it.

A port knows its rate, when its line is free again, its impairments (netem's: delay, jitter,
loss, duplication, reordering; `testbed.link.serial.impairments`) and its counters; the
switch knows which source MAC was seen on which port. No FCS, preamble or inter-frame gap.

Decisions:

- A port's rate applies to the frames its device sends (its uplink), as tbf on the device's
  egress does; a clocked-out frame goes to the destination port at once. A port may also have
  a downlink rate, and a pair of ports a rate of its own: a frame is then clocked out once, at
  the least of its sender's uplink, its receiver's downlink and its pair's rate (one serial
  line between the two; the receiver's port learned from earlier frames). A downlink is thus
  not shared between senders: two devices sending to one at once each get its downlink rate
  (the tbf emulator's ifb does share it). Broadcasts and frames to unlearned ports take the
  uplink rate. Frames are counted as
  AF_PACKET reads them, Ethernet header included, no FCS: the bytes tbf counts.
- Schedule (`testbed.link.wire.departure_s`): start = max(kernel arrival time, scheduled
  end of the port's previous frame), end = start + wire time; the frame is sent at `end`.
  Arrivals are the kernel's receive timestamps (SO_TIMESTAMPNS_NEW, else SO_TIMESTAMPNS), and
  the previous end is the *scheduled* one, so this program's time per frame never adds up:
  bulk runs at the rate however late single frames leave (after a stall, frames leave back to
  back until on schedule). A timestamp missing or more than `TIMESTAMP_SANITY_S` from
  `time.time()` (both CLOCK_REALTIME) is replaced by `time.time()`, with one warning.
- Stalls: a frame that leaves more than `STALL_S` late was held up by the machine (a VM's
  vCPU held by its host, kernel work), not by a wake-up; SCHED_FIFO cannot prevent those.
  The counters keep the stalls, their length and when each began (`stalls`, `stalled_ms`,
  `stall_log`: [start s, ms] by time.time(), the last STALL_LOG of them): under load here,
  about one 5 ms stall per CPU every few seconds, once 12.6 ms. A TCP flow keeps only a
  millisecond or two of frames queued, so its link loses about a stall's length each time.
- Waiting (`wait_until`): sleep, then, with `--spin-us` (off by default), poll the last
  `spin_us` of the wait (at most `SPIN_SHARE` of it), yielding the GIL between polls, for a
  frame that found its line free (the first of a message, which pays the wake-up an idle
  vCPU takes, 40-70 us here); frames queued behind others only sleep. Polling is off because
  the polled microseconds are taken from the device whose CPUs the port's thread runs on,
  and the devices' compute is what the testbed measures. Measured on 2026-12-01 (ViT-B/16,
  2 devices, 3 runs each way, interleaved), 60 us: on the docker backend the path cost per
  small message beyond its wire time fell from 0.13 to 0.07-0.11 ms at 1 Mbit/s and from
  0.08-0.14 to 0.07-0.10 at 5, rose from 0.08-0.12 to 0.10-0.17 at 20, and compute rose 3-5%
  at 1 and 5 Mbit/s (195 to 201-205 ms); on the local backend compute did not move; on
  vit-tiny it rose 3-5% at 20 Mbit/s. An earlier rule, 150 us for every frame, raised
  vit-tiny's compute from 4.7-5.2 to 5.8-6.3 ms. A plain sleep wakes a median 5-16 us late
  after waits under 1 ms, 40-70 us after 2-12 ms idle.
- Queue: frames wait, with their timestamps, in the packet socket's receive buffer while the
  port's thread sleeps. Its size (`wire.queue_frames`) is tbf's, 50 ms at the rate
  plus two frames, but at least `MIN_QUEUE_FRAMES` so that TCP's initial window fits; times
  `TRUESIZE_BYTES`, the kernel memory a queued full frame costs (measured: 2280 B for a TCP
  segment), it is set by SO_RCVBUFFORCE and resized with the rate. Frames the kernel drops
  when it is full are the queue's drops (PACKET_STATISTICS); unlike tbf's, TCP sees them as
  losses (see `testbed.link.serial.switch` for the tbf in front that avoids them).
- Frames this program sends do not loop back to its sockets (PACKET_IGNORE_OUTGOING; where it
  is missing, PACKET_OUTGOING frames are skipped).
- Later hops (`testbed.link.paths`): a frame for a learned receiver then meets the pair's
  impairments and the receiver's downlink's, each drawn on its own (`impair-pair`,
  `impair-down`; the downlink's generator, which every sender draws from, under a lock).
  Their delays come after the line: the frame is clocked out at its rate as before, then
  sent that much later, so a frame for a far receiver does not hold up the next frame for a
  near one (the port reads ahead, as with reordering). A hop's loss drops the frame after
  its line time, a hop's duplicate leaves twice without more line time, and a hop's reorder
  skips that hop's delay.
- Forwarding: source MAC -> port is learned; broadcast, multicast and unknown destinations are
  flooded to every other port; a frame for the port it came from is dropped.
- Core (`--core`): the per-frame loop of a switch that draws no impairments runs in C
  (`core.c`, built with the machine's gcc on first use: `testbed.link.serial.core`), one
  thread per port with the interpreter's lock released, the same schedule and counters; the
  Python loop below runs where impairments are drawn (`--core python`) or where the C core
  cannot be built (`auto`, the default, says so in a warning). A C switch refuses an
  `impair` that impairs anything. Measured with make bench: see docs/benchmarks.md.
- SCHED_FIFO when permitted (else a warning) and a 50 us GIL switch interval, so that one
  port's thread does not hold up another's frame.

Protocol: `python -m testbed.link.serial.program serve PORT=RATE_BIT_S ...` prints `ready` once
every port is open, then answers one line on stdout per command line on stdin: `rate PORT BIT_S` ->
`ok`; `down PORT BIT_S` (0: unshaped) -> `ok`; `pair SRC DST BIT_S` (0: none) -> `ok`;
`impair PORT SEED JSON` (netem's parameters, `testbed.experiment.impairments`), `impair-down
PORT SEED JSON`, `impair-pair SRC DST SEED JSON` -> `ok`;
`stats` -> JSON {port: `Port.stats()`}; anything else -> `error <why>`. EOF ends it.
`testbed.link.serial.protocol` parses the command line and the commands.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from devices.clock import ANCILLARY_BYTES, enable_rx_timestamps, kernel_timestamp_ns
from testbed.errors import ShapingError
from testbed.experiment.impairments import impaired
from testbed.link.serial.core import counters as core_counters
from testbed.link.serial.core import load as load_core
from testbed.link.serial.impairments import Copy, Impairments
from testbed.link.serial.protocol import parse_command, parse_port, parse_port_cpus
from testbed.link.wire import (
    MIN_QUEUE_FRAMES,
    QUEUE_MS,
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
SWITCH_INTERVAL_S = 50e-6
FIFO_PRIORITY = 10  # above every normal task, below the kernel's threaded interrupts (50)
TIMESTAMP_SANITY_S = 60.0
UNIMPAIRED = (Copy(0.0),)  # a frame sent once, without delay


# The program ---------------------------------------------------------------------------------


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
        frames = queue_frames(self.rate_bit_s, self.queue_ms + delay_ms)
        self.queue_limit = frames
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf_request_bytes(frames))
        log.debug("%s: rate %.0f bit/s, queue %d frames", self.name, self.rate_bit_s, frames)

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


class Switch:
    """The ports and the learned MAC table; forwards clocked-out frames."""

    def __init__(self, ports: Sequence[Port], core: Any = None):
        self.ports = {port.name: port for port in ports}
        self.core = core  # the C core (testbed.link.serial.core), else the Python loop
        self.learned: dict[bytes, Port] = {}
        self.pair_bit_s: dict[tuple[str, str], float] = {}  # (sending, receiving port)
        self.pair_impairments: dict[tuple[str, str], Impairments] = {}

    def route(self, ingress: Port, frame: Any) -> tuple[float, tuple[Impairments, ...]]:
        """A frame's rate, the least of the sender's uplink, the receiver's downlink and their
        pair's, and the later hops it meets, the pair's then the downlink's; the uplink alone
        for a broadcast or a receiver not learned yet."""
        destination = bytes(frame[:6])
        egress = None if destination[0] & 1 else self.learned.get(destination)
        if egress is None:
            return ingress.rate_bit_s, ()
        key = (ingress.name, egress.name)
        rate_bit_s = ingress.rate_bit_s
        if egress.down_bit_s is not None or self.pair_bit_s:
            limits = (rate_bit_s, egress.down_bit_s, self.pair_bit_s.get(key))
            rate_bit_s = min(limit for limit in limits if limit is not None)
        if not ingress.hops:
            return rate_bit_s, ()
        hops = (self.pair_impairments.get(key), egress.down_impairments)
        return rate_bit_s, tuple(hop for hop in hops if hop is not None)

    def impair_hop(self, command: Any) -> None:
        """A downlink's or a pair's impairments (none: parameters that impair nothing), then
        every port's longest later hop, for its queue and its reading ahead."""
        impairments = Impairments(command.parameters, command.seed)
        hop = impairments if impairments.impairing else None
        if command.name == "impair-down":
            self.ports[command.port].down_impairments = hop
        elif hop is None:
            self.pair_impairments.pop((command.port, command.target), None)
        else:
            self.pair_impairments[(command.port, command.target)] = hop
        for port in self.ports.values():
            downs = [p.down_impairments for p in self.ports.values() if p is not port]
            pairs = [i for (source, _), i in self.pair_impairments.items() if source == port.name]
            longest = max((d.max_delay_s for d in downs if d is not None), default=0.0)
            hop_delay_s = longest + max((i.max_delay_s for i in pairs), default=0.0)
            port.hops = bool(pairs) or any(d is not None for d in downs)
            if hop_delay_s != port.hop_delay_s:
                port.hop_delay_s = hop_delay_s
                port._size_queue()

    def forward(self, ingress: Port, frame: bytes) -> None:
        destination, source = frame[:6], frame[6:12]
        if self.learned.get(source) is not ingress:
            self.learned[source] = ingress
            log.debug("learned %s on %s", source.hex(":"), ingress.name)
        egress = None if destination[0] & 1 else self.learned.get(destination)
        if egress is ingress:
            return
        for port in [egress] if egress else self.ports.values():
            if port is not ingress:
                port.transmit(frame)

    def start(self) -> None:
        for port in self.ports.values():
            port.open()
        if self.core is not None:
            self.core.serial_init(len(self.ports))
            for index, port in enumerate(self.ports.values()):
                assert port.sock is not None
                port.core, port.index = self.core, index
                self.core.serial_port(index, port.sock.fileno(), port.rate_bit_s)
        for port in self.ports.values():
            threading.Thread(target=self._serve, args=(port,), name=port.name, daemon=True).start()

    def _serve(self, port: Port) -> None:
        try:
            if self.core is not None:
                port.serve_in_core()
            port.serve(self.forward, self.route)
        except BaseException:
            log.exception("port %s failed; the serial link stops", port.name)
            sys.stderr.flush()
            os._exit(3)  # a switch with a dead port must not look alive

    def execute(self, line: str) -> str:
        """Runs one stdin command; returns the answer line."""
        try:
            command = parse_command(line, self.ports)
        except ShapingError as error:
            return f"error {error}"
        if command.name == "stats":
            return json.dumps({name: port.stats() for name, port in self.ports.items()})
        assert command.port is not None
        if command.name.startswith("impair"):
            assert command.parameters is not None and command.seed is not None
            if self.core is not None and impaired(command.parameters):
                return (
                    f"error {command.name} {command.port}: this switch runs the C core, which "
                    "draws no impairments (start it with --core python)"
                )
            try:
                if command.name == "impair":
                    self.ports[command.port].impair(command.parameters, command.seed)
                else:
                    self.impair_hop(command)
            except (OSError, ValueError) as error:  # a table missing, resizing the queue
                return f"error {command.name} {command.port}: {error}"
            return "ok"
        if command.name == "down":
            self.ports[command.port].set_down(command.rate_bit_s)
            return "ok"
        if command.name == "pair":
            assert command.target is not None
            key = (command.port, command.target)
            if command.rate_bit_s is None:
                self.pair_bit_s.pop(key, None)
            else:
                self.pair_bit_s[key] = command.rate_bit_s
            if self.core is not None:
                names = list(self.ports)
                rate = command.rate_bit_s or 0.0
                self.core.serial_pair(names.index(command.port), names.index(command.target), rate)
            return "ok"
        assert command.rate_bit_s is not None
        try:
            self.ports[command.port].set_rate(command.rate_bit_s)
        except OSError as error:
            return f"error rate {command.port}: resizing the queue failed: {error}"
        return "ok"


def use_realtime_scheduling(priority: int = FIFO_PRIORITY) -> bool:
    """SCHED_FIFO for this thread and the threads it starts; a warning when not permitted."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError) as error:
        log.warning("no SCHED_FIFO (%s): frames may leave late when the CPUs are busy", error)
        return False
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.link.serial.program", description=__doc__
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the switch on the given ports")
    serve.add_argument("ports", nargs="+", metavar="PORT=RATE_BIT_S")
    serve.add_argument("--spin-us", type=float, default=DEFAULT_SPIN_US)
    serve.add_argument(
        "--core",
        choices=("auto", "c", "python"),
        default="auto",
        help="the per-frame loop: C (no impairments), Python, or C where it builds",
    )
    serve.add_argument("--queue-ms", type=float, default=QUEUE_MS)
    serve.add_argument(
        "--cpus",
        action="append",
        default=[],
        metavar="PORT=CPULIST",
        help="run the port's thread on these CPUs (those of the device that sends into it)",
    )
    serve.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG")
    args = parser.parse_args(argv)
    try:
        args.ports = [parse_port(text) for text in args.ports]
    except ShapingError as error:
        parser.error(str(error))
    names = [name for name, _ in args.ports]
    if len(set(names)) != len(names):
        parser.error(f"a port is given twice: {names}")
    if args.spin_us < 0 or args.queue_ms <= 0:
        parser.error("--spin-us must be >= 0 and --queue-ms > 0")
    try:
        args.cpus = dict(parse_port_cpus(text, names) for text in args.cpus)
    except ShapingError as error:
        parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="serial_link %(levelname)s: %(message)s",
    )
    use_realtime_scheduling()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    ports = [
        Port(name, rate, args.queue_ms, args.spin_us / 1e6, args.cpus.get(name))
        for name, rate in args.ports
    ]
    library = None
    if args.core != "python":
        library = load_core()
        if library is None and args.core == "c":
            log.error("--core c: the C core cannot be built or loaded")
            return 1
    if library is not None and args.spin_us:
        log.warning("--spin-us is the Python loop's: the C core does not poll")
    switch = Switch(ports, library)
    try:
        switch.start()
    except (OSError, ShapingError) as error:
        log.error("cannot open the ports %s: %s", [port.name for port in ports], error)
        return 1
    print("ready", flush=True)
    for line in iter(sys.stdin.readline, ""):
        if line.strip():
            print(switch.execute(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
