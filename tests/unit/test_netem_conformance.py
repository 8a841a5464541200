"""The conformance check's reading of both sides (`checks.netem_conformance`): busybox ping's
replies as lost, duplicated, reordered and delayed requests, the emulator's copies as the same,
and bad rows or counts refused in one line before any guest boots; its verdicts
(`checks.netem_verdicts`): burst lengths and their test, a count against the emulator's runs."""

from __future__ import annotations

import pytest

from checks import netem_conformance as conformance
from checks import netem_verdicts as verdicts
from testbed.link.serial.netem_draws import Copy

PING_OUTPUT = """PING 10.9.0.2 (10.9.0.2): 56 data bytes
64 bytes from 10.9.0.2: seq=0 ttl=64 time=41.000 ms
64 bytes from 10.9.0.2: seq=2 ttl=64 time=2.000 ms
64 bytes from 10.9.0.2: seq=1 ttl=64 time=46.000 ms
64 bytes from 10.9.0.2: seq=1 ttl=64 time=49.000 ms (DUP!)
64 bytes from 10.9.0.2: seq=5 ttl=64 time=40.500 ms

--- 10.9.0.2 ping statistics ---
6 packets transmitted, 4 packets received, 1 duplicates, 33% packet loss
"""
REORDER_ROW = verdicts.Row("r", "reorder", {"delay_ms": 40, "reorder_pct": 25})


def test_ping_replies_become_each_requests_fate() -> None:
    sample = conformance.guest_sample(REORDER_ROW, PING_OUTPUT, packets=6, overhead_ms=1.0)
    assert sample.lost == [False, False, False, True, True, False]
    assert sample.duplicated == [False, True, False, False, False, False]
    assert sample.reordered == [False, False, True, False, False, False]  # under 20 ms
    assert sample.delays_ms == [40.0, 45.0, 1.0, 39.5]  # first replies, in the order sent
    assert sample.out_of_order == 1  # seq 1 after seq 2


def test_the_emulators_copies_become_the_same_fates_with_the_guests_noise() -> None:
    frames = [[], [Copy(0.05)], [Copy(0.0, reordered=True)], [Copy(0.01), Copy(0.02)]]
    sample = conformance.serial_sample(frames, noise_ms=[1.0, -1.0])
    assert sample.lost == [True, False, False, False]
    assert sample.duplicated == [False, False, False, True]
    assert sample.reordered == [False, False, True, False]
    assert sample.delays_ms == pytest.approx([51.0, -1.0, 21.0])  # the original: the last copy
    assert sample.out_of_order == 0


def test_bursts_are_runs_of_losses() -> None:
    assert verdicts.bursts([True, True, False, True, False, False, True]) == [2, 1, 1]
    assert verdicts.bursts([False, False]) == []


def test_the_burst_test_tells_single_losses_from_long_bursts() -> None:
    singles = [1] * 80 + [2] * 20
    assert verdicts.burst_test(singles, list(singles)) == pytest.approx(1.0)
    assert verdicts.burst_test(singles, [1] * 20 + [3] * 40 + [6] * 40) < 1e-6
    assert verdicts.burst_test([1, 1], [1]) == 1.0  # one bin: nothing to compare


def test_a_delay_row_is_preceded_by_its_baseline_in_the_projects_words() -> None:
    delay = verdicts.Row("d", "delay", {"delay_ms": 50, "jitter_ms": 20})
    commands = conformance.guest_commands([REORDER_ROW, delay], packets=100)
    adds = [c[c.index("netem") + 1 :] for c in commands if c[2] == "add"]
    assert adds == [
        ["limit", "1000", "delay", "40ms", "reorder", "25%", "gap", "1"],
        ["limit", "1000", "delay", "50ms"],
        ["limit", "1000", "delay", "50ms", "20ms"],
    ]
    assert sum(c[0] == "ping" for c in commands) == 3


@pytest.mark.parametrize(
    ("measures", "packets", "says"),
    [(None, 5, "--packets 5"), (["latency"], 3000, "--rows ['latency']")],
)
def test_bad_rows_and_counts_are_refused_in_one_line(measures, packets, says) -> None:
    with pytest.raises(ValueError) as refused:
        conformance.chosen_rows(measures, packets)
    assert "\n" not in str(refused.value) and says in str(refused.value)


def test_the_rows_chosen_are_those_of_their_measures() -> None:
    assert conformance.chosen_rows(None, 3000) == list(conformance.ROWS)
    chosen = conformance.chosen_rows(["loss", "order"], 100)
    assert chosen and {row.measure for row in chosen} == {"loss", "order"}


def test_a_count_is_judged_against_the_emulators_own_runs() -> None:
    runs = [90, 95, 100, 100, 105, 110] * 10  # mean 100
    assert verdicts.monte_carlo_p(100, runs) == 1.0
    assert verdicts.monte_carlo_p(108, runs) == pytest.approx(21 / 61)  # 95/105 are closer
    assert verdicts.monte_carlo_p(130, runs) == pytest.approx(1 / 61)  # never 0
