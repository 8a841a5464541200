"""The full TCP mesh of one device: set-up without deadlock, a start barrier, shutdown.

Rank i listens on its own address and port (the spec's, never every interface), connects to
every j < i from that address (retrying until the deadline while j starts) and accepts every
j > i. Connects only go downwards in rank, so no two devices wait
on each other. Each new connection runs the handshake given to `open`, whose bytes are
counted apart from the payload, as are the barrier's.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from devices.clock import Clock
from devices.errors import ConnectError, PeerLostError, ProtocolError
from devices.frames import CountingSocket
from devices.transport import (
    READY,
    MessageFormat,
    Outgoing,
    PeerClosed,
    PeerLink,
    configure,
    connect,
    format_address,
    listen,
    recv_exact,
    remote,
)

log = logging.getLogger(__name__)


class HandshakeResult(Protocol):
    peer: int


# (connection, ranks this connection may come from, True when we connected) -> result
Handshake = Callable[[CountingSocket, set[int], bool], HandshakeResult]


class Mesh:
    """The P - 1 peer links of device `rank`; use as a context manager."""

    def __init__(self, rank: int, addresses: list[tuple[str, int]], clock: Clock):
        self.rank, self.addresses, self.clock = rank, addresses, clock
        self.links: dict[int, PeerLink] = {}
        self.handshakes: dict[int, HandshakeResult] = {}
        self.handshake_bytes = {"sent": 0, "received": 0}
        self.control_bytes = {"sent": 0, "received": 0}
        self._listener: socket.socket | None = None
        self._pending: list[socket.socket] = []

    def name(self, peer: int) -> str:
        return f"device {peer} ({format_address(self.addresses[peer])})"

    def open(self, timeout_s: float, handshake: Handshake) -> None:
        """Connect to every peer and run `handshake` on each connection, within `timeout_s`."""
        deadline = time.perf_counter() + timeout_s
        devices = len(self.addresses)
        if self.rank < devices - 1:
            self._listener = listen(self.addresses[self.rank])
        own_host = self.addresses[self.rank][0]
        for peer in range(self.rank):
            log.debug("connecting to %s", self.name(peer))
            sock = connect(self.addresses[peer], deadline, self.name(peer), source=own_host)
            self._register(sock, handshake, {peer}, True, deadline)
        waiting = set(range(self.rank + 1, devices))
        while waiting:
            remaining = deadline - time.perf_counter()
            try:
                if remaining <= 0:
                    raise TimeoutError
                self._listener.settimeout(remaining)
                sock, _ = self._listener.accept()
            except TimeoutError:
                names = ", ".join(self.name(peer) for peer in sorted(waiting))
                raise ConnectError(f"{names} did not connect within {timeout_s:g} s") from None
            peer = self._register(configure(sock), handshake, waiting, False, deadline)
            waiting.discard(peer)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _register(
        self,
        sock: socket.socket,
        handshake: Handshake,
        expected: set[int],
        connected: bool,
        deadline: float,
    ) -> int:
        self._pending.append(sock)
        sock.settimeout(max(deadline - time.perf_counter(), 0.001))
        counting = CountingSocket(sock, deadline)
        who = self.name(min(expected)) if connected else f"a device connecting from {remote(sock)}"
        try:
            result = handshake(counting, expected, connected)
        except TimeoutError:
            raise ConnectError(f"handshake with {who} did not finish in time") from None
        except PeerClosed:
            raise ConnectError(f"{who} closed the connection during the handshake") from None
        except OSError as error:
            raise ConnectError(f"handshake with {who} failed: {error.strerror or error}") from None
        finally:
            self.handshake_bytes["sent"] += counting.bytes_sent
            self.handshake_bytes["received"] += counting.bytes_received
        self._pending.remove(sock)
        self.links[result.peer] = PeerLink(
            result.peer, self.addresses[result.peer], sock, self.clock
        )
        self.handshakes[result.peer] = result
        log.debug("connected to %s", self.name(result.peer))
        return result.peer

    def barrier(self, timeout_s: float) -> None:
        """Every device has finished its set-up: one byte each way on every link."""
        for peer, link in self.links.items():
            link.sock.settimeout(timeout_s)
            try:
                link.sock.sendall(READY)
            except OSError as error:  # a reset right after the handshake
                raise PeerLostError(
                    f"lost {self.name(peer)} before the session started (sending the start "
                    f"signal failed: {error.strerror or error})"
                ) from None
            self.control_bytes["sent"] += len(READY)
        for peer, link in self.links.items():
            try:
                answer = recv_exact(link.sock, len(READY))
            except (PeerClosed, OSError) as error:
                reason = "timed out" if isinstance(error, TimeoutError) else "connection closed"
                raise PeerLostError(
                    f"lost {self.name(peer)} before the session started ({reason})"
                ) from None
            self.control_bytes["received"] += len(answer)
            if answer != READY:
                raise ProtocolError(
                    f"{self.name(peer)} sent {answer!r} instead of the start "
                    "signal: the peers are out of step"
                )

    def start(self, formats: Callable[[int], Iterator[MessageFormat]]) -> None:
        """Start every link's threads; `formats(peer)` yields the format of each message the
        peer will send, in order."""
        for peer, link in self.links.items():
            link.start(formats(peer))

    def post(self, outgoing: Outgoing) -> None:
        for link in self.links.values():
            link.post(outgoing)

    def close(self, graceful: bool, linger_s: float = 5.0) -> None:
        """Graceful: flush and half-close every link, wait for the peers' EOFs, then close;
        raises ProtocolError for a peer that sent more than its last message (a peer that
        sent every message twice has had its copies taken for the next blocks' messages:
        only the stream's end shows it)."""
        trailing = []
        if graceful:
            deadline = time.perf_counter() + linger_s
            for link in self.links.values():
                link.finish_sending(max(deadline - time.perf_counter(), 0))
            for link in self.links.values():
                link.wait_closed(deadline - time.perf_counter())
            trailing = [link for link in self.links.values() if link.trailing is not None]
        for link in self.links.values():
            link.close()
        for sock in self._pending:
            sock.close()
        if self._listener is not None:
            self._listener.close()
        if trailing:
            link = trailing[0]
            raise ProtocolError(f"{link.name} {link.trailing}: the peers are out of step")

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, kind: type | None, *_: object) -> None:
        self.close(graceful=kind is None)
