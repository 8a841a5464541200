"""The answer a run prints when it ends: per device count, every method variant at every
rate with its effective latency (median over repetitions of the slowest device, 95% interval), its
communication (median of the devices' mean) and its speedup over Voltage (median of the
per-repetition ratios, the repetitions paired in time), in the figures' variant order. Over a
replayed trace the rows are the rates in force when the inferences started, with the mean codewords
of the levels used. Over impaired links (delay, jitter, loss: `impairments`) two columns give the
95th and 99th percentiles of the slowest device's effective latency, and a line the frames the
emulator lost, duplicated and reordered and TCP's retransmissions. With an accuracy study's table
(`report.level_accuracy`), a last column gives the mean over the group's rows (every device's every
inference) of the study's top-1 at the level each used (`level_accuracy_pct`,
testbed.experiment.level_accuracy). A last line counts the inferences during which the serial
emulator stalled, if any.

    P=2 vit-b16 (6 repetitions)   effective ms [95% CI]      comm ms   vs voltage
    1 Mbit/s  voltage             14,210 [14,102, 14,305]     13,402       1.00x
              trace-b K=1024 ...
"""

from __future__ import annotations

import math

import pandas as pd

from testbed.results import stats
from testbed.results.cell_study import cell_lines
from testbed.results.fleet_study import fleet_lines
from testbed.results.impairment_study import delay_table, hidden_delay
from testbed.results.store import Results
from testbed.results.variants import (
    BASELINE,
    link_labels,
    trial_impairments,
    variant_order,
)

EXTRA_WIDTH = 13
LEVEL_ACCURACY = "top-1 % used"


def _ms(value: float) -> str:
    if pd.isna(value):
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:,.1f}"


def _speedups(ok: pd.DataFrame) -> dict[tuple, float]:
    """Median over repetitions of Voltage's effective time over each variant's, per (devices,
    link, variant); empty where the run has no Voltage."""
    slowest = stats.by_repetition(ok, ["devices", "link", "variant"], ["effective_ms"], "max")
    gains = {}
    for (devices, link), part in slowest.groupby(["devices", "link"]):
        per = {v: p.set_index("repeat")["effective_ms"] for v, p in part.groupby("variant")}
        if BASELINE not in per:
            continue
        for name, series in per.items():
            gains[(devices, link, name)] = stats.paired_ratio_interval(per[BASELINE], series).median
    return gains


def answer_lines(results: Results) -> list[str]:
    ok = results.ok_trials()
    if ok.empty:
        return ["no trial succeeded: nothing to summarize"]
    # over a replayed trace, the rate is the one in force when each inference started
    traced = "trace" in ok and ok["trace"].fillna("").astype(str).str.len().any()
    rate_column = "link_rate_mbit" if traced else "bandwidth_mbit"
    ok["link"], links = link_labels(ok, rate_column)
    keys = ["devices", "link", "variant"]
    effective = stats.summarize(ok, keys, ["effective_ms"], "max").set_index(keys)
    comm = stats.summarize(ok, keys, ["comm_ms"], "mean").set_index(keys)
    extra = _extra_columns(ok, keys, traced)
    gains = _speedups(ok)
    order = variant_order(ok)
    width = max(len(v) for v in order) + 2
    model = results.config["model"]["name"]
    lines = []
    for devices in sorted(ok["devices"].unique()):
        at = effective.loc[devices]
        n = int(at["n"].max())
        title = f"P={devices} {model} ({n} repetitions{_dilation(ok, devices)})"
        heads = "".join(f"{head:>{EXTRA_WIDTH}}" for head in extra)
        lines += [
            "",
            f"{title:<{10 + width}}{'effective ms [95% CI]':>26}{'comm ms':>11}"
            f"{'vs ' + BASELINE:>13}{heads}",
        ]
        for link in (
            link for link in links if (ok.loc[ok["devices"] == devices, "link"] == link).any()
        ):
            first = True
            if len(link) > 9:  # a link with impairments: a line of its own
                lines.append(link)
                first = False
            for name in order:
                if (link, name) not in at.index:
                    continue
                cell = at.loc[(link, name)]
                interval = (
                    f"{_ms(cell['effective_ms'])} [{_ms(cell['effective_ms_low'])}, "
                    f"{_ms(cell['effective_ms_high'])}]"
                )
                gain = gains.get((devices, link, name), math.nan)
                cells = "".join(
                    f"{_ms(means.get((devices, link, name), math.nan)):>{EXTRA_WIDTH}}"
                    for means in extra.values()
                )
                link_text = link if first else ""
                lines.append(
                    f"{link_text:<10}{name:<{width}}{interval:>26}"
                    f"{_ms(comm.loc[(devices, link, name), 'comm_ms']):>11}"
                    f"{'-' if math.isnan(gain) else f'{gain:,.2f}x':>13}{cells}"
                )
                first = False
    if LEVEL_ACCURACY in extra:
        table = results.config.get("report", {}).get("level_accuracy")
        lines += [
            "",
            f"{LEVEL_ACCURACY}: the accuracy study's top-1 at the level each inference "
            f"used ({table}; the rows matched: level_accuracy.csv)",
        ]
    lines += _impairment_lines(ok) + _delay_lines(results) + fleet_lines(results)
    lines += cell_lines(results)
    return lines + _stall_lines(ok) + _overrun_lines(ok) + _lossy_dilation_lines(ok)


def _dilation(ok: pd.DataFrame, devices: int) -> str:
    """', virtual time d = 2.5' where the device count's sessions were dilated."""
    if "dilation" not in ok:
        return ""
    factors = sorted(ok.loc[ok["devices"] == devices, "dilation"].dropna().unique())
    shown = [f"{d:g}" for d in factors if d != 1]
    return f", virtual time d = {'/'.join(shown)}" if shown else ""


def _overrun_lines(ok: pd.DataFrame) -> list[str]:
    """A note when the host did not deliver some devices' paced compute in time."""
    if "overruns" not in ok or not (ok["overruns"].fillna(0) > 0).any():
        return []
    hit = ok[ok["overruns"].fillna(0) > 0]
    return [
        "",
        f"overruns: the host was late with {int(hit['overruns'].sum())} stretches of compute "
        f"in {len(hit)} of {len(ok)} device inferences (overruns): their compute reads longer "
        "than the devices' speeds say; a larger dilation gives the host more room",
    ]


def _lossy_dilation_lines(ok: pd.DataFrame) -> list[str]:
    """Loss or duplication in a dilated session: TCP's timers keep the host's clock."""
    if "dilation" not in ok or not impaired(ok) or not (ok["dilation"] > 1).any():
        return []
    words = ok.loc[ok["dilation"] > 1, "impairments"].fillna("").astype(str)
    if not words.str.contains("loss|duplicate|reorder").any():
        return []
    return [
        "",
        "virtual time with loss: the kernel's TCP timers (minimum RTO 200 ms, delayed ACK, "
        "tail-loss probe) keep the host's clock, so in a session of dilation d a "
        "retransmission's wait reads d times shorter: the tail above understates the stalls "
        "loss causes (docs/devices.md, What is not dilated)",
    ]


def _delay_lines(results: Results) -> list[str]:
    """Where the run swept the one-way delay: the delay each variant hides per message."""
    table = delay_table(results)
    if table.empty:
        return []
    lines = [
        "",
        "one-way delay hidden per message (window: from its departure to its need; beyond "
        "window - wire - path every ms of delay is waited for):",
    ]
    for row in hidden_delay(table).itertuples():
        lines.append(
            f"  P={row.devices} {row.bandwidth_mbit:g} Mbit/s {row.variant}: {row.hides_ms:.1f} "
            f"ms (window {row.window_ms:.1f}, of it FFN {row.ffn_ms:.1f}; wire "
            f"{row.wire_comm_ms:.2f}, path {row.path_ms:.2f})"
        )
    return lines


def _impairment_lines(ok: pd.DataFrame) -> list[str]:
    """What the impairments did over the run, where it had any."""
    if not impaired(ok):
        return []
    words = trial_impairments(ok.sort_values("link_delay_ms"))
    links = " | ".join(dict.fromkeys(word for word in words if word))
    counted = ["link_lost_frames", "link_duplicated_frames", "link_reordered_frames"]
    per = ok.groupby(["trial_id", "repeat"])[counted].max()  # each device sees every port
    frames = ", ".join(
        f"{column.split('_')[1]} {int(per[column].sum())}"
        for column in counted
        if per[column].notna().any()
    )
    resent = ok["tcp_retransmits"].dropna() if "tcp_retransmits" in ok else pd.Series([])
    lines = [f"impaired links ({links}): p95 and p99 over repetitions of the slowest device"]
    if frames:
        lines.append(f"  frames the serial emulator {frames} (over all inferences)")
    if len(resent):
        lines.append(
            f"  TCP retransmissions: {int(resent.sum())} in all, at most "
            f"{int(resent.max())} in one device's inference"
        )
    return ["", *lines]


def _stall_lines(ok: pd.DataFrame) -> list[str]:
    """A note when the serial emulator stalled during some inferences (link_stalled_ms)."""
    if "link_stalled_ms" not in ok or not (ok["link_stalled_ms"].fillna(0) > 0).any():
        return []
    per = ok.groupby(["trial_id", "repeat"])["link_stalled_ms"].max()  # the devices' windows
    hit = per[per > 0]
    note = (
        f"link stalls: the machine held the serial emulator up during {len(hit)} of {len(per)} "
        f"inferences ({hit.sum():.1f} ms in all, at most {hit.max():.1f} ms in one; "
        "link_stalled_ms): their communication may read longer than the link's"
    )
    return ["", note]


def impaired(ok: pd.DataFrame) -> bool:
    """Whether the run's links had impairments (the answer then shows the tail)."""
    return "impairments" in ok and ok["impairments"].fillna("").astype(str).str.len().any()


def _extra_columns(ok: pd.DataFrame, keys: list[str], traced: bool) -> dict[str, pd.Series]:
    """Columns after the speedup, by heading: over impaired links the 95th and 99th
    percentiles of the effective latency; over a trace the mean codewords of the levels
    used; with an accuracy study's table the mean accuracy of those levels."""
    extra = {}
    if impaired(ok):
        tail = stats.tails(ok, keys, "effective_ms").set_index(keys)
        extra["p95 ms"], extra["p99 ms"] = tail["effective_ms_p95"], tail["effective_ms_p99"]
    if traced:
        extra["mean K used"] = ok.groupby(keys)["level_k"].mean()
    if "level_accuracy_pct" in ok and ok["level_accuracy_pct"].notna().any():
        extra[LEVEL_ACCURACY] = ok.groupby(keys)["level_accuracy_pct"].mean()
    return extra
