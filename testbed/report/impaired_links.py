"""The report's section on delayed and lossy links (not in the paper): from a run of
`experiments/sweep-delay.yaml`, effective latency against one-way delay per method beside the
extended model and the delay each method hides (testbed.results.impairment_study); from a run
of `experiments/sweep-loss.yaml`, the tail under loss with the retransmissions behind it.
"""

from __future__ import annotations

import math

import pandas as pd

from testbed.results.impairment_study import (
    LATE_MS,
    RTO_MS,
    delay_table,
    hidden_delay,
    late_messages,
    loss_table,
)
from testbed.results.stats import summarize
from testbed.results.store import Results


def _cell(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _by_count(table: pd.DataFrame, header: list[str], rows: list[list[str]]) -> list[str]:
    """`_table`, with a first column P where `table` (one row per table row) spans several
    device counts: their rows would otherwise look alike."""
    if table["devices"].nunique() < 2:
        return _table(header, rows)
    counts = [str(devices) for devices in table["devices"]]
    return _table(["P", *header], [[p, *row] for p, row in zip(counts, rows, strict=True)])


def delay_section(results: Results) -> list[str]:
    table = delay_table(results)
    if table.empty:
        return []
    ok = results.ok_trials()
    keys = ["variant", "devices", "bandwidth_mbit", "link_delay_ms"]
    effective = summarize(ok, keys, ["effective_ms"], "max").set_index(keys)["effective_ms"]
    delays = sorted(table["link_delay_ms"].unique())
    hidden = hidden_delay(table)
    lines = [
        "## Delay (not in the paper)",
        "",
        f"Run: `{results.run_dir}`. Effective latency (ms, median over repetitions of the "
        "slowest device) at each one-way delay, and per message the measured wait beside the "
        "model's, max(0, wire + path + delay - window): the window is the time from a "
        "message's departure to the moment its receiver needs it (Trace sends block b + 1's "
        "message before block b's FFN), the path what a message takes beyond its wire time "
        "over the undelayed link.",
        "",
    ]
    rows = []
    for row in hidden.itertuples():
        key = (row.variant, row.devices, row.bandwidth_mbit)
        cells = [row.variant, f"{row.bandwidth_mbit:g}"]
        for delay in delays:
            at = table[
                (table["variant"] == row.variant)
                & (table["devices"] == row.devices)
                & (table["bandwidth_mbit"] == row.bandwidth_mbit)
                & (table["link_delay_ms"] == delay)
            ]
            if at.empty:
                cells.append("-")
                continue
            measured, predicted = at.iloc[0]["wait_ms"], at.iloc[0]["predicted_wait_ms"]
            total = effective.get((*key, delay), math.nan)
            cells.append(f"{_cell(total, 0)} ({_cell(measured)} / {_cell(predicted)})")
        rows.append(cells)
    header = ["variant", "Mbit/s", *[f"{delay:g} ms" for delay in delays]]
    lines += _by_count(hidden, header, rows)
    lines += [
        "",
        "Cells: effective ms (measured wait per message / the model's).",
        "",
        "The delay each method hides per message (window - wire - path), with the window's "
        "parts (medians over the run's messages):",
        "",
    ]
    lines += _by_count(
        hidden,
        ["variant", "hides ms", "window ms", "of it FFN ms", "wire ms", "path ms"],
        [
            [
                row.variant,
                _cell(row.hides_ms),
                _cell(row.window_ms),
                _cell(row.ffn_ms),
                _cell(row.wire_comm_ms, 2),
                _cell(row.path_ms, 2),
            ]
            for row in hidden.itertuples()
        ],
    )
    return [*lines, "", *_delay_findings(hidden), ""]


def _delay_findings(hidden: pd.DataFrame) -> list[str]:
    trace = hidden[hidden["variant"].str.startswith("trace-b")]
    others = hidden[~hidden["variant"].str.startswith("trace")]
    findings = []
    several = hidden["devices"].nunique() > 1
    for row in trace.itertuples():
        at = f" at P = {row.devices}" if several else ""
        findings.append(
            f"{row.variant}{at} hides a one-way delay up to {row.hides_ms:.1f} ms per message: "
            f"its message leaves {row.window_ms:.1f} ms before it is needed, of which its "
            f"FFN is {row.ffn_ms:.1f} ms; beyond that delay it waits (delay - "
            f"{row.hides_ms:.1f}) ms at every block."
        )
    if not others.empty:
        most = others["hides_ms"].max()
        findings.append(
            f"Voltage, Prism and Astra hide at most {most:.1f} ms: they pay nearly the whole "
            "delay at every block."
        )
    return [" ".join(findings)]


def loss_section(results: Results) -> list[str]:
    table = loss_table(results)
    if table.empty:
        return []
    lines = [
        "## Loss (not in the paper)",
        "",
        f"Run: `{results.run_dir}`. Per link and method, the slowest device's effective "
        "latency over repetitions (median, p95, p99), the frames the emulator lost and TCP's "
        "retransmissions per inference, and the share of inferences with a retransmission.",
        "",
    ]
    rows = [
        [
            row.link,
            row.variant,
            str(row.n),
            _cell(row.effective_ms, 0),
            _cell(row.effective_ms_p95, 0),
            _cell(row.effective_ms_p99, 0),
            _cell(row.lost_per_inference, 2),
            _cell(row.retransmits_per_inference, 2),
            f"{100 * row.retransmitted_share:.0f}%",
        ]
        for row in table.itertuples()
    ]
    header = ["link", "variant", "n", "median ms", "p95", "p99", "lost", "retransmits", "with one"]
    return [*lines, *_by_count(table, header, rows), "", *_tail_lines(results)]


def _tail_lines(results: Results) -> list[str]:
    """What makes the tail: the late messages, and the worst repetition beside its latest."""
    late = late_messages(results)
    if late.empty:
        return []
    lines = [
        f"What makes the tail: per link and method, the messages sent, those {LATE_MS:g} ms or "
        f"more beyond their wire time and one-way delay (a recovery), those {RTO_MS:g} ms or "
        "more (a retransmission timeout), the median and largest lateness of the late ones; "
        "then the worst repetition, how far its effective latency and its compute are above "
        "their medians and how late its latest message was.",
        "",
    ]
    rows = [
        [
            row.link,
            row.variant,
            str(row.messages),
            str(row.late),
            str(row.timeouts),
            _cell(row.late_median_ms),
            _cell(row.late_max_ms),
            _cell(row.worst_effective_above_ms, 0),
            _cell(row.worst_compute_above_ms, 0),
            _cell(row.worst_latest_ms),
        ]
        for row in late.itertuples()
    ]
    header = [
        "link",
        "variant",
        "messages",
        "late",
        "timeouts",
        "late median ms",
        "late max",
        "worst: above median",
        "its compute above median",
        "its latest",
    ]
    return [*lines, *_by_count(late, header, rows), ""]
