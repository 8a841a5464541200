"""The fidelity report of a run: per session, device and direction, what the link was configured
to do against what it did (docs/user-guide.md, The fidelity report).

- rate: the probe's transfer of the direction (`testbed.link.links.LinkState`) against its
  target, as frames; flagged beyond the probe's own 5% (`RATE_TOLERANCE`).
- delay: every single-segment message the device sent to a peer in the session (every trial),
  its link delay being the kernel's receive timestamp of its last byte less its departure less
  its frame's wire time at the path's rate. Its 10th, 50th and 90th percentiles, each with its
  99% distribution-free interval (order statistics), against the same percentiles of the
  configured delay: netem's model (`testbed.link.serial.netem_draws`) drawn for every hop of
  the path, with a seed of its own. A percentile is flagged when the configured one lies
  outside its interval widened by `DELAY_TOLERANCE_MS` (the path's own cost, about 0.2 ms
  here, and the emulator's wake-ups, up to 0.15 ms). The 90th is judged only on paths that
  lose nothing: a message whose frame was lost arrives a retransmission later. Multi-segment
  messages are left out: TCP's window and the queue behind their own frames add to them.
- loss, duplication and reordering: the serial emulator's counts of the device's port within
  the session (`testbed.link.emulator.PortCounts`) against the probabilities the parameters
  give them, flagged when the configured one lies outside the count's 99% Wilson interval
  (`testbed.results.stats.proportion_interval`). A Gilbert model's losses come in runs: its
  interval is widened by the chain's design effect. Correlated draws and the 4-state model have
  no binomial interval, and a port whose frames meet later hops (a pair's or a downlink's
  impairments) counts their events too: those are shown, not judged. On tbf, netem's own
  statistics give the frames and the losses (`testbed.kernel.netem.netem_counters`), its
  full queue's drops among the losses: a loss count is flagged only when the configured
  rate lies above its interval (too few lost: the netem in force is not the one asked for),
  and not beside duplication (netem draws a duplicate's loss anew).
- the host's stalls of the port (frames that left more than 1 ms late), shown beside.

`report` makes a session's rows (`testbed.results.columns.FIDELITY_COLUMNS`), `save` writes
them beside the session and combines every session's into `fidelity.json` and `fidelity.csv`
in the run directory, and `lines` words the flagged links for the end of a run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from devices.records import DeviceRecords
from testbed.experiment.netem_parameters import checked
from testbed.kernel.netem import netem_options
from testbed.link.links import RATE_TOLERANCE, LinkState
from testbed.link.probe import WIRE_PER_PAYLOAD
from testbed.link.rates import LinkRates
from testbed.link.wire import TCP_MSS_BYTES, tcp_frame_bytes
from testbed.results.columns import FIDELITY_COLUMNS, FIDELITY_NAMES
from testbed.results.expected import configured_delays_ms, expected_counts
from testbed.results.facts import HostSessionFacts, RunFacts
from testbed.results.rows import Timeline, arrival_ns
from testbed.results.stats import proportion_interval, quantile_interval
from testbed.results.store import write_frame, write_text

CONFIDENCE = 0.99
DELAY_TOLERANCE_MS = 0.5
QUANTILES = (10, 50, 90)
MIN_MESSAGES = 10  # fewer single-segment messages: their percentiles are not judged
SESSION_FILE = "fidelity.json"
COUNTED = ("lost", "duplicated", "reordered")


def message_delays_ms(
    runs: Iterable[Mapping[int, DeviceRecords]], rates: LinkRates, shared_clock: bool
) -> dict[tuple[int, int], list[float]]:
    """By (sender, receiver), the link delay of every single-segment message of the session
    whose arrival the kernel timestamped: arrival less departure (clocks aligned) less the
    wire time of its frame at the path's rate, and of the copies for peers that it reached
    before this one (a sender's copies take turns on its line)."""
    delays: dict[tuple[int, int], list[float]] = {}
    for records in runs:
        timeline = Timeline(dict(records), shared_clock)
        copies: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
        for receiver, device in records.items():
            for arrival in device.arrivals:
                key = (arrival.peer, arrival.inference, arrival.block)
                small = 0 < arrival.message_bytes <= TCP_MSS_BYTES
                if key not in timeline.departures or arrival.kernel_ns is None or not small:
                    continue
                arrived = arrival_ns(arrival) + timeline.offset_ns[receiver]
                copies.setdefault(key, []).append((arrived, receiver, arrival.message_bytes))
        for key, arrivals in copies.items():
            sender, departed = key[0], timeline.departures[key].departed_ns
            wire_ms = 0.0
            for arrived, receiver, size in sorted(arrivals):
                rate_mbit = rates.path_mbit(sender, receiver)
                wire_ms += tcp_frame_bytes(size) * 8 / (rate_mbit * 1e3)
                delay_ms = (arrived - departed) / 1e6 - wire_ms
                delays.setdefault((sender, receiver), []).append(delay_ms)
    return delays


def report(
    link: LinkState,
    session: HostSessionFacts,
    runs: Iterable[Mapping[int, DeviceRecords]],
    run: RunFacts,
    devices: int,
) -> list[dict[str, Any]]:
    """A session's rows: per device, its uplink (and its downlink where shaped)."""
    if devices < 2:
        return []
    delays = message_delays_ms(runs, link.rates(devices), run.shared_clock)
    varied = _varied(session)
    rows = []
    for rank in range(devices):
        base = {
            "session_id": session.session_id,
            "devices": devices,
            "bandwidth_mbit": link.rate_mbit,
            "emulator": run.emulator,
            "rank": rank,
        }
        said = Said()
        row = {**base, "direction": "up", "impairments": _words(link, rank, devices)}
        row |= _rate(link, link.uplink_probe.get(rank), said)
        row |= _delays(link, rank, devices, delays, varied, said)
        row |= _counts(link, session, rank, devices, varied, said)
        rows.append(_finish(row, said))
        if link.downlink_mbit.get(rank) is not None:
            down, said = {**base, "direction": "down", "impairments": ""}, Said()
            rows.append(_finish(down | _rate(link, link.downlink_probe.get(rank), said), said))
    return rows


def _varied(session: HostSessionFacts) -> bool:
    """Whether the impairments changed within the session (a trace's steps, a link event)."""
    replay = session.replay
    stepped = replay is not None and any(replay.applied_impairments)
    return stepped or any(event.kind == "link" for event in session.timeline or [])


def _later_hops(link: LinkState, rank: int, devices: int) -> list[str]:
    """The later hops the port's frames may meet: its pairs', the other receivers' downlinks."""
    pairs = [f"{rank}->{d}" for d in range(devices) if f"{rank}->{d}" in link.parameters]
    downs = [f"down{d}" for d in range(devices) if d != rank and f"down{d}" in link.parameters]
    return pairs + downs


def _words(link: LinkState, rank: int, devices: int) -> str:
    words = [link.impairments.get(rank, "")]
    for hop in _later_hops(link, rank, devices):
        words.append(f"{hop}: {' '.join(netem_options(link.parameters[hop]))}")
    return "; ".join(word for word in words if word)


@dataclass
class Said:
    """What a row's parts found: what lies outside its interval, and what was not judged and
    why, in words."""

    outside: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _rate(link: LinkState, key: str | None, said: Said) -> dict[str, Any]:
    if key is None or key not in link.transfers:
        said.notes.append("rate: no probe of this direction")
        return {}
    transfer = link.transfers[key]
    rate, target = transfer["measured_mbit"] * WIRE_PER_PAYLOAD, transfer["target_mbit"]
    flagged = link.transfer_flagged(key)
    if flagged:
        said.outside.append(
            f"rate {rate:.2f} of {target:g} Mbit/s ({100 * (rate / target - 1):+.1f}%)"
        )
    return {
        "rate_target_mbit": target,
        "rate_mbit": rate,
        "rate_error_pct": 100 * (rate / target - 1),
        "rate_flagged": flagged,
    }


def _delays(
    link: LinkState,
    rank: int,
    devices: int,
    delays: Mapping[tuple[int, int], list[float]],
    varied: bool,
    said: Said,
) -> dict[str, Any]:
    """The sender's message delays against the configured ones, over every receiver."""
    achieved: list[float] = []
    configured = []
    lossless = True
    for receiver in range(devices):
        if receiver == rank:
            continue
        achieved += delays.get((rank, receiver), [])
        hops = [link.parameters.get(h) for h in (str(rank), f"{rank}->{receiver}")]
        hops = [h for h in hops + [link.parameters.get(f"down{receiver}")] if h is not None]
        if hops:
            configured.append(configured_delays_ms(hops))
            lossless &= all(expected_counts(h)["lost"].probability == 0 for h in hops)
    row: dict[str, Any] = {"delay_messages": len(achieved)}
    drawn = np.concatenate(configured) if configured else np.zeros(1)
    outside = []
    for q in QUANTILES:
        interval = quantile_interval(achieved, q / 100, CONFIDENCE)
        want = float(np.percentile(drawn, q))
        row |= {
            f"delay_p{q}_ms": interval.median,
            f"delay_p{q}_low_ms": interval.low,
            f"delay_p{q}_high_ms": interval.high,
            f"configured_delay_p{q}_ms": want,
        }
        low, high = interval.low - DELAY_TOLERANCE_MS, interval.high + DELAY_TOLERANCE_MS
        if (q < 90 or lossless) and not low <= want <= high:
            outside.append(
                f"delay p{q} {interval.median:.2f} ms [{interval.low:.2f}, "
                f"{interval.high:.2f}], configured {want:.2f} ms"
            )
    if varied:
        said.notes.append("delay not judged: the impairments changed during the session")
    elif link.medium == "shared":
        said.notes.append("delay not judged: on a shared cell the others' frames add to it")
    elif len(achieved) < MIN_MESSAGES:
        said.notes.append(f"delay not judged: {len(achieved)} single-segment messages")
    else:
        row["delay_flagged"] = bool(outside)
        said.outside += outside
    return row


def _counts(
    link: LinkState,
    session: HostSessionFacts,
    rank: int,
    devices: int,
    varied: bool,
    said: Said,
) -> dict[str, Any]:
    """The port's loss, duplication and reordering against the configured probabilities."""
    counts = None if session.ports is None else session.ports.get(rank)
    if counts is None:
        said.notes.append("counts: none (the emulator does not count this link, or was lost)")
        return {}
    netem = counts.duplicated is None  # tbf's netem: frames and losses (`PortCounts`)
    drawn = counts.frames - (counts.duplicated or 0) + counts.lost
    row: dict[str, Any] = {
        "frames": drawn,
        "frames_sent": counts.frames,
        "drops": counts.drops,
        "stalls": counts.stalls,
        "stalled_ms": counts.stalled_ms,
    }
    parameters = link.parameters.get(str(rank)) or checked({})
    expected = expected_counts(parameters)
    later = _later_hops(link, rank, devices)
    for name in COUNTED:
        count, n = getattr(counts, name), counts.frames if name == "reordered" else drawn
        want = expected[name]
        row |= {
            name: count,
            f"{name}_pct": 100 * count / n if n and count is not None else None,
            f"configured_{name}_pct": 100 * want.probability,
        }
        if count is None or varied or later or want.design_effect is None or not n:
            continue
        if netem and parameters["duplicate_pct"]:  # a duplicate draws its own loss in netem
            continue
        low, high = proportion_interval(count, n, CONFIDENCE, want.design_effect)
        row |= {f"{name}_low_pct": 100 * low, f"{name}_high_pct": 100 * high}
        # netem's drops count its full queue's with its losses: only too few can be told
        flagged = want.probability > high if netem else not low <= want.probability <= high
        row[f"{name}_flagged"] = flagged
        if flagged:
            said.outside.append(
                f"{name} {100 * count / n:.2f}% [{100 * low:.2f}, {100 * high:.2f}] of {n:,} "
                f"frames, configured {100 * want.probability:.2f}%"
            )
    if varied:
        said.notes.append("counts not judged: the impairments changed during the session")
    elif later:
        said.notes.append(
            f"counts not judged: the port counts the later hops' too ({', '.join(later)})"
        )
    else:
        untested = [n for n in COUNTED if expected[n].design_effect is None]
        if untested:
            said.notes.append(
                f"{', '.join(untested)} not judged: correlated draws have no binomial interval"
            )
    if netem:
        said.notes.append(
            "netem's statistics count no duplicates or reorders, and its full queue's drops "
            "among its losses: loss judged for too few only"
            + (", and not beside duplication" if parameters["duplicate_pct"] else "")
        )
    return row


def _finish(row: dict[str, Any], said: Said) -> dict[str, Any]:
    """The row with its verdict and words; NaN (an interval of nothing) as None, for JSON."""
    row = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
    row |= {"flagged": bool(said.outside), "outside": "; ".join(said.outside)}
    return row | {"note": "; ".join(said.notes)}


def frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Rows as the report's typed table (`FIDELITY_COLUMNS`)."""
    table = pd.DataFrame(rows, columns=FIDELITY_NAMES)
    return table.astype({c.name: c.dtype for c in FIDELITY_COLUMNS})


def save(run_dir: Path, session_id: str, rows: list[dict[str, Any]]) -> None:
    """A session's rows beside its files, then the run's `fidelity.json` and `fidelity.csv`
    rebuilt from every session's (a resumed run keeps the earlier sessions')."""
    run_dir = Path(run_dir)
    session_file = run_dir / "sessions" / session_id / SESSION_FILE
    write_text(session_file, json.dumps(rows, indent=1, default=_plain))
    combine(run_dir)


def combine(run_dir: Path) -> pd.DataFrame:
    rows = []
    for path in sorted(Path(run_dir).glob(f"sessions/*/{SESSION_FILE}")):
        rows += json.loads(path.read_text())
    table = frame(rows)
    summary = {
        "confidence": CONFIDENCE,
        "rate_tolerance_pct": 100 * RATE_TOLERANCE,
        "delay_tolerance_ms": DELAY_TOLERANCE_MS,
        "links": rows,
    }
    write_text(run_dir / "fidelity.json", json.dumps(summary, indent=1, default=_plain))
    write_frame(table, run_dir / "fidelity.csv")
    return table


def _plain(value: Any) -> Any:
    """numpy's numbers as JSON's; NaN stays NaN (json writes it)."""
    return value.item() if isinstance(value, np.generic) else str(value)


def lines(run_dir: Path) -> list[str]:
    """A line per link outside its intervals, or one saying all were within; none without a
    report (a run of one device, a run from before the report)."""
    path = Path(run_dir) / "fidelity.json"
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())["links"]
    if not rows:
        return []
    flagged = [row for row in rows if row.get("flagged")]
    if not flagged:
        return ["", f"fidelity: all {len(rows)} links within their intervals ({path.name})"]
    said = [
        "",
        f"fidelity: {len(flagged)} of {len(rows)} links outside their intervals ({path.name}):",
    ]
    for row in flagged:
        stalls = row.get("stalls")
        plural = "s" if stalls != 1 else ""
        held = (
            f"; {stalls} stall{plural} of the host ({row['stalled_ms']:.1f} ms)" if stalls else ""
        )
        said.append(
            f"  {row['session_id']} device {row['rank']} {row['direction']}: {row['outside']}{held}"
        )
    return said
