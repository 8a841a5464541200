"""Figures against the link rate, one panel per device count.

Measured values are medians over repetitions with distribution-free 95% intervals of the median as
error bars (`testbed.results.stats`; every figure states n). Per repetition the devices are
averaged, except for effective latency, where the slowest device counts (the inference ends with
it).

- effective_vs_bandwidth.png: effective latency per method variant against the link rate;
- comm_vs_bandwidth.png: measured communication against the link rate, log-log, with each
  variant's wire time (dashed) and the paper's analytic time (dotted) (Fig. 6 kind);
- measured_vs_analytic.png: measured communication against the wire time and against the
  analytic time, coloured by rate, with the line y = x.

None of them for a run that swept impairments (`link.impairments`): they would pool its links;
the figures of `impairments` take their place.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from testbed.figures.common import (
    interval_caption,
    intervals,
    panels,
    plain_log,
    rate_axis,
    save,
    styles,
    yerr,
)
from testbed.results.stats import Aggregate
from testbed.results.store import Results
from testbed.results.variants import swept_impairments, variant_order

REFERENCE_LINES = [
    Line2D([], [], color="grey", linestyle=style, label=label)
    for style, label in (
        ("--", "wire: frames carried / rate\n(headers included)"),
        (":", "analytic: payload bits / rate\n(the paper's model)"),
    )
]


def _by_rate(
    results: Results, path: Path, value: str, how: Aggregate, title: str, ylabel: str
) -> Path | None:
    """A figure of `value` against the link rate, one panel per device count."""
    ok = results.ok_trials()
    if ok.empty or ok["bandwidth_mbit"].nunique() < 2 or swept_impairments(ok):
        return None
    references = ["wire_comm_ms", "analytic_comm_ms"] if value == "comm_ms" else []
    table = intervals(ok, [value] + references, how)
    rates = sorted(ok["bandwidth_mbit"].unique())
    devices = sorted(ok["devices"].unique())
    fig, axes = panels(len(devices), 7.0, 5.0)
    for ax, count in zip(axes, devices, strict=True):
        _draw_variants(ax, ok, table[table["devices"] == count], value, references)
        rate_axis(ax, rates)
        plain_log(ax, "y")
        ax.set_title(f"P = {count} devices", fontsize=10)
    axes[0].set_ylabel(ylabel)
    handles = axes[0].get_legend_handles_labels()[0] + (REFERENCE_LINES if references else [])
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 0.88), fontsize=8)
    fig.suptitle(f"{title}\n{interval_caption(table)}", fontsize=10)
    fig.tight_layout()
    return save(fig, path)


def _draw_variants(
    ax: Axes, ok: pd.DataFrame, table: pd.DataFrame, value: str, references: list[str]
) -> None:
    style = styles(ok)
    for name in variant_order(ok):
        rows = table[table["variant"] == name].sort_values("bandwidth_mbit")
        if rows.empty:
            continue
        look = style[name]
        ax.errorbar(
            rows["bandwidth_mbit"] * look.offset,
            rows[value],
            yerr=yerr(rows, value),
            color=look.colour,
            marker=look.marker,
            markersize=5,
            capsize=3,
            linewidth=1.5,
            label=name,
        )
        for column, dashes in zip(references, ("--", ":"), strict=False):
            ax.plot(
                rows["bandwidth_mbit"],
                rows[column],
                color=look.colour,
                linestyle=dashes,
                linewidth=1.1,
                alpha=0.8,
            )


def comm_vs_bandwidth(results: Results, path: Path) -> Path | None:
    return _by_rate(
        results,
        path,
        "comm_ms",
        "mean",
        "Communication per inference against link rate\nfrom a message's departure to the "
        "slowest peer's kernel receive timestamp; per repetition the mean of the devices",
        "communication per inference (ms)",
    )


def effective_vs_bandwidth(results: Results, path: Path) -> Path | None:
    return _by_rate(
        results,
        path,
        "effective_ms",
        "max",
        "Effective latency against link rate\nper repetition the slowest device (the inference "
        "ends with it)",
        "effective latency per inference (ms)",
    )


def measured_vs_analytic(results: Results, path: Path) -> Path | None:
    """Measured communication against the wire time (left) and the analytic time (right)."""
    ok = results.ok_trials()
    ok = ok[ok["analytic_comm_ms"] > 0]
    if ok.empty or swept_impairments(ok):
        return None
    table = intervals(ok, ["comm_ms", "wire_comm_ms", "analytic_comm_ms"])
    rates = sorted(table["bandwidth_mbit"].unique())
    colours = dict(zip(rates, _rate_colours(len(rates)), strict=True))
    markers = {name: look.marker for name, look in styles(ok).items()}
    errors = yerr(table, "comm_ms")
    fig, axes = panels(2, 5.0, 5.0)
    for ax, column in zip(axes, ["wire_comm_ms", "analytic_comm_ms"], strict=True):
        for i, row in enumerate(table.itertuples()):
            ax.errorbar(
                getattr(row, column),
                row.comm_ms,
                yerr=errors[:, i : i + 1],
                color=colours[row.bandwidth_mbit],
                marker=markers[row.variant],
                markersize=6,
                capsize=2,
                linestyle="none",
                markeredgecolor="black",
                markeredgewidth=0.4,
            )
        _identity_line(ax, table, column)
        plain_log(ax, "x")
        plain_log(ax, "y")
    axes[0].set_xlabel("wire: frames carried x 8 / rate (ms)")
    axes[1].set_xlabel("analytic: payload bits / rate (ms)")
    axes[0].set_ylabel("measured: queued to the last peer's kernel (ms)")
    _variant_and_rate_legends(fig, {v: markers[v] for v in variant_order(ok)}, colours)
    title = "Measured communication per inference against the wire and analytic times"
    fig.suptitle(f"{title}\n{interval_caption(table)}; mean of the devices", fontsize=10)
    fig.tight_layout()
    return save(fig, path)


def _variant_and_rate_legends(
    fig: Figure, markers: dict[str, str], colours: dict[float, tuple[float, ...]]
) -> None:
    """Two legends right of the panels: markers are variants, colours are link rates."""
    variants = [
        Line2D([], [], color="grey", marker=marker, linestyle="none", label=name)
        for name, marker in markers.items()
    ]
    rates = [
        Line2D([], [], color=colour, marker="o", linestyle="none", label=f"{rate:g} Mbit/s")
        for rate, colour in colours.items()
    ]
    fig.legend(
        handles=variants, title="variant", loc="upper left", bbox_to_anchor=(1.0, 0.88), fontsize=8
    )
    fig.legend(
        handles=rates, title="link rate", loc="lower left", bbox_to_anchor=(1.0, 0.08), fontsize=8
    )


def _rate_colours(count: int) -> list[tuple[float, ...]]:
    cmap = colormaps["viridis"]
    return [cmap(0.9 * i / max(count - 1, 1)) for i in range(count)]


def _identity_line(ax: Axes, table: pd.DataFrame, column: str) -> None:
    values = pd.concat([table[column], table["comm_ms_low"], table["comm_ms_high"]])
    values = values[values > 0]
    low, high = values.min() / 1.5, values.max() * 1.5
    ax.plot([low, high], [low, high], color="grey", linestyle="--", linewidth=1, zorder=0)
    ax.text(high, high, "y = x ", ha="right", va="bottom", fontsize=8, color="grey")
    ax.set_xlim(low, high)
    ax.grid(True, which="major", alpha=0.3)
