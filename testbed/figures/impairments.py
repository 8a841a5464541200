"""Figures of a run that swept impairments (`link.impairments`).

- effective_vs_delay.png, where the links differ in their one-way delay (and nothing else):
  effective latency per method variant against the delay, with the extended model's (dotted:
  messages x the wait per message, max(0, wire + path + delay - window), from each variant's
  latency at the first delay): Voltage and Prism wait for the whole delay at every block,
  Trace-b stays flat while its messages hide behind the FFN, then climbs as they do;
- tail_by_link.png, for any run over several impaired links: per link and variant the median
  effective latency (marker), its 95% interval and the 99th percentile (the whisker's end),
  on a log axis: loss shows in the tail, not the median; a panel per device count.
Per repetition the slowest device counts (the inference ends with it).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from testbed.figures.common import (
    CONFIDENCE,
    interval_caption,
    panels,
    plain_log,
    save,
    styles,
    yerr,
)
from testbed.results import stats
from testbed.results.impairment_study import delay_table
from testbed.results.store import Results
from testbed.results.variants import link_labels, swept_impairments, variant_order


def effective_vs_delay(results: Results, path: Path) -> Path | None:
    ok = results.ok_trials()
    if not swept_impairments(ok):
        return None
    by_delay = ok.groupby(["bandwidth_mbit", "link_delay_ms"])["impairments"].nunique()
    if by_delay.max() > 1:
        return None  # links that differ in more than their delay
    keys = ["variant", "devices", "bandwidth_mbit", "link_delay_ms"]
    table = stats.summarize(ok, keys, ["effective_ms"], "max", CONFIDENCE)
    style = styles(ok)
    model = delay_table(results)
    panels = sorted(set(zip(ok["devices"], ok["bandwidth_mbit"], strict=True)))
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5), squeeze=False)
    for ax, (devices, rate) in zip(axes[0], panels, strict=True):
        part = table[(table["devices"] == devices) & (table["bandwidth_mbit"] == rate)]
        rows_here = ok[(ok["devices"] == devices) & (ok["bandwidth_mbit"] == rate)]
        for name in variant_order(ok):
            rows = part[part["variant"] == name].sort_values("link_delay_ms")
            if rows.empty:
                continue
            look = style[name]
            ax.errorbar(
                rows["link_delay_ms"],
                rows["effective_ms"],
                yerr=yerr(rows, "effective_ms"),
                color=look.colour,
                marker=look.marker,
                capsize=3,
                label=name,
            )
            first = rows.iloc[0]
            delays = np.array(rows["link_delay_ms"])
            waits = _model_waits(model, name, devices, rate, delays)
            if waits is None:  # no layers: every message waits for the whole delay
                waits = delays
            added = (waits - waits[0]) * _messages(rows_here, name)
            ax.plot(
                delays,
                first["effective_ms"] + added,
                color=look.colour,
                linestyle=":",
                linewidth=1.2,
            )
        ax.set_xlabel("one-way delay of every link (ms)")
        ax.set_title(f"P = {devices} devices, {rate:g} Mbit/s", fontsize=10)
        plain_log(ax, "y")
    axes[0, 0].set_ylabel("effective latency per inference (ms), slowest device")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.88), fontsize=8)
    fig.suptitle(
        "Effective latency against one-way delay; dotted: the model, from the first delay's "
        "latency + messages x its wait per message,\nmax(0, wire + path + delay - window) "
        "(testbed.results.impairment_study)\n"
        f"{interval_caption(table)}",
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, path)


def _model_waits(
    model: pd.DataFrame, name: str, devices: int, rate: float, delays: np.ndarray
) -> np.ndarray | None:
    """The model's wait per message of `name` at each delay (None where it has none)."""
    if model.empty:
        return None
    rows = model[
        (model["variant"] == name)
        & (model["devices"] == devices)
        & (model["bandwidth_mbit"] == rate)
    ].set_index("link_delay_ms")["predicted_wait_ms"]
    if not set(delays) <= set(rows.index):
        return None
    return rows.reindex(delays).to_numpy()


def _messages(ok: pd.DataFrame, name: str) -> float:
    """Messages per inference a device of `name` waits for: analytic_delay_ms / delay."""
    rows = ok[(ok["variant"] == name) & (ok["link_delay_ms"] > 0)]
    if rows.empty:
        return 0.0
    return float((rows["analytic_delay_ms"] / rows["link_delay_ms"]).median())


def tail_by_link(results: Results, path: Path) -> Path | None:
    """One panel per device count (a link's tail differs with the devices that share it)."""
    ok = results.ok_trials()
    if not swept_impairments(ok):
        return None
    ok["link"], links = link_labels(ok, "bandwidth_mbit")
    keys = ["variant", "devices", "link"]
    table = stats.summarize(ok, keys, ["effective_ms"], "max", CONFIDENCE)
    tails = stats.tails(ok, keys, "effective_ms").set_index(keys)
    table = table.join(tails, on=keys)
    order = variant_order(ok)
    counts = sorted(ok["devices"].unique())
    width = max(8.0, 1.4 * len(links) * len(order) / 3)
    fig, axes = panels(len(counts), width, 5)
    for ax, devices in zip(axes, counts, strict=True):
        at = table[table["devices"] == devices]
        _tails_panel(ax, at, [link for link in links if (at["link"] == link).any()], order, ok)
        ax.set_title(f"P = {devices} devices", fontsize=10)
    axes[0].set_ylabel("effective latency per inference (ms), slowest device")
    legend = {}  # variant -> its marker, from whichever panel draws it
    for ax in axes:
        handles, labels = ax.get_legend_handles_labels()
        legend.update(zip(labels, handles, strict=True))
    fig.legend(
        [legend[name] for name in order if name in legend],
        [name for name in order if name in legend],
        loc="upper left",
        bbox_to_anchor=(1.0, 0.88),
        fontsize=8,
    )
    fig.suptitle(
        "Median (marker, 95% interval) and 99th percentile (whisker's end) per link\n"
        f"{interval_caption(table)}",
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, path)


def _tails_panel(
    ax: Axes, table: pd.DataFrame, links: list[str], order: list[str], ok: pd.DataFrame
) -> None:
    """One device count's links: per variant its median, interval and 99th percentile."""
    style = styles(ok)
    width = 0.8 / len(order)
    for index, name in enumerate(order):
        rows = table[table["variant"] == name].set_index("link").reindex(links)
        if rows["effective_ms"].isna().all():
            continue
        x = np.arange(len(links)) + (index - (len(order) - 1) / 2) * width
        look = style[name]
        median = rows["effective_ms"]
        ax.errorbar(
            x,
            median,
            yerr=yerr(rows, "effective_ms"),
            color=look.colour,
            marker=look.marker,
            linestyle="none",
            capsize=2,
            label=name,
        )
        ax.vlines(x, median, rows["effective_ms_p99"], color=look.colour, linewidth=1, alpha=0.6)
        ax.scatter(x, rows["effective_ms_p99"], color=look.colour, marker="_", s=60)
    ax.set_xticks(np.arange(len(links)), links, rotation=20, ha="right", fontsize=8)
    plain_log(ax, "y")
