"""The TCP mesh between the P workers of a session, and the threads that move messages.

- A `Mesh` (devices.mesh) connects every pair of devices once: rank i listens on its own
  address (`listen`, never every interface), connects from it to every j < i (`connect`,
  retrying while j starts, until a deadline) and accepts from every j > i, so the set-up
  cannot deadlock. TCP_NODELAY is on. Each new connection runs the handshake
  (devices.handshake) on a `devices.frames.CountingSocket` so that its bytes are counted
  apart from the payload.
- A `PeerLink` owns one connection after the handshake. A message is sent from the thread
  that posts it whenever the socket takes it without blocking (so no thread wake-up delays
  its departure); otherwise a sender thread writes it, in order. A receiver thread reads the
  peer's messages as soon as they arrive, with the kernel's receive timestamp of each
  message's last byte (devices.clock), and queues them for the compute thread, which blocks
  only when a block needs them.
- Messages carry no length prefix: the receiver reads the method's header bytes, then the
  rest of the size that the method derives from the header (docs/method.md, Wire format).
- A stamped message (the runs of `level_k: auto`, devices.level) is preceded by 12 bytes
  (`STAMP`): its departure time (ns on the sender's clock, taken when its first byte is
  offered to the kernel), so that the receiver knows each message's one-way time while the
  session runs, and the sender's latest measure of the link the other way, from that peer to
  it (`PeerLink.echo_ps_per_byte`, 0 for none yet), so that each device learns how its own
  messages travel. Stamps are counted apart from the payload (`stamp_bytes`).
"""

from __future__ import annotations

import errno
import logging
import math
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from devices.clock import ANCILLARY_BYTES, Clock, enable_rx_timestamps
from devices.errors import ConnectError, MessageError, PeerLostError

log = logging.getLogger(__name__)

RETRY_INTERVAL_S = 0.1
READY = b"R"
# a stamped message's departure time (ns, the sender's clock) and echo (ps per frame byte)
STAMP = struct.Struct("<qI")
MAX_ECHO = 2**32 - 1
# MTU 1500 and TCP timestamps (Linux's default)
TCP_MSS_BYTES = 1448  # 1500 - 20 IP - 32 TCP
TCP_FRAME_HEADER_BYTES = 66  # 14 Ethernet + 20 IP + 32 TCP


def tcp_frame_bytes(payload_bytes: int) -> int:
    """Bytes of the Ethernet frames that carry a TCP message: ceil(payload / MSS) segments,
    each with its Ethernet, IP and TCP headers (0 for no message)."""
    if payload_bytes <= 0:
        return 0
    segments = math.ceil(payload_bytes / TCP_MSS_BYTES)
    return payload_bytes + segments * TCP_FRAME_HEADER_BYTES


class MessageFormat(NamedTuple):
    """How to delimit one message on the stream."""

    header_bytes: int
    size: Callable[[bytes], int]  # the message's bytes, from its header
    stamped: bool = False  # preceded by its departure time (STAMP)


def format_address(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def remote(sock: socket.socket) -> str:
    """The address a connection comes from ("h:p"; an IPv4 peer of an IPv6 socket unmapped)."""
    try:
        peer = sock.getpeername()
    except OSError:
        peer = None
    if not isinstance(peer, tuple):  # gone, or not an IP socket (a test's socketpair)
        return "an unknown address"
    return format_address((peer[0].removeprefix("::ffff:"), peer[1]))


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' -> (host, port); raises ValueError naming the bad address."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peer address {text!r} is not host:port")
    return host.strip("[]"), int(port)


class PeerClosed(Exception):
    """The peer closed the connection; `received` bytes of the current read had arrived."""

    def __init__(self, received: int):
        super().__init__(f"connection closed after {received} bytes of a read")
        self.received = received


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes; raises PeerClosed if the peer closes first."""
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise PeerClosed(received)
        received += count
    return bytes(buffer)


class Stamped:
    """Exact reads off a socket that keep the kernel's receive timestamp of the last read.

    TCP reports the timestamp of the last segment a `recvmsg` copied from; a read that ends
    exactly at a message's end so gives the arrival of the message's last byte.
    """

    def __init__(self, sock: socket.socket, clock: Clock):
        self.sock, self.clock = sock, clock
        self.kernel_ns: int | None = None

    def read(self, size: int) -> bytes:
        """Exactly `size` bytes; raises PeerClosed if the peer closes first."""
        buffer = bytearray(size)
        view, received = memoryview(buffer), 0
        while received < size:
            count, ancillary, _, _ = self.sock.recvmsg_into([view[received:]], ANCILLARY_BYTES)
            if count == 0:
                raise PeerClosed(received)
            received += count
            self.kernel_ns = self.clock.kernel_ns(ancillary) if ancillary else None
        return bytes(buffer)


TCP_INFO_TOTAL_RETRANS = struct.Struct("=I")  # tcpi_total_retrans, after 8 bytes and 23 u32s
TCP_INFO_TOTAL_RETRANS_OFFSET = 8 + 23 * 4


def total_retransmits(sock: socket.socket) -> int | None:
    """Segments the kernel has retransmitted on this connection (TCP_INFO's
    tcpi_total_retrans); None where the kernel does not say."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return None
    if len(info) < TCP_INFO_TOTAL_RETRANS_OFFSET + TCP_INFO_TOTAL_RETRANS.size:
        return None
    return TCP_INFO_TOTAL_RETRANS.unpack_from(info, TCP_INFO_TOTAL_RETRANS_OFFSET)[0]


def configure(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listen(address: tuple[str, int]) -> socket.socket:
    """A listening socket on `address` only: the device's own address on the run's network,
    never every interface. Raises ConnectError when the address is not this host's (a spec
    that gives a device an address it does not hold, e.g. one behind NAT) or is in use."""
    host, port = address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as error:
        raise ConnectError(
            f"cannot listen on {format_address(address)}: {error.strerror or error} (a worker "
            "listens on its own address in the spec's peers, which must be an address of "
            "the device)"
        ) from None


def connect(
    address: tuple[str, int], deadline: float, what: str, source: str | None = None
) -> socket.socket:
    """Connect, retrying while the peer is not listening yet, until `deadline` (perf_counter).

    `source`: the local address to connect from (the device's own), so that the peer sees
    the connection come from the address the spec gives this device."""
    last_error = "no attempt"
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise ConnectError(
                f"{what} at {format_address(address)} did not accept a connection "
                f"in time (last error: {last_error})"
            )
        try:
            sock = socket.create_connection(
                address, timeout=remaining, source_address=source and (source, 0)
            )
            if sock.getsockname() == sock.getpeername():
                # TCP's simultaneous open: while nothing listens on a port of this host's
                # ephemeral range, a connection to it may be given that port as its own and
                # reach itself (seen in CI on loopback); not the peer, so try again
                sock.close()
                raise ConnectionRefusedError(errno.ECONNREFUSED, "connected to itself")
            return configure(sock)
        except OSError as error:
            if error.errno == errno.EADDRNOTAVAIL and source is not None:
                raise ConnectError(
                    f"cannot connect to {what} from {source}: {error.strerror} (the spec's "
                    "address of this device must be one of its addresses)"
                ) from None
            last_error = error.strerror or str(error)
            time.sleep(min(RETRY_INTERVAL_S, max(deadline - time.perf_counter(), 0)))


@dataclass
class Outgoing:
    """One message to every peer, and when each peer's copy was handed to the kernel.

    departed_ns: per peer, when the copy's first byte was offered to the kernel (the first
    `send` call for it, taken or not: a full socket buffer is the link being busy).
    written_ns: per peer, when the kernel had accepted the copy's last byte.
    """

    block: int
    message: bytes
    peers: int
    stamped: bool = False
    departed_ns: dict[int, int] = field(default_factory=dict)
    written_ns: dict[int, int] = field(default_factory=dict)
    bytes_written: dict[int, int] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def depart(self, peer: int, at_ns: int) -> None:
        self.departed_ns.setdefault(peer, at_ns)

    def finish(self, peer: int, written: int, at_ns: int, error: str | None = None) -> None:
        with self._lock:
            self.written_ns[peer] = at_ns
            self.bytes_written[peer] = written
            if error is not None:
                self.errors[peer] = error
            if len(self.written_ns) == self.peers:
                self.done.set()


@dataclass
class Incoming:
    """A peer's message: when its last byte reached this host (the kernel's receive
    timestamp, None where the kernel gives none), when the receiver thread had read it, and
    for a stamped message its departure on the sender's clock and the sender's measure of
    this device's messages to it (ps per frame byte; None: not measured yet)."""

    message: bytes
    kernel_ns: int | None
    read_ns: int
    sent_ns: int | None = None
    echo_ps_per_byte: int | None = None


@dataclass
class _Closed:
    reason: str
    at: float = field(default_factory=time.perf_counter)


class PeerLink:
    """One peer's connection: messages go out from the posting thread when the socket takes
    them at once, else from a sender thread; a receiver thread reads the peer's messages."""

    def __init__(self, peer: int, address: tuple[str, int], sock: socket.socket, clock: Clock):
        self.peer, self.address, self.sock, self.clock = peer, address, sock, clock
        self.name = f"device {peer} ({format_address(address)})"
        # (message, its bytes as sent (stamp first), bytes already written)
        self.outbox: queue.SimpleQueue[tuple[Outgoing, bytes, int] | None] = queue.SimpleQueue()
        self.inbox: queue.SimpleQueue[Incoming | _Closed] = queue.SimpleQueue()
        self.bytes_sent = self.bytes_received = 0
        self.stamp_bytes = {"sent": 0, "received": 0}
        # what this device last measured of the peer's messages to it, echoed in every stamp
        self.echo_ps_per_byte = 0
        self.messages_sent = self.messages_received = 0
        self.send_error: str | None = None
        self.closed: _Closed | None = None  # set by the receiver thread when the peer is gone
        self.trailing: str | None = None  # what the peer sent after its last message
        self.kernel_timestamps = enable_rx_timestamps(sock)
        self._backlog = 0  # messages handed to the sender thread and not yet written
        self._send_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, formats: Iterator[MessageFormat]) -> None:
        self.sock.settimeout(None)
        loops = ((self._send_loop, ()), (self._receive_loop, (formats,)))
        for target, args in loops:
            thread = threading.Thread(
                target=target, args=args, daemon=True, name=f"{target.__name__}-{self.peer}"
            )
            thread.start()
            self._threads.append(thread)

    def post(self, outgoing: Outgoing) -> None:
        """Send now, from this thread, what the socket takes without blocking (a small
        message: all of it, so no thread wake-up delays it); the sender thread writes the
        rest, and every message posted while it is busy, in order."""
        with self._send_lock:
            written, data = 0, outgoing.message
            if self._backlog == 0 and self.send_error is None:
                data = self._depart(outgoing)
                try:
                    written = self.sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    written = 0
                except OSError as error:
                    self.send_error = f"sending failed: {error.strerror or error}"
                if written == len(data) or self.send_error is not None:
                    self._written(outgoing, written)
                    return
            self._backlog += 1
            self.outbox.put((outgoing, data, written))

    def _depart(self, outgoing: Outgoing) -> bytes:
        """The bytes of the message as they go out now: its stamp (if any) says now."""
        now = self.clock.now_ns()
        outgoing.depart(self.peer, now)
        if not outgoing.stamped:
            return outgoing.message
        return STAMP.pack(now, min(self.echo_ps_per_byte, MAX_ECHO)) + outgoing.message

    def _written(self, outgoing: Outgoing, written: int) -> None:
        stamp = STAMP.size if outgoing.stamped else 0
        self.stamp_bytes["sent"] += min(written, stamp)
        self.bytes_sent += max(written - stamp, 0)
        self.messages_sent += 1
        outgoing.finish(self.peer, written, self.clock.now_ns(), self.send_error)

    def take(self, timeout_s: float, context: str) -> Incoming:
        """The peer's next message; raises PeerLostError naming the peer and `context`."""
        try:
            item = self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise PeerLostError(
                f"no message from {self.name} for {context} within {timeout_s:g} s"
            ) from None
        if isinstance(item, _Closed):
            self.inbox.put(item)  # later takes see it too
            raise self.lost(context)
        return item

    def lost(self, context: str) -> PeerLostError:
        reason = self.closed.reason if self.closed is not None else self.send_error
        return PeerLostError(f"lost {self.name} before its message for {context}: {reason}")

    def _closed(self, reason: str) -> None:
        self.closed = _Closed(reason)
        self.inbox.put(self.closed)

    def _send_loop(self) -> None:
        while (item := self.outbox.get()) is not None:
            outgoing, data, written = item
            if self.send_error is None:
                if written == 0:  # nothing of it went out yet: it departs now
                    data = self._depart(outgoing)
                view = memoryview(data)
                try:
                    while written < len(view):
                        written += self.sock.send(view[written:])
                except OSError as error:
                    self.send_error = f"sending failed: {error.strerror or error}"
            with self._send_lock:
                self._written(outgoing, written)
                self._backlog -= 1

    def _receive_loop(self, formats: Iterator[MessageFormat]) -> None:
        stamped = Stamped(self.sock, self.clock)
        for header_bytes, message_bytes, has_stamp in formats:
            header, sent_ns, echo = b"", None, None
            try:
                if has_stamp:
                    sent_ns, echo = STAMP.unpack(stamped.read(STAMP.size))
                    self.stamp_bytes["received"] += STAMP.size
                header = stamped.read(header_bytes)
                rest = stamped.read(message_bytes(header) - header_bytes)
            except PeerClosed as closed:
                received = len(header) + closed.received
                reason = (
                    "the connection was closed"
                    if received == 0
                    else (f"the connection was closed mid-message after {received} bytes")
                )
                self._closed(reason)
                return
            except OSError as error:
                self._closed(f"receiving failed: {error.strerror or error}")
                return
            except MessageError as error:
                # the header cannot be delimited (unknown level): hand it on as it is, so the
                # method's decoder names peer and block, and stop reading this stream
                self.inbox.put(Incoming(header, stamped.kernel_ns, self.clock.now_ns()))
                self._closed(f"unreadable message header: {error}")
                return
            self.bytes_received += len(header) + len(rest)
            self.messages_received += 1
            now = self.clock.now_ns()
            self.inbox.put(Incoming(header + rest, stamped.kernel_ns, now, sent_ns, echo or None))
        self._await_end(stamped)

    def _await_end(self, stamped: Stamped) -> None:
        """After the last expected message: the peer's EOF, or bytes that should not be."""
        try:
            extra = stamped.read(1)
        except PeerClosed:
            self._closed("the connection was closed")
        except OSError as error:
            self._closed(f"receiving failed: {error.strerror or error}")
        else:
            self.trailing = f"sent data after its last message ({extra!r}...)"
            self._closed(self.trailing)

    def finish_sending(self, timeout_s: float) -> None:
        """Let the sender write what is queued, then half-close: the peer reads an EOF."""
        self.outbox.put(None)
        if self._threads:
            self._threads[0].join(timeout_s)
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def wait_closed(self, timeout_s: float) -> None:
        """Wait until the receiver has seen the peer's EOF (or failed)."""
        if len(self._threads) > 1:
            self._threads[1].join(max(timeout_s, 0))

    def close(self) -> None:
        """Close at once: blocked sender and receiver threads wake up with an error."""
        self.outbox.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
