"""`level_k: auto` during a session: the level each inference boundary chooses from the last
inference's stamped messages (devices.level.LiveLevel), on records made for a known link."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tracevq
from devices.level import HISTORY, MAX_ESTIMATE_MBIT, LiveLevel
from devices.records import ArrivalRecord, BlockRecord
from devices.transport import STAMP, tcp_frame_bytes
from tracevq.bundle import FitSettings, fit_bundle
from tracevq.codec import trace_message_bytes
from tracevq.methods import make_method

BATCH = 100  # 9 tokens x 100: messages of 114, 226, 339 and 451 bytes at levels 0..3
TOKENS = 9
OFFSET_NS = 5_000_000_000  # the peer's clock is 5 s ahead


@pytest.fixture(scope="module")
def parts():
    model = tracevq.build_model("vit-tiny")
    return model, fit_bundle(
        model, torch.randn(4, 3, 32, 32), FitSettings(16, families=("trace-b",))
    )


@pytest.fixture(scope="module")
def method(parts):
    return make_method("trace-b", *parts, K=16, level_k="auto")


def wire_bytes(method, level: int) -> int:
    return tcp_frame_bytes(
        STAMP.size + trace_message_bytes(TOKENS * BATCH, method.level_bits[level])
    )


def inference(method, level: int, rate_mbit: float, ffn_ms: float, echo_mbit: float | None = None):
    """The records of one inference whose peer sent at `level` over a `rate_mbit` link and
    echoed `echo_mbit` as what it measured of this device's messages (None: nothing yet)."""
    message = trace_message_bytes(TOKENS * BATCH, method.level_bits[level])
    link_ns = round(wire_bytes(method, level) * 8 / rate_mbit * 1e3)
    arrivals, blocks = [], []
    for block in range(4):
        sent_here = 1_000_000_000 * (block + 1)
        arrival = sent_here + link_ns
        echo = None if echo_mbit is None else round(8e6 / echo_mbit)  # ps per byte
        arrivals.append(
            ArrivalRecord(
                "r", 0, block, 1, message, arrival, arrival + 10_000, sent_here + OFFSET_NS, echo
            )
        )
        start = sent_here - 2_000_000
        ffn_end = start + round(ffn_ms * 1e6)
        blocks.append(
            BlockRecord(
                "r",
                0,
                block,
                ffn_ms,
                0.0,
                0,
                0,
                message,
                start,
                None,
                None,
                None,
                None,
                start,
                ffn_end,
            )
        )
    return arrivals, blocks


@pytest.mark.parametrize(
    ("rate_mbit", "ffn_ms", "expected"),
    [
        (1.0, 10.0, 3),  # 525 wire bytes take 4.2 ms: the finest level fits
        (1.0, 3.0, 1),  # 300 bytes take 2.4 ms, 413 take 3.3 ms
        (1.0, 1.0, 0),  # nothing fits: the coarsest
        (100.0, 0.05, 3),  # 42 us
    ],
)
def test_the_finest_level_whose_frames_cross_within_the_ffn_time(
    method, rate_mbit, ffn_ms, expected
):
    echoed = {}
    live = LiveLevel(method, TOKENS, BATCH, {1: OFFSET_NS}, echoed.__setitem__)
    for observed_level in (2, expected):  # the estimate does not depend on the level sent at
        method.set_level(observed_level)
        assert live.update(*inference(method, observed_level, rate_mbit, ffn_ms)) == expected
        assert method.level == expected
        assert live.rate_mbit == pytest.approx(rate_mbit, rel=1e-3)
        # what it measured goes back to the peer: ns per frame byte
        assert echoed[1] == pytest.approx(8e3 / rate_mbit, rel=1e-3)


@pytest.mark.parametrize(("down_mbit", "up_mbit", "expected"), [(100.0, 1.0, 1), (1.0, 100.0, 3)])
def test_the_peers_echo_of_this_devices_messages_decides(method, down_mbit, up_mbit, expected):
    """Its peer's messages come over a `down_mbit` link, its own go over `up_mbit` (as the
    peer's echo says): the level follows the uplink."""
    live = LiveLevel(method, TOKENS, BATCH, {1: OFFSET_NS}, lambda *_: None)
    method.set_level(2)
    assert live.update(*inference(method, 2, down_mbit, 3.0, echo_mbit=up_mbit)) == expected
    assert live.rate_mbit == pytest.approx(up_mbit, rel=1e-3)


def test_without_stamped_messages_the_level_stays(method):
    live = LiveLevel(method, TOKENS, BATCH, {1: 0}, lambda *_: None)
    method.set_level(2)
    arrivals, blocks = inference(method, 2, 1.0, 0.1)
    unstamped = [dataclasses.replace(a, sent_ns=None) for a in arrivals]
    assert live.update(unstamped, blocks) == 2 and live.rate_mbit is None


def test_messages_queued_behind_each_other_measure_the_link_not_the_queue(method):
    """The peer sends every 1 ms messages that take 4 ms on the link: each waits for the one
    before it (one-way times 4, 7, 10, 13 ms). Their time on the link is still 4 ms each; the
    one-way median would put the rate at less than half."""
    live = LiveLevel(method, TOKENS, BATCH, {1: OFFSET_NS}, lambda *_: None)
    method.set_level(2)
    arrivals, blocks = inference(method, 2, 1.0, 3.0)
    link_ns = arrivals[0].kernel_ns - 1_000_000_000
    queued = []
    for block, arrival in enumerate(arrivals):
        sent_here = 1_000_000_000 + 1_000_000 * block
        received = 1_000_000_000 + link_ns * (block + 1)
        stamps = {"sent_ns": sent_here + OFFSET_NS, "kernel_ns": received}
        queued.append(dataclasses.replace(arrival, read_ns=received + 10_000, **stamps))
    live.update(list(reversed(queued)), blocks)  # in any order
    assert live.rate_mbit == pytest.approx(1.0, rel=1e-3)


def with_latency(arrivals, latency_ns: int):
    later = {
        "kernel_ns": lambda a: a.kernel_ns + latency_ns,
        "read_ns": lambda a: a.read_ns + latency_ns,
    }
    return [dataclasses.replace(a, **{k: f(a) for k, f in later.items()}) for a in arrivals]


def test_the_largest_recent_messages_set_the_estimate(method):
    """1.4 ms of latency on a 20 Mbit/s link: the coarsest level's messages (114 bytes) look
    20x slower per byte than they are, the finest level's (451 bytes) less so. After an
    inference at the finest level the next at the coarsest does not undo its estimate; once
    HISTORY inferences have gone by without large messages, the small ones decide."""
    live = LiveLevel(method, TOKENS, BATCH, {1: OFFSET_NS}, lambda *_: None)
    fine = with_latency(inference(method, 3, 20.0, 2.0)[0], 1_400_000)
    coarse, blocks = inference(method, 0, 20.0, 2.0)
    coarse = with_latency(coarse, 1_400_000)
    method.set_level(3)
    assert live.update(fine, blocks) == 3
    fine_rate = live.rate_mbit
    for _ in range(HISTORY - 1):
        assert live.update(coarse, blocks) == 3 and live.rate_mbit == fine_rate
    assert live.update(coarse, blocks) == 0 and live.rate_mbit < fine_rate / 2


def test_a_floor_bounds_the_choice_and_nothing_above_it(parts):
    floored = make_method("trace-b", *parts, K=16, level_k="auto", level_min_k=4)
    live = LiveLevel(floored, TOKENS, BATCH, {1: OFFSET_NS}, lambda *_: None)
    assert live.update(*inference(floored, 1, rate_mbit=1.0, ffn_ms=1.0)) == 1  # not 0
    assert floored.level == 1
    assert live.update(*inference(floored, 1, rate_mbit=1.0, ffn_ms=10.0)) == 3


@pytest.mark.parametrize("delay_ms", [0, 5, 20, 50])
def test_delay_is_not_taken_for_serialisation(method, delay_ms):
    """A 20 Mbit/s link with `delay_ms` of one-way delay and a 2 ms FFN: the finest level's
    frames take 0.2 ms, so it stays, whatever the delay (which every level pays); without the
    handshake's latency the same messages read as a link of under 1 Mbit/s at 20 ms."""
    delay_ns = delay_ms * 1_000_000
    latencies = {1: delay_ns}  # the handshake's: the rate-independent part
    live = LiveLevel(method, TOKENS, BATCH, {1: OFFSET_NS}, lambda *_: None, latencies)
    arrivals, blocks = inference(method, 3, 20.0, 2.0)
    delayed = with_latency(arrivals, delay_ns)
    method.set_level(3)
    assert live.update(delayed, blocks) == 3
    assert live.rate_mbit == pytest.approx(20.0, rel=1e-3)
    if delay_ms >= 20:
        blind = LiveLevel(method, TOKENS, BATCH, {1: OFFSET_NS}, lambda *_: None)
        assert blind.update(delayed, blocks) == 0 and blind.rate_mbit < 1.0


def test_under_delay_a_queued_message_is_told_by_its_arrival_less_the_latency(method):
    """The peer sends every 1 ms messages that take 4 ms to serialise, over 20 ms of delay:
    each queues behind the one before (last bytes at 24, 28, 32, 36 ms) although it left
    long before that one arrived. Its serialisation is still 4 ms: 1 Mbit/s."""
    delay_ns = 20_000_000
    latencies = {1: delay_ns}
    live = LiveLevel(method, TOKENS, BATCH, {1: OFFSET_NS}, lambda *_: None, latencies)
    method.set_level(2)
    arrivals, blocks = inference(method, 2, 1.0, 3.0)
    serial_ns = arrivals[0].kernel_ns - 1_000_000_000
    queued = []
    for block, arrival in enumerate(arrivals):
        sent_here = 1_000_000_000 + 1_000_000 * block
        received = 1_000_000_000 + delay_ns + serial_ns * (block + 1)
        stamps = {"sent_ns": sent_here + OFFSET_NS, "kernel_ns": received}
        queued.append(dataclasses.replace(arrival, read_ns=received + 10_000, **stamps))
    live.update(queued, blocks)
    assert live.rate_mbit == pytest.approx(1.0, rel=0.01)


def test_a_link_faster_than_the_latency_can_tell_reads_at_the_ceiling(method):
    """Loopback under load: the handshake's latency (0.5 ms) is more than the messages' whole
    one-way time (a 10 Gbit/s link with no delay). Their serialisation is taken to be at
    MAX_ESTIMATE_MBIT, a measured estimate, and the finest level stays."""
    live = LiveLevel(method, TOKENS, BATCH, {1: OFFSET_NS}, lambda *_: None, {1: 500_000})
    method.set_level(0)
    arrivals, blocks = inference(method, 3, 10_000.0, 2.0)
    assert live.update(arrivals, blocks) == 3
    assert live.rate_mbit == pytest.approx(MAX_ESTIMATE_MBIT)
