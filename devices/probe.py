"""`python -m devices.probe`: achieved bulk TCP throughput between two hosts.

    python -m devices.probe serve --host ADDR --port 5201 [--once]
    python -m devices.probe send --to ADDR:5201 (--seconds 2 | --bytes 10000000)

The receiver listens on ADDR only (the device's own address on the run's network), never on
every interface.

The sender writes zeros for a bounded time or byte count, then half-closes. The receiver
times the stream from the chunk that completes its first tenth to the last chunk, so the
figure is the rate the link delivered in steady state (a shaper's burst and TCP's slow start
fall in the first tenth), not how fast the sender filled its kernel buffer; it replies with
that measurement on the same connection and the sender prints it. Each side prints one JSON
line; `mbit_per_s` is in 10^6 bit/s (tc's `mbit`). On an error: one line `probe: message` on
stderr and exit status 1.

`receive_timed` is the one bulk receiver timed after its first tenth: the benchmarks and tests
of the serial link time their transfers with it too, by the kernel's receive timestamps.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

from devices.clock import ANCILLARY_BYTES, kernel_timestamp_ns
from devices.errors import WorkerError
from devices.transport import (
    PeerClosed,
    configure,
    connect,
    format_address,
    listen,
    parse_address,
    recv_exact,
)

LENGTH = struct.Struct("!Q")  # the sender's byte count, ahead of the stream

CHUNK_BYTES = 1 << 16
SKIPPED_FRACTION = 0.1  # of the expected bytes; the steady-state clock starts after them
IDLE_TIMEOUT_S = 30.0


class ProbeError(Exception):
    """The probe could not measure (no peer, connection lost, bad reply)."""


def rate_mbit(byte_count: int, seconds: float) -> float:
    return 8 * byte_count / seconds / 1e6 if seconds > 0 else 0.0


@dataclass(frozen=True)
class BulkTiming:
    """A bulk transfer as its receiver timed it: every byte it read, and the steady part,
    from the chunk that completed the skipped bytes to the last chunk."""

    total_bytes: int
    steady_bytes: int
    steady_s: float

    @property
    def mbit_per_s(self) -> float:
        return rate_mbit(self.steady_bytes, self.steady_s)


def receive_timed(
    sock: socket.socket, skip_bytes: float | None = None, kernel_stamps: bool = False
) -> BulkTiming:
    """Read `sock` until EOF and time what came after its first `skip_bytes` (None: after a
    tenth of all that came), so that a shaper's burst and TCP's slow start stay out.

    A chunk's time is when it was read, or with `kernel_stamps` the kernel's receive
    timestamp of its last segment (the caller turned SO_TIMESTAMPNS on), which a receiver
    the scheduler delays does not move. The probe times reads: a downlink shaped by an ifb
    is stamped before the ifb's queue, and its rate read 16% fast by the stamps.
    """
    buffer, ancillary_bytes = bytearray(CHUNK_BYTES), ANCILLARY_BYTES if kernel_stamps else 0
    total, samples = 0, []  # per chunk: when it came (s), the bytes so far
    while True:
        count, ancillary, _, _ = sock.recvmsg_into([buffer], ancillary_bytes)
        if count <= 0:
            break
        came_s = _kernel_s(ancillary) if kernel_stamps else time.perf_counter()
        total += count
        samples.append((came_s, total))
    skip = total / 10 if skip_bytes is None else skip_bytes
    warm = next((sample for sample in samples if sample[1] >= skip), None)
    if warm is None:  # nothing came, or less than the skipped bytes
        return BulkTiming(total, 0, 0.0)
    end = samples[-1]
    return BulkTiming(total, end[1] - warm[1], end[0] - warm[0])


def _kernel_s(ancillary: list[tuple[int, int, bytes]]) -> float:
    stamp_ns = kernel_timestamp_ns(ancillary)
    if stamp_ns is None:
        raise ProbeError("a chunk came without its kernel receive timestamp (SO_TIMESTAMPNS)")
    return stamp_ns / 1e9


def receive_all(sock: socket.socket) -> dict[str, Any]:
    """Read until EOF; the receiver's measurement.

    The sender announces its byte count in the first 8 bytes (0: unknown, timed sends); the
    rate counts the bytes after the chunk that completes the first SKIPPED_FRACTION of them
    (after the first chunk when the count is unknown).
    """
    try:
        (expected,) = LENGTH.unpack(recv_exact(sock, LENGTH.size))
    except PeerClosed:
        raise ProbeError("the sender closed the connection before its first bytes") from None
    timing = receive_timed(sock, skip_bytes=max(1, int(SKIPPED_FRACTION * expected)))
    return {
        "bytes": timing.total_bytes,
        "seconds": timing.steady_s,
        "mbit_per_s": timing.mbit_per_s,
    }


def serve(
    address: tuple[str, int], once: bool, timeout_s: float | None = None
) -> dict[str, Any] | None:
    """Measure every sender that connects to `address` (one line each); with `once`, only
    the first."""
    with listen(address) as server:
        server.settimeout(timeout_s)
        while True:
            try:
                sock, peer = server.accept()
            except TimeoutError:
                raise ProbeError(f"no sender connected within {timeout_s:g} s") from None
            with configure(sock):
                sock.settimeout(IDLE_TIMEOUT_S)
                result = receive_all(sock)
                sock.sendall(json.dumps(result).encode() + b"\n")
            host = peer[0].removeprefix("::ffff:")  # an IPv4 peer on the dual-stack socket
            print(json.dumps({**result, "from": format_address((host, peer[1]))}), flush=True)
            if once:
                return result


def send(
    address: tuple[str, int],
    seconds: float | None,
    byte_count: int | None,
    connect_timeout_s: float = 10.0,
    at_s: float | None = None,
) -> dict[str, Any]:
    """Send for `seconds` or `byte_count` bytes, from `at_s` (time.time()) where given, so
    that senders on several devices start together; returns the receiver's measurement."""
    deadline = time.perf_counter() + connect_timeout_s
    sock = connect(address, deadline, "the probe receiver")
    chunk = bytes(CHUNK_BYTES)
    if at_s is not None:
        time.sleep(max(0.0, at_s - time.time()))
    with sock:
        sock.settimeout(IDLE_TIMEOUT_S + (seconds or 0))
        sock.sendall(LENGTH.pack(byte_count or 0))
        began, sent = time.perf_counter(), 0
        while True:
            elapsed = time.perf_counter() - began
            if (seconds is not None and elapsed >= seconds) or (
                byte_count is not None and sent >= byte_count
            ):
                break
            size = CHUNK_BYTES if byte_count is None else min(CHUNK_BYTES, byte_count - sent)
            sock.sendall(chunk[:size])
            sent += size
        sender_seconds = time.perf_counter() - began
        sock.shutdown(socket.SHUT_WR)
        reply = sock.makefile("rb").readline()
    try:
        result = json.loads(reply)
    except json.JSONDecodeError:
        raise ProbeError(
            f"the receiver at {format_address(address)} sent no measurement ({reply[:40]!r})"
        ) from None
    return {
        **result,
        "sender_bytes": sent,
        "sender_seconds": sender_seconds,
        "sender_mbit_per_s": rate_mbit(sent, sender_seconds),
        "to": format_address(address),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devices.probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    server = commands.add_parser("serve", help="receive and measure")
    server.add_argument("--host", required=True, help="listen on this address only")
    server.add_argument("--port", type=int, required=True)
    server.add_argument("--once", action="store_true", help="exit after one sender")
    server.add_argument("--timeout-s", type=float, help="give up if no sender connects")
    sender = commands.add_parser("send", help="send to a serving probe, print its figure")
    sender.add_argument("--to", required=True, metavar="HOST:PORT")
    amount = sender.add_mutually_exclusive_group(required=True)
    amount.add_argument("--seconds", type=float)
    amount.add_argument("--bytes", type=int)
    sender.add_argument("--connect-timeout-s", type=float, default=10.0)
    sender.add_argument("--at", type=float, metavar="EPOCH_S", help="start sending then")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "serve":
            serve((args.host, args.port), args.once, args.timeout_s)
        else:
            if (args.seconds or 0) < 0 or (args.bytes is not None and args.bytes <= 0):
                raise ProbeError("--seconds must be >= 0 and --bytes > 0")
            address = parse_address(args.to)
            result = send(address, args.seconds, args.bytes, args.connect_timeout_s, args.at)
            print(json.dumps(result), flush=True)
    except KeyboardInterrupt:
        return 130
    except (ProbeError, WorkerError, OSError, ValueError) as error:
        message = getattr(error, "strerror", None) or str(error)
        print(f"probe: {' '.join(str(message).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
