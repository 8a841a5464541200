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
  timestamp of its last byte minus the departure corrected by the handshake's clock offset.
  Per frame byte (headers included), the median over a peer's messages of the last inference
  predicts each level's transfer time, and the budget is the median FFN time of the last
  inference's blocks. The one-way time includes the link's latency, which does not shrink
  with the message: the prediction errs towards coarser levels by the latency's share
  (small where the choice matters: there the frames' wire time dominates). What a device
  measures of a peer's messages it echoes back in its own stamps to that peer, so each device
  chooses from how its own messages travelled, as the slowest of its peers saw them; until
  the first echo arrives, from how the peers' messages to it travelled (the same link where
  devices share one channel).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from devices.records import ArrivalRecord, BlockRecord
from devices.transport import STAMP, tcp_frame_bytes
from tracevq.codec import trace_message_bytes
from tracevq.methods import Method, TraceMethod, auto_level

FFN_ROUNDS = 3


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
    method: Method, tokens: int, batch: int, rate_mbit: float | None
) -> dict[str, Any]:
    """Set the method's level if it asks for `auto`; returns what was decided and why."""
    if not isinstance(method, TraceMethod) or method.spec.level_k != "auto":
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
    ffn_ms = measure_ffn_ms(method, tokens, batch)
    level = auto_level(method.level_bits, tokens * batch, rate_mbit * 1e6, ffn_ms)
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
    ):
        self.method, self.offsets_ns = method, offsets_ns
        self.echo = echo
        rows = tokens * batch
        self.wire_bytes = [
            tcp_frame_bytes(STAMP.size + trace_message_bytes(rows, bits))
            for bits in method.level_bits
        ]
        self.rate_mbit: float | None = None  # the last estimate of this device's uplink

    def update(self, arrivals: Sequence[ArrivalRecord], blocks: Sequence[BlockRecord]) -> int:
        """Set the level for the next inference from the last one's arrivals and blocks;
        returns it (unchanged when nothing could be measured)."""
        measured: dict[int, list[float]] = defaultdict(list)  # peer -> ns per frame byte
        echoed: dict[int, float] = {}  # peer -> its latest measure of this device's messages
        for arrival in arrivals:
            if arrival.sent_ns is None:
                continue
            frames = tcp_frame_bytes(STAMP.size + arrival.message_bytes)
            measured[arrival.peer].append(max(self._one_way_ns(arrival), 0) / frames)
            if arrival.echo_ps_per_byte is not None:
                echoed[arrival.peer] = arrival.echo_ps_per_byte / 1000
        downlink = {peer: statistics.median(values) for peer, values in measured.items()}
        for peer, per_byte in downlink.items():
            self.echo(peer, per_byte)
        # this device's own messages as its slowest peer saw them; before any echo came back,
        # the peers' messages as this device saw them
        seen = echoed or downlink
        ffn_ms = [(b.ffn_end_ns - b.ffn_start_ns) / 1e6 for b in blocks]
        if not seen or not ffn_ms:
            return self.method.level
        per_byte = max(seen.values())
        budget_ms = statistics.median(ffn_ms)
        self.rate_mbit = 8e3 / per_byte if per_byte > 0 else None
        level = 0
        for candidate, wire in enumerate(self.wire_bytes):
            if wire * per_byte / 1e6 <= budget_ms:
                level = candidate
        self.method.set_level(level)
        return level

    def _one_way_ns(self, arrival: ArrivalRecord) -> int:
        """From the message's departure to its last byte's arrival, on this device's clock."""
        assert arrival.sent_ns is not None
        received = arrival.read_ns if arrival.kernel_ns is None else arrival.kernel_ns
        return received - (arrival.sent_ns - self.offsets_ns.get(arrival.peer, 0))
