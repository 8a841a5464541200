"""The serial link's C core as the program sees it: built from the checkout, its counters'
layout the same on both sides, its setters refusing what core.c refuses, a missing compiler
leaving the Python loop, and its impairments drawn number for number as the Python loop's
(the same seeds meet the same frames whichever loop serves a port)."""

from __future__ import annotations

import ctypes
import logging

import pytest

from testbed.link.serial import core
from testbed.link.serial.netem_draws import Impairments

DRAWN_FRAMES = 20_000
MODELS = {
    "delay": {"delay_ms": 20},
    "uniform jitter, correlated": {"delay_ms": 20, "jitter_ms": 5, "delay_correlation_pct": 25},
    "normal jitter": {"delay_ms": 20, "jitter_ms": 2, "delay_distribution": "normal"},
    "pareto, below zero": {"delay_ms": 1, "jitter_ms": 3, "delay_distribution": "pareto"},
    "paretonormal": {"delay_ms": 5, "jitter_ms": 1.3, "delay_distribution": "paretonormal"},
    "random loss, correlated": {"loss_pct": 5, "loss_correlation_pct": 30},
    "Gilbert-Elliott": {
        "loss_gemodel": {"p_pct": 2, "r_pct": 30, "one_minus_h_pct": 80, "one_minus_k_pct": 1}
    },
    "4-state": {
        "loss_state": {"p13_pct": 3, "p31_pct": 40, "p32_pct": 20, "p23_pct": 10, "p14_pct": 1}
    },
    "duplicate and loss": {"duplicate_pct": 10, "duplicate_correlation_pct": 5, "loss_pct": 10},
    "reorder with a gap": {
        "delay_ms": 10,
        "jitter_ms": 1,
        "reorder_pct": 25,
        "reorder_correlation_pct": 50,
        "reorder_gap": 5,
    },
    "everything": {
        "delay_ms": 30,
        "jitter_ms": 10,
        "delay_distribution": "normal",
        "loss_pct": 0.5,
        "duplicate_pct": 1,
        "reorder_pct": 2,
    },
}


@pytest.fixture(scope="module")
def library():
    loaded = core.load()
    assert loaded is not None, "gcc builds core.c on this machine"
    return loaded


def test_the_core_builds_once_per_source_and_matches_its_counters(library) -> None:
    assert core.library_path().exists()
    assert core.build() == core.library_path()  # built already: not again
    assert library.serial_counters_size() == ctypes.sizeof(core.Counters)


def test_the_setters_refuse_what_the_core_cannot_hold(library) -> None:
    assert library.serial_init(0) < 0 and library.serial_init(65) < 0
    assert library.serial_init(2) == 0
    assert library.serial_port(0, 3, 1e6) == 0
    assert library.serial_rate(1, 0.0) < 0  # a rate is positive
    assert library.serial_down(1, 0.0) == 0  # 0: unshaped
    assert library.serial_pair(0, 2, 1e6) < 0  # no port 2
    assert library.serial_serve(1) < 0  # port 1 has no socket
    counters, stalls = core.counters(library, 0)
    assert (counters.frames, counters.bytes, stalls) == (0, 0, [])


def frame(protocol: int, payload: bytes = b"", tcp_flags: int = 0x10) -> bytes:
    """An Ethernet frame of IPv4 carrying a TCP segment (20-byte header) or a UDP datagram."""
    transport = (
        bytes(12) + bytes([5 << 4, tcp_flags]) + bytes(6) if protocol == 6 else bytes(8)
    ) + payload
    total = 20 + len(transport)
    ip = bytes([0x45, 0, total >> 8, total & 255]) + bytes(5) + bytes([protocol]) + bytes(10)
    return bytes(12) + b"\x08\x00" + ip + transport


@pytest.mark.parametrize(
    ("what", "data", "found_free", "polls"),
    [
        ("a bare ACK", frame(6), True, 0),
        ("a bare ACK with PSH", frame(6, tcp_flags=0x18), True, 0),
        ("a segment inside a write", frame(6, b"x" * 100), True, 0),
        ("the last segment of a write", frame(6, b"x" * 100, 0x18), False, 1),
        ("a datagram that found its line free", frame(17, b"x" * 10), True, 1),
        ("a datagram queued behind another", frame(17, b"x" * 10), False, 0),
        ("an ARP frame", bytes(12) + b"\x08\x06" + bytes(28), True, 1),
        ("a runt TCP frame", frame(6, b"x" * 100, 0x18)[:40], True, 0),
    ],
)
def test_only_a_frame_that_ends_a_message_polls(library, what, data, found_free, polls) -> None:
    assert library.serial_ends_message(data, len(data), int(found_free)) == polls, what


def test_without_a_compiler_the_python_loop_runs(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(core, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(core.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING):
        assert core.load() is None
    assert "no C compiler (gcc) on this host" in caplog.text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3, 2**63 - 1])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_core_draws_what_the_python_loop_draws(library, model, seed) -> None:
    expected = Impairments(MODELS[model], seed)
    handle = core.impairments(library, Impairments(MODELS[model], seed))
    try:
        drawn = core.draw(library, handle, DRAWN_FRAMES)
    finally:
        library.serial_impairments_free(handle)
    frames = [expected.frame() for _ in range(DRAWN_FRAMES)]
    first = next((f for f, (a, b) in enumerate(zip(drawn, frames, strict=True)) if a != b), None)
    assert first is None, f"frame {first}: the core drew {drawn[first]}, Python {frames[first]}"
    assert model == "delay" or len(set(map(tuple, frames))) > 1  # the draws vary


def test_seed_keys_are_the_random_modules() -> None:
    assert core.seed_key(0) == [0]
    assert core.seed_key(-5) == [5]
    assert core.seed_key(2**32 + 9) == [9, 1]
