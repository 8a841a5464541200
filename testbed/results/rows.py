"""The result rows of a trial: its facts and the devices' records, joined.

The one assembler of rows (`assemble`): every column of `testbed.results.columns` is filled
here, from the typed facts of `testbed.results.facts` (the plan, where it ran, the session),
the link's state and the devices' records; nothing adds to a row afterwards.

- clocks: device r's marks move onto device 0's clock by the offset its handshake with
  device 0 measured (`devices.records.SessionFacts.clock_offset_ns[0]`), except where the
  devices read one kernel's clock (`RunFacts.shared_clock`: containers and namespaces on
  this host), where the offset is 0: the handshake's estimate assumes equal delays both
  ways, and a device's own uplink delay (link.uplink_impairments) would move it by half the
  difference.
- comm: per message, from its departure on the sender (first byte offered to the kernel) to
  the kernel's receive timestamp of its last byte at the slowest peer.
- wait, split by cause at the receiver: until the last needed message had departed
  (`wait_peer_ms`), until its last byte had reached this host (`wait_link_ms`), after that
  (`wait_wakeup_ms`).
- wire time: the message's bytes as the TCP segments and Ethernet frames the link carries.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from devices.records import ArrivalRecord, BlockRecord, DeviceRecords
from testbed.experiment.resolved_fleet import quota_share
from testbed.link.links import LinkState
from testbed.link.wire import tcp_frame_bytes, wire_time_s
from testbed.results.facts import AppliedEvent, HostSessionFacts, PlanRow, RunFacts
from testbed.units import BIT_PER_MBIT

if TYPE_CHECKING:
    from testbed.experiment.level_accuracy import LevelAccuracy
from testbed.results.columns import LAYER_COLUMNS, LAYER_NAMES, TRIAL_COLUMNS, TRIAL_NAMES, Column


@dataclass(frozen=True)
class Departure:
    departed_ns: int  # on device 0's clock
    written_ns: int


class Timeline:
    """Every message of one run on device 0's clock: departures and arrivals."""

    def __init__(self, records: dict[int, DeviceRecords], shared_clock: bool = False):
        self.offset_ns = {
            rank: 0 if rank == 0 or shared_clock else r.session.clock_offset_ns.get(0, 0)
            for rank, r in records.items()
        }
        self.starts = {
            (rank, r.inference): r.start_ns for rank, d in records.items() for r in d.inferences
        }
        self.departures: dict[tuple[int, int, int], Departure] = {}
        self.arrivals: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for rank, device in records.items():
            shift = self.offset_ns[rank]
            for block in device.blocks:
                if block.departed_ns is not None and block.written_ns is not None:
                    key = (rank, block.inference, block.block)
                    self.departures[key] = Departure(
                        block.departed_ns + shift, block.written_ns + shift
                    )
            for arrival in device.arrivals:
                key = (arrival.peer, arrival.inference, arrival.block)
                self.arrivals[key].append(arrival_ns(arrival) + shift)

    def comm_ms(self, sender: int, inference: int, block: int) -> float | None:
        key = (sender, inference, block)
        departure, arrivals = self.departures.get(key), self.arrivals.get(key)
        if departure is None or not arrivals:
            return None
        return (max(arrivals) - departure.departed_ns) / 1e6

    def wait_split_ms(self, receiver: int, block: BlockRecord, peers: list[int]) -> tuple:
        """(peer, link, wake-up) parts of a block's wait on `receiver`."""
        if block.wait_start_ns is None or block.wait_end_ns is None or not peers:
            return 0.0, 0.0, 0.0
        shift = self.offset_ns[receiver]
        start, end = block.wait_start_ns + shift, block.wait_end_ns + shift
        keys = [(peer, block.inference, block.block) for peer in peers]
        if not any(k in self.departures and self.arrivals.get(k) for k in keys):
            # no message for this block (a Trace placement of case A has none at block 0)
            return 0.0, 0.0, (end - start) / 1e6
        departed = max(self.departures[k].departed_ns for k in keys if k in self.departures)
        arrived = max(max(self.arrivals[k]) for k in keys if self.arrivals.get(k))
        peer_ns = min(max(departed - start, 0), end - start)
        link_ns = min(max(arrived - max(start, departed), 0), end - start - peer_ns)
        return peer_ns / 1e6, link_ns / 1e6, (end - start - peer_ns - link_ns) / 1e6


def arrival_ns(arrival: ArrivalRecord) -> int:
    return arrival.kernel_ns if arrival.kernel_ns is not None else arrival.read_ns


@dataclass(frozen=True)
class RowFacts:
    """Everything a trial's rows hold that the workers do not measure."""

    plan: dict[int, PlanRow]  # by rank
    run: RunFacts
    link: LinkState
    session: HostSessionFacts
    level_accuracy: LevelAccuracy | None = None  # the accuracy study's table, if named


def assemble(
    facts: RowFacts,
    records: dict[int, DeviceRecords] | None,
    error: str = "",
    unfinished: Sequence[int] = (),
    unfinished_error: str = "",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A trial's rows (trials, layers): from `records`, each rank's records of this trial's run
    only, or, where the trial failed (`records` None), one failed row per rank saying `error`.
    `unfinished`: inferences the session did not finish (a device left on the timeline), a
    failed row per rank each, saying `unfinished_error`.

    Over a replayed trace (`facts.session.replay`) an inference's `link_rate_mbit` is the step
    applied by its start: the devices' clocks are the host's, except on ssh boards, whose
    clocks are only as close to the host's as their NTP keeps them."""
    known = {rank: _known_columns(facts, rank) for rank in facts.plan}
    if records is None:
        rows = [
            {**columns, "repeat": -1, "status": "failed", "error": error}
            for columns in known.values()
        ]
        return frame(_with_accuracy(rows, facts), TRIAL_COLUMNS), frame([], LAYER_COLUMNS)
    trials, layers = _measured_rows(known, records, facts)
    if unfinished:
        # what was in force when the session ended: the last speed, every event still acting
        applied = facts.session.timeline or []
        end_ns = max((a.applied_ns or 0 for a in applied), default=0)
        events = events_in_force(applied, end_ns, end_ns)
        speeds = {row["rank"]: row["device_speed"] for row in trials}
        for index in unfinished:
            trials += [
                {
                    **columns,
                    "repeat": index,
                    "device_speed": speeds.get(rank, columns["device_speed"]),
                    "events": events,
                    "status": "failed",
                    "error": unfinished_error,
                }
                for rank, columns in known.items()
            ]
    return frame(_with_accuracy(trials, facts), TRIAL_COLUMNS), frame(layers, LAYER_COLUMNS)


def _known_columns(facts: RowFacts, rank: int) -> dict[str, Any]:
    """Every column of `rank`'s rows that the workers do not measure."""
    plan, run, link, session = facts.plan[rank], facts.run, facts.link, facts.session
    return {
        **plan.as_dict(),
        "run_id": run.run_id,
        "session_id": session.session_id,
        "backend": run.backend,
        "emulator": run.emulator,
        "batch": run.batch,
        "threads": run.threads.get(rank),
        "device_gflops": _gflops(run, rank, plan.device_speed, plan.cpus),
        "oversubscribed": run.oversubscribed,
        "dilation": run.dilation,
        "trace": run.trace,
        "uplink_mbit": link.uplink_mbit.get(rank, link.rate_mbit),
        "downlink_mbit": link.downlink_mbit.get(rank),
        "measured_mbit": link.measured_mbit.get(rank),
        "measured_wire_mbit": link.wire_mbit(rank),
        "downlink_measured_mbit": link.downlink_measured_mbit.get(rank),
        "downlink_measured_wire_mbit": link.downlink_wire_mbit(rank),
        "rate_flagged": link.flagged(rank) if plan.devices > 1 else False,
        "session_s": session.session_s,
        "link_sent_bytes": session.sent_bytes.get(rank),
        "impairments": link.impairments.get(rank, ""),
        "link_delay_ms": link.delay_ms.get(rank, 0.0),
        "medium": link.medium,
        "airtime_us": link.airtime_us,
        "together_mbit": link.together_mbit.get(rank),
    }


def _gflops(run: RunFacts, rank: int, speed: float, cpus: float) -> float | None:
    """The device's GEMM rate at `speed`: its rate measured at the start, scaled (and by its
    quota's share where its CPUs are a fraction: testbed.experiment.resolved_fleet.quota_share)."""
    raw = run.gflops.get(rank)
    return None if raw is None else raw * speed * quota_share(cpus)


def _with_accuracy(rows: list[dict[str, Any]], facts: RowFacts) -> list[dict[str, Any]]:
    """Each row with the study's top-1 at the level it used (`level_accuracy_pct`)."""
    table = facts.level_accuracy
    if table is None:
        return rows
    for row in rows:
        row["level_accuracy_pct"] = table.at(
            row["method"], row["devices"], row["K"], row["level_k"]
        )
    return rows


def _measured_rows(
    known: dict[int, dict[str, Any]], records: dict[int, DeviceRecords], facts: RowFacts
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    session, run = facts.session, facts.run
    timeline = Timeline(records, run.shared_clock)
    ranks = sorted(records)
    replay = session.replay
    felt = events_felt(session.timeline, records)
    trials, layers = [], []
    for rank in ranks:
        device, columns = records[rank], known[rank]
        peers = [p for p in ranks if p != rank]
        context = {
            **columns,
            "rank": rank,
            "clock_offset_ms": timeline.offset_ns[rank] / 1e6,
            "clock_uncertainty_ms": (
                0.0 if rank == 0 else device.session.clock_uncertainty_ns.get(0, 0) / 1e6
            ),
            "kernel_timestamps": device.session.kernel_timestamps,
        }
        by_inference: dict[int, list[dict[str, Any]]] = defaultdict(list)
        levels = {
            r.inference: {"level_k": r.level_k, "r_bits": r.r_bits}
            for r in device.inferences
            if r.level_k is not None  # Trace: the level in use, also under level_k=auto
        }
        for block in device.blocks:
            at = _link_in_force(context, session.timeline, rank, block.start_ns)
            row = layer_row(timeline, rank, block, peers, at)
            row.update(levels.get(block.inference, {}))
            by_inference[block.inference].append(row)
            layers.append(row)
        for record in device.inferences:
            if replay is None:
                link = {"link_rate_mbit": columns["bandwidth_mbit"]}
            else:
                link = {
                    "link_rate_mbit": replay.rate_at_ns(record.start_ns),
                    "trace_s": (record.start_ns - replay.start_ns) / 1e9,
                }
                step = replay.impairments_at_ns(record.start_ns)
                if "delay_ms" in step:  # the trace's delay in force when it started
                    link["link_delay_ms"] = step["delay_ms"]
                words = replay.words_at_ns(record.start_ns, rank)
                if words is not None:
                    link["impairments"] = words
            trials.append(
                {
                    **_link_in_force(context, session.timeline, rank, record.start_ns),
                    **link,
                    "est_rate_mbit": record.est_rate_mbit,
                    "tcp_retransmits": record.tcp_retransmits,
                    "link_stalled_ms": stalled_ms(session.stalls, record.start_ns, record.end_ns),
                    **impairment_counts(session.events, record.start_ns, record.end_ns),
                    **totals(by_inference[record.inference]),
                    **levels.get(record.inference, {}),
                    "repeat": record.inference,
                    "effective_ms": record.effective_ms,
                    "compute_ms": record.compute_ms,
                    "wait_ms": record.wait_ms,
                    "correct": record.correct,
                    "device_speed": record.speed,
                    "overruns": record.overruns,
                    "device_gflops": _gflops(run, rank, record.speed, columns["cpus"]),
                    "events": felt[record.inference],
                    "status": "ok",
                    "error": "",
                }
            )
    return trials, layers


def _link_in_force(
    context: dict[str, Any], applied: list[AppliedEvent] | None, rank: int, at_ns: int
) -> dict[str, Any]:
    """`context` with the rate-derived columns at the uplink rate that the timeline's last
    link event on `rank` before `at_ns` set (as it is, where none did)."""
    rate = None
    for event in applied or []:
        if event.kind == "link" and event.device == rank and event.rate_mbit is not None:
            if event.applied_ns is not None and event.applied_ns <= at_ns:
                rate = event.rate_mbit
    if rate is None:
        return context
    scale = context["bandwidth_mbit"] / rate  # the plan's analytic times are at the swept rate
    return {
        **context,
        "uplink_mbit": rate,
        "analytic_comm_ms": context["analytic_comm_ms"] * scale,
        "analytic_comm_ms_paper": context["analytic_comm_ms_paper"] * scale,
    }


def events_in_force(applied: list[AppliedEvent] | None, start_ns: int, end_ns: int) -> str:
    """The timeline's events that acted during [start_ns, end_ns] or were still in force."""
    return "; ".join(a.label for a in applied or [] if a.overlaps(start_ns, end_ns))


FLEET_WIDE = ("leave", "pause")  # events felt by every device's span: its peers wait on it


def events_felt(
    applied: list[AppliedEvent] | None, records: dict[int, DeviceRecords]
) -> dict[int, str]:
    """By inference, the events it ran under: an event of device e acted while e took part
    in it, from its start to its last message's write (a frozen sender delays its peers
    even after its own record has ended). The devices wait for each other, so every
    device's row of the inference names it, and no row of an inference that ran before it
    or while the device was between inferences (another method's, interleaved). A leave or a
    pause is felt by the inferences that any device was in while it acted: a device frozen
    between two inferences holds up its peers' next one, which it has not begun."""
    spans: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    for rank, device in records.items():
        written: dict[int, int] = defaultdict(int)
        for block in device.blocks:
            written[block.inference] = max(written[block.inference], block.written_ns or 0)
        for record in device.inferences:
            end_ns = max(record.end_ns, written[record.inference])
            spans[record.inference][rank] = (record.start_ns, end_ns)
    felt = {}
    for inference, by_rank in spans.items():
        whole = (min(s for s, _ in by_rank.values()), max(e for _, e in by_rank.values()))
        felt[inference] = "; ".join(
            a.label
            for a in applied or []
            if a.overlaps(*(whole if a.kind in FLEET_WIDE else by_rank.get(a.device, whole)))
        )
    return felt


IMPAIRMENT_COLUMNS = {
    "lost": "link_lost_frames",
    "duplicated": "link_duplicated_frames",
    "reordered": "link_reordered_frames",
}


def impairment_counts(
    events: list[tuple[int, str]] | None, start_ns: int, end_ns: int
) -> dict[str, int | None]:
    """Frames the emulator's impairments lost, duplicated and reordered within [start_ns,
    end_ns] (every port's); None without an event log."""
    if events is None:
        return dict.fromkeys(IMPAIRMENT_COLUMNS.values())
    counts = dict.fromkeys(IMPAIRMENT_COLUMNS.values(), 0)
    for at_ns, what in events[bisect.bisect_left(events, (start_ns, "")) :]:
        if at_ns > end_ns:
            break
        counts[IMPAIRMENT_COLUMNS[what]] += 1
    return counts


def stalled_ms(stalls: list[tuple[int, int]] | None, start_ns: int, end_ns: int) -> float | None:
    """How much of the stalls falls within [start_ns, end_ns]; None without a stall log."""
    if stalls is None:
        return None
    overlap = sum(max(0, min(end_ns, s + n) - max(start_ns, s)) for s, n in stalls)
    return overlap / 1e6


SUMMED = (
    "wait_peer_ms",
    "wait_link_ms",
    "wait_wakeup_ms",
    "comm_ms",
    "send_ms",
    "wire_comm_ms",
    "payload_bits",
    "message_bytes",
    "frame_bytes",
    "received_bytes",
)


def totals(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-inference sums of the per-block columns (a missing comm counts as missing)."""
    out: dict[str, Any] = {}
    for name in SUMMED:
        values = [b[name] for b in blocks]
        out[name] = None if any(v is None for v in values) else sum(values)
    return out


def layer_row(
    timeline: Timeline, rank: int, block: BlockRecord, peers: list[int], context: dict[str, Any]
) -> dict[str, Any]:
    copies = len(peers)
    sent = block.message_bytes > 0
    wait_peer, wait_link, wait_wakeup = timeline.wait_split_ms(rank, block, peers)
    frames = tcp_frame_bytes(block.message_bytes) * copies
    shift = timeline.offset_ns[rank]
    comm = timeline.comm_ms(rank, block.inference, block.block) if sent and copies else None
    origin = timeline.starts[(rank, block.inference)]

    def mark(ns: int | None) -> float | None:
        return None if ns is None else (ns - origin) / 1e6

    arrivals = timeline.arrivals.get((rank, block.inference, block.block))
    return {
        **context,
        "repeat": block.inference,
        "block": block.block,
        "compute_ms": block.compute_ms,
        "wait_ms": block.wait_ms,
        "wait_peer_ms": wait_peer,
        "wait_link_ms": wait_link,
        "wait_wakeup_ms": wait_wakeup,
        "comm_ms": comm if sent and copies else 0.0,
        "send_ms": (block.written_ns - block.departed_ns) / 1e6 if sent and copies else 0.0,
        "wire_comm_ms": 1000 * wire_time_s(frames, context["uplink_mbit"] * BIT_PER_MBIT),
        "payload_bits": block.payload_bits,
        "message_bytes": block.message_bytes * copies,
        "frame_bytes": frames,
        "received_bytes": block.received_bytes,
        "block_start_ms": mark(block.start_ns),
        "departed_ms": mark(block.departed_ns),
        "written_ms": mark(block.written_ns),
        "arrived_ms": mark(max(arrivals) - shift) if arrivals else None,
        "wait_start_ms": mark(block.wait_start_ns),
        "wait_end_ms": mark(block.wait_end_ns),
        "ffn_start_ms": mark(block.ffn_start_ns),
        "ffn_end_ms": mark(block.ffn_end_ns),
        "unique_remote_keys": block.unique_remote_keys,
    }


def frame(rows: list[dict[str, Any]], columns: list[Column]) -> pd.DataFrame:
    """Rows as a DataFrame of exactly `columns`, typed (other known columns are dropped: a
    layer row carries its trial's facts); a key that is no column at all is a bug."""
    names = [c.name for c in columns]
    unknown = sorted({key for row in rows for key in row} - set(TRIAL_NAMES) - set(LAYER_NAMES))
    assert not unknown, f"rows carry keys that are no column: {unknown}"
    table = pd.DataFrame(rows, columns=names)
    return table.astype({c.name: c.dtype for c in columns})
