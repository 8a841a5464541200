"""The session handshake, once per connection, and the clock ping-pong.

Both sides send a `hello` (length-prefixed JSON: this is set-up, not payload), compare it
with their own and send a verdict, so a mismatch ends the session on both sides with the
same kind of error: "device 1 has bundle fingerprint ab12.., device 0 has cd34..". Then the
side that connected runs CLOCK_ROUNDS ping-pongs: it sends one byte, the other answers with
its clock (devices.clock: CLOCK_REALTIME in ns, the clock of every record and of the kernel's
receive timestamps). With t0 / t3 the local send / receive times and t_peer the answer, the
round with the smallest round trip gives offset = t_peer - (t0 + t3) / 2 (the peer's clock
minus ours) within +- half that round trip. On one host the offset is ~0 (one kernel clock);
across machines it aligns the devices' records.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from devices.clock import Clock
from devices.errors import ProtocolError
from devices.transport import CountingSocket

PROTOCOL_VERSION = 2
CLOCK_ROUNDS = 8
PING = b"p"
CLOCK = struct.Struct("!q")  # ns

# hello fields every device of a session must agree on, with the words used in errors
AGREED_FIELDS = {
    "protocol": "protocol version",
    "devices": "device count",
    "runs": "runs (method, parameters, bundle fingerprint, inferences)",
    "partition": "partition sizes",
    "batch": "batch size",
    "model": "model",
    "model_fingerprint": "model fingerprint",
    "warmup": "warm-up count",
    "inputs": "inputs",
}


def make_hello(rank: int, **fields: Any) -> dict[str, Any]:
    """This device's hello: its rank and every field of AGREED_FIELDS."""
    missing = set(AGREED_FIELDS) - set(fields) - {"protocol"}
    assert not missing, f"hello lacks {missing}"
    return {"protocol": PROTOCOL_VERSION, "rank": rank, **fields}


@dataclass
class PeerHandshake:
    """What the handshake with one peer established."""

    peer: int
    hello: dict[str, Any]
    clock_offset_ns: int = 0  # the peer's clock minus ours
    clock_uncertainty_ns: int = 0  # half the smallest round trip
    round_trips_ns: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "peer": self.peer,
            "hello": self.hello,
            "clock_offset_ns": self.clock_offset_ns,
            "clock_uncertainty_ns": self.clock_uncertainty_ns,
            "round_trips_ns": self.round_trips_ns,
        }


def disagreement(
    mine: dict[str, Any], theirs: dict[str, Any], expected: set[int], name: str
) -> str | None:
    """The first reason the two hellos cannot share a session, or None."""
    rank, peer = mine["rank"], theirs.get("rank")
    if theirs.get("protocol") != mine["protocol"]:
        return (
            f"{name} speaks protocol version {theirs.get('protocol')}, device {rank} "
            f"speaks {mine['protocol']}"
        )
    if peer not in expected:
        wanted = " or ".join(str(r) for r in sorted(expected))
        return f"{name} says it is device {peer}, expected device {wanted}"
    for key, words in AGREED_FIELDS.items():
        if theirs.get(key) != mine.get(key):
            return f"device {peer} has {words} {theirs.get(key)}, device {rank} has {mine.get(key)}"
    return None


def shake(
    conn: CountingSocket,
    mine: dict[str, Any],
    expected: set[int],
    connected: bool,
    names: list[str],
    clock: Clock,
) -> PeerHandshake:
    """Run the handshake on a fresh connection; raises ProtocolError on any mismatch.

    Args:
        conn: the connection, with a timeout set.
        mine: this device's hello (`make_hello`).
        expected: the ranks this connection may come from.
        connected: True on the side that connected (it drives the clock ping-pong).
        names: how to name each rank in messages ("device 1 (host:port)").
        clock: this device's clock, for the ping-pong.
    """
    conn.send_frame(mine)
    theirs = conn.recv_frame()
    peer = theirs.get("rank")
    name = names[peer] if isinstance(peer, int) and 0 <= peer < len(names) else "a device"
    problem = disagreement(mine, theirs, expected, name)
    conn.send_frame({"ok": problem is None, "error": problem})
    verdict = conn.recv_frame()
    if problem is not None:
        raise ProtocolError(f"handshake with {name}: {problem}")
    if not verdict.get("ok"):
        raise ProtocolError(f"{name} refused the handshake: {verdict.get('error')}")
    result = PeerHandshake(peer, theirs)
    if connected:
        measure_clock(conn, result, clock)
    else:
        answer_clock(conn, result, clock)
    return result


def measure_clock(conn: CountingSocket, result: PeerHandshake, clock: Clock) -> None:
    best_rtt, best_offset = None, 0
    for _ in range(CLOCK_ROUNDS):
        t0 = clock.now_ns()
        conn.send(PING)
        (peer_clock,) = CLOCK.unpack(conn.recv_exact(CLOCK.size))
        t3 = clock.now_ns()
        result.round_trips_ns.append(t3 - t0)
        if best_rtt is None or t3 - t0 < best_rtt:
            best_rtt, best_offset = t3 - t0, peer_clock - (t0 + t3) // 2
    result.clock_offset_ns, result.clock_uncertainty_ns = best_offset, best_rtt // 2
    conn.send_frame(
        {
            "offset_ns": -best_offset,
            "uncertainty_ns": best_rtt // 2,
            "round_trips_ns": result.round_trips_ns,
        }
    )


def answer_clock(conn: CountingSocket, result: PeerHandshake, clock: Clock) -> None:
    for _ in range(CLOCK_ROUNDS):
        if conn.recv_exact(len(PING)) != PING:
            raise ProtocolError(f"device {result.peer}: clock ping-pong out of step")
        conn.send(CLOCK.pack(clock.now_ns()))
    estimate = conn.recv_frame()
    try:
        result.clock_offset_ns = int(estimate["offset_ns"])
        result.clock_uncertainty_ns = int(estimate["uncertainty_ns"])
        result.round_trips_ns = [int(t) for t in estimate["round_trips_ns"]]
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"device {result.peer}: malformed clock estimate") from None
