"""The fidelity report's arithmetic: the probabilities netem's parameters give the serial
emulator's counts (held against the model's own draws), a session's rows from a port's
counters and the devices' records, what is flagged and what is not, the files and the lines a
run prints. No root, no sockets."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from devices.records import ArrivalRecord, BlockRecord, DeviceRecords, InferenceRecord, SessionFacts
from testbed.experiment.netem_parameters import checked
from testbed.link.emulator import LinkCounters, PortCounts, port_counts
from testbed.link.links import LinkState
from testbed.link.serial.netem_draws import Impairments
from testbed.link.wire import tcp_frame_bytes
from testbed.results import fidelity
from testbed.results.columns import FIDELITY_NAMES
from testbed.results.expected import expected_counts
from testbed.results.facts import HostSessionFacts, RunFacts
from testbed.results.fidelity import COUNTED
from testbed.results.stats import proportion_interval, quantile_interval

MS = 1_000_000  # ns
START_NS = 1_800_000_000 * 10**9
RATE_MBIT = 10.0


@pytest.mark.parametrize(
    "parameters",
    [
        {"loss_pct": 5},
        {"loss_pct": 5, "duplicate_pct": 10},
        {"delay_ms": 5, "reorder_pct": 25, "reorder_gap": 4},
        {"loss_gemodel": {"p_pct": 1, "r_pct": 25}},
        {"loss_gemodel": {"p_pct": 2, "r_pct": 30, "one_minus_h_pct": 60, "one_minus_k_pct": 1}},
        {"loss_state": {"p13_pct": 1, "p31_pct": 40, "p32_pct": 20, "p23_pct": 30}},
    ],
)
def test_expected_counts_are_what_the_model_draws(parameters):
    """200,000 frames through the serial emulator's own model: each count's share lies within
    4 standard errors (the chain's design effect included where known) of the probability the
    report expects of it."""
    values = checked(parameters)
    expected = expected_counts(values)
    model = Impairments(values, seed=7)
    frames, counts, copies = 200_000, dict.fromkeys(COUNTED, 0), 0
    for _ in range(frames):
        sent = model.frame()
        counts["lost"] += not sent
        counts["duplicated"] += len(sent) > 1
        counts["reordered"] += sum(copy.reordered for copy in sent)
        copies += len(sent)
    for name in COUNTED:
        n = copies if name == "reordered" else frames
        p, effect = expected[name].probability, expected[name].design_effect or 10.0
        error = math.sqrt(effect * p * (1 - p) / n)
        assert abs(counts[name] / n - p) <= 4 * error + 1e-9, (name, counts[name] / n, p)


def test_correlated_draws_are_not_given_a_binomial_interval():
    expected = expected_counts(checked({"loss_pct": 2, "loss_correlation_pct": 50}))
    assert expected["lost"].design_effect is None
    gilbert = expected_counts(checked({"loss_gemodel": {"p_pct": 1, "r_pct": 25}}))
    assert gilbert["lost"].design_effect == pytest.approx((2 - 0.26) / 0.26)
    state = expected_counts(checked({"loss_state": {"p13_pct": 1}}))
    assert state["lost"].design_effect is None


def test_the_wilson_interval_is_scipys():
    for successes, n in ((0, 134), (7, 134), (52, 1000), (1000, 1000)):
        ours = proportion_interval(successes, n, 0.99)
        theirs = scipy_stats.binomtest(successes, n).proportion_ci(0.99, method="wilson")
        assert ours == pytest.approx((theirs.low, theirs.high), abs=1e-9)


def test_a_quantiles_interval_covers_it_as_often_as_it_says():
    rng = np.random.default_rng(3)
    covered = 0
    for _ in range(2000):
        interval = quantile_interval(rng.uniform(size=80), 0.1, 0.99)
        covered += interval.low <= 0.1 <= interval.high
    assert interval.level >= 0.99
    assert covered / 2000 >= 0.985


def arrival_and_block(sender_clock: int, inference: int, block: int, delay_ms: float):
    """A 14-byte message of (inference, block) that leaves at its block's start + 1 ms and
    reaches the peer's kernel its wire time and `delay_ms` later."""
    departed = sender_clock + (inference * 100 + block * 5 + 1) * MS
    wire_ns = round(tcp_frame_bytes(14) * 8 / (RATE_MBIT * 1e6) * 1e9)
    sent = BlockRecord(
        run="t",
        inference=inference,
        block=block,
        compute_ms=1.0,
        wait_ms=0.0,
        payload_bits=107,
        message_bytes=14,
        received_bytes=14,
        start_ns=departed - MS,
        departed_ns=departed,
        written_ns=departed,
        wait_start_ns=None,
        wait_end_ns=None,
        ffn_start_ns=departed,
        ffn_end_ns=departed,
    )
    kernel = departed + wire_ns + round(delay_ms * MS)
    return sent, kernel


def session_records(delays_ms: dict[int, list[float]]) -> dict[int, DeviceRecords]:
    """Two devices on one clock; device s sends one message per (inference, block) with the
    link delays `delays_ms[s]`, in order."""
    blocks: dict[int, list[BlockRecord]] = {0: [], 1: []}
    arrivals: dict[int, list[ArrivalRecord]] = {0: [], 1: []}
    for sender, delays in delays_ms.items():
        for index, delay in enumerate(delays):
            inference, block = divmod(index, 4)
            sent, kernel = arrival_and_block(START_NS, inference, block, delay)
            blocks[sender].append(sent)
            arrivals[1 - sender].append(
                ArrivalRecord("t", inference, block, sender, 14, kernel, kernel + MS)
            )
    records = {}
    for rank in (0, 1):
        session = SessionFacts("done", rank, 2, {}, kernel_timestamps=True)
        inferences = [
            InferenceRecord("t", i, START_NS + i * 100 * MS, START_NS + (i + 1) * 100 * MS, 1, 0, 1)
            for i in range(len(delays_ms[rank]) // 4)
        ]
        records[rank] = DeviceRecords(session, inferences, blocks[rank], arrivals[rank])
    return records


def link_state(parameters: dict) -> LinkState:
    """Two devices at 10 Mbit/s, probed 9.6 Mbit/s of payload each way (10.04 as frames),
    both uplinks impaired with `parameters`."""
    values = checked(parameters)
    return LinkState(
        RATE_MBIT,
        uplink_mbit={0: RATE_MBIT, 1: RATE_MBIT},
        downlink_mbit={0: None, 1: None},
        transfers={
            "0->1": {"target_mbit": RATE_MBIT, "measured_mbit": 9.6},
            "1->0": {"target_mbit": RATE_MBIT, "measured_mbit": 9.6},
        },
        uplink_probe={0: "0->1", 1: "1->0"},
        downlink_probe={0: "1->0", 1: "0->1"},
        impairments={0: "delay 10ms loss random 5%", 1: "delay 10ms loss random 5%"},
        parameters={"0": values, "1": values},
    )


def counters(frames: int, lost: int, stalls: list[tuple[int, int]] | None = None) -> LinkCounters:
    """A port's counters as the serial emulator reads them (cumulative since the switch
    started)."""
    port = {"frames": frames, "lost": lost, "duplicated": 0, "reordered": 0, "drops": 0}
    return LinkCounters(frames * 100, stalls or [], [], port)


def session_facts(lost: dict[int, int]) -> HostSessionFacts:
    """A session in which each port sent 950 frames and lost `lost[rank]`, counted as the
    difference of two readings of cumulative counters (2,000 probe frames before, unimpaired);
    port 1 stalled once within the session (3 ms) and once before it."""
    stalls = [(START_NS - 10**9, 2 * MS), (START_NS + 50 * MS, 3 * MS)]
    ports = {
        rank: port_counts(
            counters(2000, 0), counters(2950, count, stalls if rank else None), START_NS
        )
        for rank, count in lost.items()
    }
    return HostSessionFacts("p2-10mbit-delay10ms-loss5pct", ports=ports)  # type: ignore[arg-type]


RUN = RunFacts("run", "local", "serial", 1, {0: 1, 1: 1}, False, shared_clock=True)


def test_a_loss_outside_its_interval_is_flagged_and_one_inside_is_not():
    """5% configured: 52 of 1,002 frames drawn lost is within its interval, 150 is not."""
    link = link_state({"delay_ms": 10, "loss_pct": 5})
    delays = {0: [10.02] * 40, 1: [10.03] * 40}
    rows = fidelity.report(link, session_facts({0: 52, 1: 150}), [session_records(delays)], RUN, 2)
    up = {row["rank"]: row for row in rows}
    assert [row["direction"] for row in rows] == ["up", "up"]
    assert up[0]["frames"] == 950 + 52 and up[0]["lost"] == 52
    assert up[0]["lost_low_pct"] < 5 < up[0]["lost_high_pct"]
    assert up[0]["lost_flagged"] is False and up[0]["flagged"] is False
    assert up[1]["lost_flagged"] is True and up[1]["flagged"] is True
    assert up[1]["outside"].startswith("lost 13.64% [")
    assert up[1]["stalls"] == 1 and up[1]["stalled_ms"] == 3.0
    for row in up.values():
        assert row["rate_mbit"] == pytest.approx(9.6 * 1514 / 1448)
        assert row["rate_flagged"] is False
        assert row["delay_messages"] == 40
        assert row["delay_p50_ms"] == pytest.approx(10.02 if row["rank"] == 0 else 10.03)
        assert row["configured_delay_p50_ms"] == 10.0 and row["delay_flagged"] is False
        assert row["duplicated_flagged"] is False and row["reordered_flagged"] is False


def test_a_late_link_and_a_slow_rate_are_flagged():
    """Device 0's messages take 12 ms against 10 configured; device 1's probe reached 9.0 of
    10 Mbit/s (frames)."""
    link = link_state({"delay_ms": 10, "loss_pct": 5})
    link.transfers["1->0"]["measured_mbit"] = 9.0 * 1448 / 1514
    delays = {0: [12.0] * 40, 1: [10.0 + 0.01 * k for k in range(40)]}
    rows = fidelity.report(link, session_facts({0: 50, 1: 50}), [session_records(delays)], RUN, 2)
    late, slow = rows
    assert late["delay_flagged"] is True and late["rate_flagged"] is False
    assert "delay p50 12.00 ms" in late["outside"] and late["note"] == ""
    assert slow["rate_flagged"] is True and slow["delay_flagged"] is False
    assert slow["outside"].startswith("rate 9.00 of 10 Mbit/s (-10.0%)")


def test_what_cannot_be_judged_is_shown_not_flagged():
    """Correlated loss: no binomial interval; too few messages: no delay verdict; a tbf link
    (no per-port counts): counts absent."""
    link = link_state({"delay_ms": 10, "loss_pct": 5, "loss_correlation_pct": 25})
    few = {0: [10.0] * 4, 1: [10.0] * 4}
    rows = fidelity.report(link, session_facts({0: 300, 1: 0}), [session_records(few)], RUN, 2)
    assert rows[0]["lost"] == 300 and "lost_flagged" not in rows[0]
    assert rows[0]["flagged"] is False
    assert "lost not judged: correlated draws" in rows[0]["note"]
    assert "delay not judged: 4 single-segment messages" in rows[0]["note"]
    tbf = RunFacts("run", "local", "tbf", 1, {0: 1, 1: 1}, False, shared_clock=True)
    rows = fidelity.report(link, HostSessionFacts("s"), [session_records(few)], tbf, 2)
    assert "frames" not in rows[0] and "does not count this link" in rows[0]["note"]


def netem_facts(lost: dict[int, int]) -> HostSessionFacts:
    """tbf's netems in a session: 1,000 loss draws each, `lost[rank]` of them dropped (its
    statistics: passed and dropped, read before and after)."""
    ports = {
        rank: port_counts(
            LinkCounters(0, port={"frames": 0, "lost": 0}),
            LinkCounters(10**6, port={"frames": 1000 - count, "lost": count}),
            START_NS,
        )
        for rank, count in lost.items()
    }
    return HostSessionFacts("p2-10mbit-delay10ms-loss5pct", ports=ports)  # type: ignore[arg-type]


def test_netems_counts_on_tbf_flag_too_few_losses_only():
    """5% configured. netem's drops count its full queue's too: 150 of 1,000 is shown, not
    flagged; 10 of 1,000 (the netem in force loses less than asked) is flagged.
    Duplicates, reorders and stalls are not counted there."""
    link = link_state({"delay_ms": 10, "loss_pct": 5})
    delays = {0: [10.0] * 40, 1: [10.0] * 40}
    tbf = RunFacts("run", "local", "tbf", 1, {0: 1, 1: 1}, False, shared_clock=True)
    rows = fidelity.report(link, netem_facts({0: 150, 1: 10}), [session_records(delays)], tbf, 2)
    many, few = rows
    assert many["frames"] == 1000 and many["lost"] == 150 and many["lost_flagged"] is False
    assert many["lost_high_pct"] > 15 > many["lost_low_pct"] > 5
    assert few["lost_flagged"] is True and few["outside"].startswith("lost 1.00% [")
    for row in rows:
        assert row["duplicated"] is None and "duplicated_flagged" not in row
        assert row["stalls"] is None and row["drops"] is None
        assert "loss judged for too few only" in row["note"]
    dup = link_state({"delay_ms": 10, "loss_pct": 5, "duplicate_pct": 1})
    rows = fidelity.report(dup, netem_facts({0: 10, 1: 10}), [session_records(delays)], tbf, 2)
    assert all("lost_flagged" not in row and row["flagged"] is False for row in rows)
    assert "not beside duplication" in rows[0]["note"]


def test_a_counter_that_went_back_counts_nothing():
    """A qdisc made anew between two readings: its counters start again, no count."""
    before = LinkCounters(0, port={"frames": 500, "lost": 20})
    assert port_counts(before, LinkCounters(0, port={"frames": 100, "lost": 2}), 0) is None
    assert port_counts(before, LinkCounters(0, port={"frames": 600, "lost": 25}), 0) == PortCounts(
        frames=100,
        lost=5,
        duplicated=None,
        reordered=None,
        drops=None,
        stalls=None,
        stalled_ms=None,
    )


def test_the_report_is_saved_with_the_run_and_printed_when_outside(tmp_path):
    link = link_state({"delay_ms": 10, "loss_pct": 5})
    records = [session_records({0: [10.0] * 40, 1: [10.0] * 40})]
    within = fidelity.report(link, session_facts({0: 50, 1: 50}), records, RUN, 2)
    fidelity.save(tmp_path, "p2-10mbit-a", within)
    assert fidelity.lines(tmp_path) == [
        "",
        "fidelity: all 2 links within their intervals (fidelity.json)",
    ]
    outside = fidelity.report(link, session_facts({0: 50, 1: 150}), records, RUN, 2)
    for row in outside:
        row["session_id"] = "p2-10mbit-b"
    fidelity.save(tmp_path, "p2-10mbit-b", outside)
    said = fidelity.lines(tmp_path)
    assert said[1] == "fidelity: 1 of 4 links outside their intervals (fidelity.json):"
    assert said[2].startswith("  p2-10mbit-b device 1 up: lost 13.64% [")
    assert said[2].endswith("configured 5.00%; 1 stall of the host (3.0 ms)")
    assert len(said) == 3
    summary = json.loads((tmp_path / "fidelity.json").read_text())
    assert summary["confidence"] == 0.99 and len(summary["links"]) == 4
    table = fidelity.frame(summary["links"])
    assert list(table.columns) == FIDELITY_NAMES
    csv = (tmp_path / "fidelity.csv").read_text().splitlines()
    assert csv[0].split(",") == FIDELITY_NAMES and len(csv) == 5
