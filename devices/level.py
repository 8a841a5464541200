"""The Trace level of a run with `level_k=auto` (docs/method.md, Level selection): the finest
tree level whose message crosses the link within this device's FFN time, so that
communication stays hidden behind it. Each device chooses for itself: the header of every
message carries its level, so the receivers follow.

- At the start (`choose_level`): the FFN time is measured on the device's own partition shape
  (every block's FFN on random activations, a few rounds, the median), the link rate is the
  spec's `rate_mbit` (the testbed's probe figure); without one, the finest level.
- During the session (`LiveLevel`), at every inference boundary: from the messages of the last
  inference. Every message of an auto run carries its departure time (devices.transport,
  STAMP), so the receiver knows its one-way time on its own clock: the kernel's receive
  timestamp of its last byte minus its departure (corrected by the handshake's clock offset).
  Less the link's latency, the part that does not depend on the rate, which the handshake
  measured through the same offset (devices.handshake, `latency_ns`), what remains is the
  message's serialisation. A message that left before the previous one's
  last byte had left the link (its arrival less the latency) queued behind it: its
  serialisation is the time between the two last bytes (a sender whose messages come faster
  than the link drains them would otherwise measure its own queue: at 0.25 Mbit/s, a rate
  23% low). Per frame byte, the median over a peer's messages of an inference predicts each
  level's serialisation (`est_rate_mbit` is its inverse), and the budget is the median FFN
  time of the last inference's blocks: auto goes coarser only where serialisation does not
  fit under the FFN. The delay does not shrink with the message: with 20 ms of one-way delay
  every level waits for it, and a coarser level would lose accuracy to save the little
  serialisation a Trace message has (before the latency was subtracted, such a link read as
  a slow one and auto fell to the coarsest level). What remains of the latency after the
  subtraction (jitter, the receiver's wake-up) weighs least on large messages: of the last
  HISTORY inferences, the one with the largest messages gives the estimate (the newest of
  those). After a drop in rate the newest large messages say so at once; after a rise, a
  device at a coarse level sees it through its small messages only. What a device measures
  of a peer's messages it echoes back in its own stamps to that peer, so each device chooses
  from how its own messages travelled, as the slowest of its peers saw them. Until the first
  echo arrives it keeps the level it started with when the testbed's probe gave its own
  uplink's rate (the peers' links may differ from its own: a device on a 0.05 Mbit/s uplink
  whose peer's is 20 Mbit/s went to the finest level for an inference, reading its peer's
  fast messages); without a rate, from how the peers' messages to it travelled (the same
  link where devices share one channel). The latency is the handshake's: a delay that
  changes during the session (none does today) would need it measured again. On a link much
  faster than the testbed's (loopback), the serialisation is less than the latency's own
  noise and can read zero or less: a message is taken to cross at MAX_ESTIMATE_MBIT at most,
  so the estimate says "at least that fast" (and auto keeps the finest level) instead of
  "not measured".
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from devices.records import ArrivalRecord, BlockRecord
from devices.transport import STAMP, tcp_frame_bytes
from tracevq.codec import trace_message_bytes
from tracevq.methods import Method, TraceMethod, auto_level

FFN_ROUNDS = 3
HISTORY = 3  # inferences whose largest messages may set a peer's link estimate
MAX_ESTIMATE_MBIT = 1000.0  # 50x the fastest link the testbed shapes
MIN_NS_PER_BYTE = 8e3 / MAX_ESTIMATE_MBIT


@torch.no_grad()
def measure_ffn_ms(method: Method, tokens: int, batch: int) -> float:
    """Median time of one block's FFN on (batch, tokens, D) activations."""
    z = torch.randn(batch, tokens, method.model.config.dim)
    times = []
    for _ in range(FFN_ROUNDS):
        for block in method.model.blocks:
            began = time.perf_counter()
            block.ffn(z)
            times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times)


def choose_level(
    method: Method, tokens: int, batch: int, rate_mbit: float | None, speed: float = 1.0
) -> dict[str, Any]:
    """Set the method's level if it asks for `auto`; returns what was decided and why. The
    FFN is timed at full speed, then stretched to the device's `speed` (devices.pace)."""
    if not method.spec.is_trace or method.spec.level_k != "auto":
        return {"mode": "fixed"}
    finest = len(method.level_bits) - 1
    if rate_mbit is None:
        method.set_level(finest)
        return {
            "mode": "auto",
            "level": finest,
            "rate_mbit": None,
            "reason": "no link rate given (--rate-mbit): finest level",
        }
    ffn_ms = measure_ffn_ms(method, tokens, batch) / speed
    level = auto_level(method.level_bits, tokens * batch, rate_mbit * 1e6, ffn_ms, method.min_level)
    method.set_level(level)
    transfer_ms = 1000 * method.payload_bits(tokens, batch) / (rate_mbit * 1e6)
    return {
        "mode": "auto",
        "level": level,
        "r_bits": method.level_bits[level],
        "rate_mbit": rate_mbit,
        "ffn_ms": ffn_ms,
        "transfer_ms": transfer_ms,
    }


class LiveLevel:
    """Re-chooses an auto run's level from its last inference (see the module docstring).

    offsets_ns: per peer, the peer's clock minus this device's (the handshake's);
    echo(peer, ns_per_byte): hands what this device measured of a peer's messages to the link
    to that peer, whose stamps echo it back (devices.transport.PeerLink.echo_ps_per_byte).
    """

    def __init__(
        self,
        method: TraceMethod,
        tokens: int,
        batch: int,
        offsets_ns: Mapping[int, int],
        echo: Callable[[int, float], None],
        latencies_ns: Mapping[int, int] | None = None,
        rate_given: bool = False,
    ):
        """`rate_given`: the start's level came from this device's own uplink rate (the
        spec's rate_mbit), which a peer's link must not override before an echo comes."""
        self.method, self.offsets_ns = method, offsets_ns
        self.echo, self.rate_given = echo, rate_given
        # per peer, the rate-independent part of its messages' one-way time (the handshake's)
        self.latencies_ns = dict(latencies_ns or {})
        rows = tokens * batch
        self.wire_bytes = [
            tcp_frame_bytes(STAMP.size + trace_message_bytes(rows, bits))
            for bits in method.level_bits
        ]
        self.rate_mbit: float | None = None  # the last estimate of this device's uplink
        # per peer, (frame bytes, ns per frame byte) of its messages in the last inferences
        self.history: dict[int, deque[tuple[int, float]]] = defaultdict(
            lambda: deque(maxlen=HISTORY)
        )

    def update(self, arrivals: Sequence[ArrivalRecord], blocks: Sequence[BlockRecord]) -> int:
        """Set the level for the next inference from the last one's arrivals and blocks;
        returns it (unchanged when nothing could be measured)."""
        measured: dict[int, list[float]] = defaultdict(list)  # peer -> ns per frame byte
        echoed: dict[int, float] = {}  # peer -> its latest measure of this device's messages
        stamped: dict[int, list[ArrivalRecord]] = defaultdict(list)
        for arrival in arrivals:
            if arrival.sent_ns is not None:
                stamped[arrival.peer].append(arrival)
        for peer, received in stamped.items():
            previous: int | None = None  # the previous message's last byte
            largest = 0  # frame bytes of its largest message
            for arrival in sorted(received, key=_received_ns):
                frames = tcp_frame_bytes(STAMP.size + arrival.message_bytes)
                measured[peer].append(self._serial_ns_per_byte(arrival, frames, previous))
                previous, largest = _received_ns(arrival), max(largest, frames)
                if arrival.echo_ps_per_byte is not None:
                    echoed[peer] = arrival.echo_ps_per_byte / 1000
            self.history[peer].append((largest, statistics.median(measured[peer])))
        downlink = {peer: self._per_byte(peer) for peer in measured}
        for peer, per_byte in downlink.items():
            self.echo(peer, per_byte)
        # this device's own messages as its slowest peer saw them; before any echo came back,
        # the start's level if it came from this device's own rate, else the peers' messages
        # as this device saw them
        seen = echoed or ({} if self.rate_given else downlink)
        ffn_ms = [(b.ffn_end_ns - b.ffn_start_ns) / 1e6 for b in blocks]
        if not seen or not ffn_ms:
            return self.method.level
        per_byte = max(seen.values())
        budget_ms = statistics.median(ffn_ms)
        self.rate_mbit = 8e3 / per_byte if per_byte > 0 else None
        level = self.method.min_level
        for candidate, wire in enumerate(self.wire_bytes):
            if candidate > level and wire * per_byte / 1e6 <= budget_ms:
                level = candidate
        self.method.set_level(level)
        return level

    def _per_byte(self, peer: int) -> float:
        """A peer's link time per frame byte: from the largest of its messages of the last
        HISTORY inferences (the newest of those), whose share of fixed latency is least."""
        largest = max(frames for frames, _ in self.history[peer])
        return [per_byte for frames, per_byte in self.history[peer] if frames == largest][-1]

    def _serial_ns_per_byte(
        self, arrival: ArrivalRecord, frames: int, previous: int | None
    ) -> float:
        """The message's serialisation per frame byte, on this device's clock: its one-way
        time less the link's latency (the handshake's); or, where it left before the previous
        message's last byte had left the link (it queued behind it), the time between the two
        last bytes."""
        assert arrival.sent_ns is not None
        latency_ns = self.latencies_ns.get(arrival.peer, 0)
        departed = arrival.sent_ns - self.offsets_ns.get(arrival.peer, 0)
        received = _received_ns(arrival)
        if previous is not None and departed < previous - latency_ns:
            serial_ns = received - previous
        else:
            serial_ns = received - departed - latency_ns
        return max(serial_ns / frames, MIN_NS_PER_BYTE)


def _received_ns(arrival: ArrivalRecord) -> int:
    """Its last byte's arrival: the kernel's timestamp, else when it was read."""
    return arrival.read_ns if arrival.kernel_ns is None else arrival.kernel_ns
