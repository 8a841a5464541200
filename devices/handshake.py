"""The session handshake, once per connection, and the clock ping-pong.

Both sides send a `hello` (length-prefixed JSON: this is set-up, not payload), compare it
with their own and send a verdict, so a mismatch ends the session on both sides with the
same kind of error: "device 1 has bundle fingerprint ab12.., device 0 has cd34..". Then the
side that connected runs CLOCK_ROUNDS ping-pongs: it sends one byte (the round's mark), the
other answers with the mark and two readings of its clock (devices.clock: CLOCK_REALTIME in
ns, the clock of every record and of the kernel's receive timestamps), the ping's arrival
and the answer's departure, as NTP does. Each side checks a round's mark as soon as it
comes, so a peer out of step is refused at once, not waited for until the set-up's deadline.
With t0 the local send time, t3 the answer's arrival (arrivals are the kernel's receive
timestamps, as for messages) and t1 / t2 the peer's two readings, the round with the
smallest round trip less the peer's turnaround, (t3 - t0) - (t2 - t1), gives offset =
((t1 - t0) + (t2 - t3)) / 2 (the peer's clock minus ours) within +- half that round trip. On
one host the offset is ~0 (one kernel clock); across machines it aligns the devices'
records. With that offset, each round also gives the one-way time of its two frames, the
ping's (t1 - offset - t0) and the answer's (t3 - t2 + offset). Every other round pads both
frames with LARGE_ROUND_BYTES: the difference between the large and the small rounds' median
one-way times is the serialisation of those bytes, and the small frames' time less their own
serialisation is each direction's `latency_ns`, the part of a one-way time that does not
depend on the rate (the delay, the path), as the offset sees it. `level_k: auto`
(devices.level) subtracts it from its messages' one-way times to keep their serialisation
alone: through the same offset its error cancels.

Nothing a peer sends is trusted. Every frame is bounded and parsed as strict JSON
(devices.frames); a hello, a verdict and a clock estimate are validated field by field
(`Hello`, `Verdict`, `ClockEstimate`: types, ranges, lengths, no unknown keys) before any
field is compared or printed, and the side that accepts checks that the connection comes
from the address the spec gives the rank it claims. Any violation is a ProtocolError naming
the peer: its rank and address once the hello has named a valid rank, else the address the
connection comes from.

With a run secret (`RunSpec.secret_file`, shared by the devices of a run and never sent),
each side proves that it knows it: every hello carries a fresh random nonce, and each
verdict carries HMAC-SHA256(secret, both hellos), the sender's first; a peer whose proof is
wrong or missing is refused. The proof covers both nonces and both hellos, so it cannot be
replayed on another connection nor reflected back. It authenticates the connection at its
start; the payload that follows is neither encrypted nor authenticated.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import secrets
import statistics
import struct
from dataclasses import dataclass, field
from typing import Any

from devices.clock import Clock
from devices.errors import ProtocolError
from devices.frames import (
    CLOCK_RANGE_NS,
    CLOCK_ROUNDS,
    NONCE_BYTES,
    ClockEstimate,
    CountingSocket,
    Hello,
    Verdict,
    brief,
    shorten,
    validated,
)
from devices.transport import remote, tcp_frame_bytes

PROTOCOL_VERSION = 5
PING = b"p"  # round 0's mark; round i's is the byte after it by i (`round_mark`)
LARGE_ROUND_BYTES = 1000  # what pads both frames of every other round (latency_ns)
CLOCK = struct.Struct("!qq")  # ns: the ping's arrival (the kernel's stamp), the answer's departure

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
    "authenticated": "run secret",
}


def proof(secret: bytes, sender: dict[str, Any], receiver: dict[str, Any]) -> str:
    """The sender's proof that it knows the run's secret: an HMAC of both hellos (each with
    its connection's nonce), the sender's first."""
    both = json.dumps({"from": sender, "to": receiver}, sort_keys=True).encode()
    return hmac.new(secret, both, hashlib.sha256).hexdigest()


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
    latency_ns: int = 0  # the peer's frames' one-way time to us less their serialisation

    def summary(self) -> dict[str, Any]:
        return {
            "peer": self.peer,
            "hello": self.hello,
            "clock_offset_ns": self.clock_offset_ns,
            "clock_uncertainty_ns": self.clock_uncertainty_ns,
            "round_trips_ns": self.round_trips_ns,
            "latency_ns": self.latency_ns,
        }


@dataclass(frozen=True)
class HandshakeSide:
    """This device's side of every handshake it makes.

    Attributes:
        hello: its hello (`make_hello`).
        names: how to name each rank in messages ("device 1 (host:port)").
        clock: its clock, for the ping-pong.
        hosts: each rank's host in the spec; the side that accepts checks that the
            connection comes from the claimed rank's (None: not checked).
        secret: the run's secret; the peer must prove that it knows it (None: no proof is
            asked; the hellos' `authenticated` must agree).
    """

    hello: dict[str, Any]
    names: list[str]
    clock: Clock
    hosts: list[str] | None = None
    secret: bytes | None = None


def protocol_problem(mine: dict[str, Any], theirs: dict[str, Any], name: str) -> str | None:
    """Why the peer speaks another protocol version, or None; checked before anything else
    (another version may have other fields)."""
    if theirs.get("protocol") != mine["protocol"]:
        return (
            f"{name} speaks protocol version {brief(theirs.get('protocol'))}, device "
            f"{mine['rank']} speaks {mine['protocol']}"
        )
    return None


def disagreement(
    mine: dict[str, Any], theirs: dict[str, Any], expected: set[int], name: str
) -> str | None:
    """The first reason the two hellos cannot share a session, or None. `theirs` has passed
    `Hello`."""
    rank, peer = mine["rank"], theirs["rank"]
    if peer not in expected:
        wanted = " or ".join(str(r) for r in sorted(expected))
        return f"{name} says it is device {peer}, expected device {wanted}"
    for key, words in AGREED_FIELDS.items():
        if theirs[key] != mine.get(key):
            return (
                f"device {peer} has {words} {shorten(theirs[key])}, device {rank} has "
                f"{shorten(mine.get(key))}"
            )
    return None


def source_problem(conn: CountingSocket, host: str) -> str | None:
    """Why the connection cannot be from the device whose spec address is `host`, or None.
    Checked where the spec gives an IP address (a host name is not resolved here)."""
    try:
        wanted = ipaddress.ip_address(host)
        actual = ipaddress.ip_address(remote(conn.sock).rpartition(":")[0].strip("[]"))
    except ValueError:
        return None
    if actual != wanted:
        return f"connects from {actual}, but the spec gives that device {wanted}"
    return None


def shake(
    conn: CountingSocket, side: HandshakeSide, expected: set[int], connected: bool
) -> PeerHandshake:
    """Run the handshake on a fresh connection; raises ProtocolError on any mismatch or
    malformed frame, naming the peer.

    Args:
        conn: the connection, with a timeout set.
        side: this device's hello, names, clock, the spec's hosts and the run's secret.
        expected: the ranks this connection may come from.
        connected: True on the side that connected (it drives the clock ping-pong).
    """
    names, clock, hosts, secret = side.names, side.clock, side.hosts, side.secret
    name = names[min(expected)] if connected else f"a device connecting from {remote(conn.sock)}"
    mine = {**side.hello, "nonce": secrets.token_hex(NONCE_BYTES)}  # fresh for every connection
    conn.send_frame(mine)
    theirs: dict[str, Any] = {}
    try:
        theirs = conn.recv_frame()
        problem = protocol_problem(mine, theirs, name)
        if problem is None:
            validated(Hello, theirs, "hello")
            if not connected and theirs["rank"] in expected:
                name = names[theirs["rank"]]
            problem = disagreement(mine, theirs, expected, name)
        if problem is None and not connected and hosts is not None:
            wrong = source_problem(conn, hosts[theirs["rank"]])
            problem = wrong and f"{name} {wrong}"
    except ProtocolError as error:
        problem = str(error)
    mine_proof = proof(secret, mine, theirs) if secret is not None and problem is None else None
    try:  # the peer learns why, if it still listens
        conn.send_frame(
            {"ok": problem is None, "error": problem and shorten(problem), "proof": mine_proof}
        )
    except OSError:
        if problem is None:
            raise
    if problem is not None:
        raise ProtocolError(f"handshake with {name}: {problem}")
    try:
        verdict = validated(Verdict, conn.recv_frame(), "verdict")
    except ProtocolError as error:
        raise ProtocolError(f"handshake with {name}: {error}") from None
    if not verdict.ok:
        raise ProtocolError(f"{name} refused the handshake: {shorten(verdict.error or '')}")
    if secret is not None and not (
        verdict.proof and hmac.compare_digest(verdict.proof, proof(secret, theirs, mine))
    ):
        raise ProtocolError(
            f"handshake with {name}: its proof of the run secret is "
            f"{'wrong' if verdict.proof else 'missing'}: it does not know this run's secret"
        )
    result = PeerHandshake(theirs["rank"], theirs)
    if connected:
        measure_clock(conn, result, clock, name)
    else:
        answer_clock(conn, result, clock, name)
    return result


def measure_clock(conn: CountingSocket, result: PeerHandshake, clock: Clock, name: str) -> None:
    rounds = []  # (t0, the ping's arrival and the answer's departure on the peer's clock, t3)
    for index in range(CLOCK_ROUNDS):
        t0 = clock.now_ns()
        conn.send(ping(index))
        answer, t3 = _recv_round(conn, index, CLOCK.size + _padding(index), clock, name)
        t1, t2 = CLOCK.unpack_from(answer)
        problem = clock_answer_problem(t0, t1, t2, t3)
        if problem is not None:
            raise ProtocolError(f"handshake with {name}: clock answer {index} {problem}")
        rounds.append((t0, t1, t2, t3))
    # the round trip less the peer's turnaround, and the offset each round gives
    trips = [(t3 - t0 - (t2 - t1), ((t1 - t0) + (t2 - t3)) // 2) for t0, t1, t2, t3 in rounds]
    result.round_trips_ns = [trip for trip, _ in trips]
    best_rtt, offset = min(trips)
    result.clock_offset_ns, result.clock_uncertainty_ns = offset, best_rtt // 2
    answers = [t3 - (t2 - offset) for _, _, t2, t3 in rounds]
    pings = [t1 - offset - t0 for t0, t1, _, _ in rounds]
    result.latency_ns = _latency(answers, len(PING) + CLOCK.size)
    conn.send_frame(
        {
            "offset_ns": -offset,
            "uncertainty_ns": best_rtt // 2,
            "round_trips_ns": result.round_trips_ns,
            "latency_ns": _latency(pings, len(PING)),
        }
    )


def clock_answer_problem(t0: int, t1: int, t2: int, t3: int) -> str | None:
    """Why a peer's clock answer (t1, t2: the ping's arrival and the answer's departure on
    its clock) to a ping sent at t0 and answered at t3 (ours) is not one, or None: both times
    within CLOCK_RANGE_NS (CLOCK_REALTIME from 1970 to 2116, so that every offset and
    one-way time the handshake derives stays an int64), the peer's turnaround not negative
    and not longer than the round trip it is part of."""
    if not (0 <= t1 < CLOCK_RANGE_NS and 0 <= t2 < CLOCK_RANGE_NS):
        return f"gives times {t1} and {t2} ns, outside 0..2^62"
    if not 0 <= t2 - t1 <= t3 - t0:
        return (
            f"spends {t2 - t1} ns between the ping and its answer, outside 0..{t3 - t0} ns "
            "(the round trip)"
        )
    return None


def round_mark(index: int) -> bytes:
    """The byte that opens both frames of clock round `index`."""
    return bytes([PING[0] + index])


def ping(index: int) -> bytes:
    """Clock round `index`'s ping: its mark and its padding."""
    return round_mark(index) + bytes(_padding(index))


def clock_answer(index: int, came_ns: int, left_ns: int) -> bytes:
    """The answer to round `index`'s ping: its mark, the ping's arrival and the answer's
    departure, and its padding."""
    return round_mark(index) + CLOCK.pack(came_ns, left_ns) + bytes(_padding(index))


def _recv_round(
    conn: CountingSocket, index: int, size: int, clock: Clock, name: str
) -> tuple[bytes, int]:
    """Round `index`'s frame from the peer: its mark, checked as soon as it comes, then
    `size` more bytes; and when its last byte came. Every frame's size follows from its
    round, so a peer out of step (a round skipped or repeated, a large frame where a small one
    is due or the reverse, a frame where a ping is due) is refused at its first byte, never
    waited for until the set-up's deadline."""
    mark, came = conn.recv_exact_stamped(len(PING), clock)
    if mark != round_mark(index):
        raise ProtocolError(
            f"handshake with {name}: clock round {index} out of step (it opens with {mark!r}, "
            f"not {round_mark(index)!r})"
        )
    if size == 0:
        return b"", came
    return conn.recv_exact_stamped(size, clock)


def _padding(index: int) -> int:
    """Bytes that pad both frames of a round: every other round is a large one."""
    return LARGE_ROUND_BYTES if index % 2 else 0


def _latency(one_way_ns: list[int], payload: int) -> int:
    """The rate-independent part of one direction's one-way time, from its small and large
    rounds' frames (their medians): the small frames' time less their serialisation, which
    the difference between the two sizes gives."""
    small = statistics.median(one_way_ns[0::2])
    large = statistics.median(one_way_ns[1::2])
    small_bytes = tcp_frame_bytes(payload)
    per_byte = max(large - small, 0) / (tcp_frame_bytes(payload + LARGE_ROUND_BYTES) - small_bytes)
    return round(small - small_bytes * per_byte)


def answer_clock(conn: CountingSocket, result: PeerHandshake, clock: Clock, name: str) -> None:
    for index in range(CLOCK_ROUNDS):
        padding, came = _recv_round(conn, index, _padding(index), clock, name)
        if padding != bytes(_padding(index)):
            raise ProtocolError(
                f"handshake with {name}: clock round {index}'s padding is not zeros"
            )
        conn.send(clock_answer(index, came, clock.now_ns()))
    try:
        estimate = validated(ClockEstimate, conn.recv_frame(), "clock estimate")
    except ProtocolError as error:
        raise ProtocolError(f"handshake with {name}: {error}") from None
    result.clock_offset_ns = estimate.offset_ns
    result.clock_uncertainty_ns = estimate.uncertainty_ns
    result.round_trips_ns = estimate.round_trips_ns
    result.latency_ns = estimate.latency_ns
