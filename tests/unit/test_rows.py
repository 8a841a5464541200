"""The result rows from the devices' records: columns defined once and documented, clocks
aligned, comm from departure to the kernel's arrival, the wait split by cause."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from devices.records import ArrivalRecord, BlockRecord, DeviceRecords, InferenceRecord, SessionFacts
from testbed.link.links import LinkState
from testbed.link.wire import tcp_frame_bytes
from testbed.results.columns import LAYER_NAMES, TRIAL_COLUMNS, TRIAL_NAMES, readme_tables
from testbed.results.facts import AppliedEvent, HostSessionFacts, PlanRow, RunFacts
from testbed.results.rows import RowFacts, assemble, events_felt, stalled_ms

MS = 1_000_000  # ns


def row_facts(devices: int = 2, rate_mbit: float = 1.0) -> RowFacts:
    """The facts of a voltage trial at `rate_mbit` (no probe: nothing measured the link)."""
    plan = {
        rank: PlanRow(
            trial_id="t",
            experiment="e",
            model="vit-tiny",
            method="voltage",
            devices=devices,
            rank=rank,
            bandwidth_mbit=rate_mbit,
            K=None,
            level_k=None,
            r_bits=None,
            params="",
            payload_bits_per_layer=0,
            analytic_comm_ms=0.0,
            analytic_comm_ms_paper=0.0,
            analytic_delay_ms=0.0,
        )
        for rank in range(devices)
    }
    threads = dict.fromkeys(range(devices), 1)
    run = RunFacts("run", "local", "serial", batch=1, threads=threads, oversubscribed=False)
    return RowFacts(plan, run, LinkState(rate_mbit), HostSessionFacts("s"))


README = Path(__file__).resolve().parents[2] / "results" / "README.md"


def test_readme_documents_exactly_the_columns():
    text = README.read_text()
    assert readme_tables() in text
    for column in TRIAL_COLUMNS:
        unit = column.unit or ""
        assert f"| `{column.name}` | {column.dtype} | {unit} |" in text


def test_units_are_in_the_names():
    for column in TRIAL_COLUMNS:
        if column.name.endswith("_ms"):
            assert column.unit == "ms", column.name
        if column.name.endswith("_bytes"):
            assert column.unit == "B", column.name


@pytest.mark.parametrize(
    ("message", "frames"), [(0, 0), (14, 80), (1448, 1514), (1449, 1449 + 132)]
)
def test_frame_bytes_count_a_header_per_segment(message, frames):
    assert tcp_frame_bytes(message) == frames


def block(rank_clock: int, block: int, **marks) -> BlockRecord:
    """A block of inference 0 whose marks are `rank_clock` + ms offsets."""
    base = dict(
        run="t",
        inference=0,
        block=block,
        compute_ms=1.0,
        wait_ms=0.0,
        payload_bits=107,
        message_bytes=14,
        received_bytes=14,
        start_ns=0,
        departed_ns=None,
        written_ns=None,
        wait_start_ns=None,
        wait_end_ns=None,
        ffn_start_ns=0,
        ffn_end_ns=0,
    )
    for key, value in marks.items():
        base[key] = None if value is None else rank_clock + round(value * MS)
    if "wait_start_ns" in marks:
        base["wait_ms"] = (base["wait_end_ns"] - base["wait_start_ns"]) / MS
    return BlockRecord(**base)


def device(rank: int, clock_ns: int, offset_to_0_ns: int, blocks, arrivals) -> DeviceRecords:
    offset = offset_to_0_ns if rank else -offset_to_0_ns
    session = SessionFacts(
        status="done",
        rank=rank,
        devices=2,
        spec={},
        clock_offset_ns={1 - rank: offset},
        clock_uncertainty_ns={1 - rank: 20_000},
        kernel_timestamps=True,
    )
    inference = InferenceRecord(
        run="t",
        inference=0,
        start_ns=clock_ns,
        end_ns=clock_ns + 10 * MS,
        compute_ms=8.0,
        wait_ms=2.0,
        effective_ms=10.0,
    )
    return DeviceRecords(session, [inference], blocks, arrivals)


@pytest.mark.parametrize("skew_s", [0.0, 7.25, -1000.0])
def test_comm_and_wait_split_on_aligned_clocks(skew_s):
    """Device 1's clock reads `skew_s` more than device 0's; the handshake measured it.

    Device 0 sends block 0's message at 1 ms, its last byte reaches device 1's kernel at 3 ms;
    device 1 waits from 0.5 ms to 3.4 ms: 0.5 ms for device 0 to send, 2 ms on the link,
    0.4 ms of wake-up. Device 1's message leaves at 0.2 ms and arrives at 0.4 ms, before
    device 0 waits (from 2 to 2.1 ms: all wake-up)."""
    skew = round(skew_s * 1e9)
    zero = 1_000_000_000_000_000
    one = zero + skew
    records = {
        0: device(
            0,
            zero,
            0,
            [
                block(
                    zero,
                    0,
                    start_ns=0,
                    departed_ns=1.0,
                    written_ns=1.1,
                    wait_start_ns=2.0,
                    wait_end_ns=2.1,
                )
            ],
            [ArrivalRecord("t", 0, 0, 1, 14, zero + round(0.4 * MS), zero + 2 * MS)],
        ),
        1: device(
            1,
            one,
            -skew,
            [
                block(
                    one,
                    0,
                    start_ns=0,
                    departed_ns=0.2,
                    written_ns=0.3,
                    wait_start_ns=0.5,
                    wait_end_ns=3.4,
                )
            ],
            [ArrivalRecord("t", 0, 0, 0, 14, one + 3 * MS, one + round(3.3 * MS))],
        ),
    }
    trials, layers = assemble(row_facts(), records)
    assert list(trials.columns) == TRIAL_NAMES and list(layers.columns) == LAYER_NAMES
    zero_row, one_row = trials.iloc[0], trials.iloc[1]
    assert zero_row["comm_ms"] == pytest.approx(2.0)  # departed 1.0, arrived 3.0
    assert one_row["comm_ms"] == pytest.approx(0.2)
    assert zero_row["send_ms"] == pytest.approx(0.1)
    assert one_row["clock_offset_ms"] == pytest.approx(-skew / MS)
    assert one_row["clock_uncertainty_ms"] == pytest.approx(0.02)
    assert (one_row["wait_peer_ms"], one_row["wait_link_ms"], one_row["wait_wakeup_ms"]) == (
        pytest.approx(0.5),
        pytest.approx(2.0),
        pytest.approx(0.4),
    )
    assert (zero_row["wait_peer_ms"], zero_row["wait_link_ms"]) == (0.0, 0.0)
    assert zero_row["wait_wakeup_ms"] == pytest.approx(0.1)
    assert zero_row["wire_comm_ms"] == pytest.approx(80 * 8 / 1e3)  # 14 B + 66 B of headers
    assert zero_row["frame_bytes"] == 80 and zero_row["message_bytes"] == 14
    layer = layers.iloc[0]
    assert layer["departed_ms"] == pytest.approx(1.0) and layer["arrived_ms"] == pytest.approx(3.0)
    assert trials["wait_ms"].tolist() == [2.0, 2.0]  # the device's own figure, as recorded


def test_a_block_without_messages_has_no_peer_or_link_wait():
    """Trace's placements of case A send nothing for block 0: each device's block 0 has no
    departure and no arrival, and its (zero) wait is not split among peers and link."""
    zero = 1_000_000_000_000_000
    quiet = dict(start_ns=0, wait_start_ns=0.5, wait_end_ns=0.5)
    records = {rank: device(rank, zero, 0, [block(zero, 0, **quiet)], []) for rank in (0, 1)}
    for rank in (0, 1):
        records[rank].blocks[0].message_bytes = records[rank].blocks[0].received_bytes = 0
    trials, layers = assemble(row_facts(), records)
    assert (trials[["wait_peer_ms", "wait_link_ms", "wait_wakeup_ms"]] == 0).all().all()
    assert (layers["comm_ms"] == 0).all() and (layers["message_bytes"] == 0).all()


def test_an_inference_counts_the_part_of_each_stall_within_it():
    ms = 1_000_000
    stalls = [(0, 5 * ms), (8 * ms, 4 * ms), (30 * ms, 2 * ms)]  # (start ns, length ns)
    assert stalled_ms(stalls, 10 * ms, 20 * ms) == 2.0  # the second's last 2 ms
    assert stalled_ms(stalls, 0, 40 * ms) == 11.0
    assert stalled_ms(stalls, 13 * ms, 29 * ms) == 0.0
    assert stalled_ms([], 0, 40 * ms) == 0.0
    assert stalled_ms(None, 0, 40 * ms) is None  # tbf links: nothing to count


def test_a_row_names_the_events_its_inference_ran_under_and_no_other():
    """Device 1 holds before inference 5 while device 0 still computes inference 4's head:
    the speed event applied then is inference 5's, not 4's. Device 0's last message of 5
    is written after it began to freeze: 5 felt the pause. Device 1 left during 6."""

    def ran(rank: int, spans: dict[int, tuple[int, int]], written: dict[int, int]):
        inferences = [
            InferenceRecord("t", i, s * MS, e * MS, 1.0, 0.0, 1.0) for i, (s, e) in spans.items()
        ]
        blocks = [
            dataclasses.replace(block(0, 0, start_ns=s, written_ns=written.get(i)), inference=i)
            for i, (s, _) in spans.items()
        ]
        session = SessionFacts(status="done", rank=rank, devices=2, spec={})
        return DeviceRecords(session, inferences, blocks, [])

    records = {
        0: ran(0, {4: (100, 230), 5: (240, 343), 6: (420, 520)}, {5: 348}),
        1: ran(1, {4: (100, 200), 5: (240, 340)}, {4: 205}),
    }
    timeline = [
        AppliedEvent(0, "speed", 1, "speed", applied_ns=210 * MS, began_ns=210 * MS),
        AppliedEvent(1, "pause", 0, "pause", 345 * MS, 350 * MS, 400 * MS, began_ns=345 * MS),
        AppliedEvent(2, "leave", 1, "leave", 500 * MS, 500 * MS, began_ns=500 * MS),
    ]
    assert events_felt(timeline, records) == {4: "", 5: "speed; pause", 6: "speed; leave"}
    # a pause between inferences: felt by the next inference only where it lasts into it (on
    # any device: a frozen device holds up its peers' next inference), by none if it ends first
    across = AppliedEvent(1, "pause", 1, "pause", 232 * MS, 232 * MS, 250 * MS, began_ns=232 * MS)
    within = AppliedEvent(1, "pause", 1, "pause", 232 * MS, 232 * MS, 236 * MS, began_ns=232 * MS)
    assert events_felt([across], records) == {4: "", 5: "pause", 6: ""}
    assert events_felt([within], records) == {4: "", 5: "", 6: ""}
