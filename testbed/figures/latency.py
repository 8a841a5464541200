"""Figures of where the time and the bits go: the latency breakdown and the compression ratio.

- latency.png: per method variant, a device's effective latency split into compute and the
  three parts of waiting (a peer still computing, the message on the link, the thread waking
  up), one panel per link (rate, and impairments where the run swept them: the paper's
  Fig. 5 kind). Each panel has its own scale, set
  by the variants within `OUTLIER_FACTOR` of the panel's median: a bar far longer (Voltage
  at 10 Mbit/s is 13x the others) is cut at the panel's edge and says its length and its
  share on the link, so the others stay readable at every rate;
- compression.png: payload bits per layer of Voltage over each variant's (Fig. 7 kind),
  computed from the plan, so without spread.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from testbed.figures.common import CONFIDENCE, interval_caption, save, styles, yerr
from testbed.results import stats
from testbed.results.store import Results
from testbed.results.variants import BASELINE, link_labels, variant, variant_order

PARTS = [
    ("compute_ms", "compute", "#2f5d8a"),
    ("wait_peer_ms", "waiting: a peer still computing", "#f2a541"),
    ("wait_link_ms", "waiting: message on the link", "#c0392b"),
    ("wait_wakeup_ms", "waiting: thread wake-up after arrival", "#b0b0b0"),
]
BAR_IN = 0.26  # figure height per bar
OUTLIER_FACTOR = 3.0  # a bar longer than this times the panel's median is cut at the edge
MARGIN = 1.15  # the panel's scale: its longest uncut bar (and its interval) times this


def latency_breakdown(results: Results, path: Path) -> Path | None:
    """Compute and wait parts per variant, one panel per link rate, each on its own scale."""
    ok = results.ok_trials()
    if ok.empty:
        return None
    ok["link"], links = link_labels(ok, "bandwidth_mbit")
    values = [part for part, _, _ in PARTS] + ["effective_ms"]
    table = stats.summarize(ok, ["variant", "devices", "link"], values, "mean", CONFIDENCE)
    rows = _row_keys(ok)
    height = BAR_IN * len(rows) * len(links) + 0.5 * len(links) + 1.2
    fig, axes = plt.subplots(len(links), 1, figsize=(9, height), squeeze=False)
    for ax, link in zip(axes[:, 0], links, strict=True):
        _breakdown_panel(ax, table[table["link"] == link], rows)
        ax.set_title(link, loc="left", fontsize=9, fontweight="bold")
    axes[-1, 0].set_xlabel("latency per inference, per device (ms; each rate on its own scale)")
    effective = Line2D(
        [],
        [],
        color="black",
        marker="|",
        markersize=10,
        label="effective latency: median,\nbars as in the title",
    )
    handles = [Patch(color=colour, label=label) for _, label, colour in PARTS] + [effective]
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 0.9), fontsize=8)
    fig.suptitle(
        "Where a device's time goes, at every link rate (per repetition: mean of the devices)\n"
        f"segments: median of each part; {interval_caption(table)}",
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, path)


def _row_keys(ok: pd.DataFrame) -> list[tuple[str, int]]:
    present = set(zip(ok["variant"], ok["devices"], strict=True))
    counts = sorted({devices for _, devices in present})
    return [(v, p) for p in counts for v in variant_order(ok) if (v, p) in present]


def _breakdown_panel(ax: Axes, table: pd.DataFrame, rows: list[tuple[str, int]]) -> None:
    table = table.set_index(["variant", "devices"]).reindex(rows)
    y = np.arange(len(rows))
    effective = table["effective_ms"].to_numpy()
    limit = panel_limit(effective, table["effective_ms_high"].to_numpy())
    left = np.zeros(len(rows))
    for column, _, colour in PARTS:
        widths = table[column].fillna(0).to_numpy()
        shown = np.clip(left + widths, None, limit) - np.clip(left, None, limit)
        ax.barh(y, shown, left=np.clip(left, None, limit), height=0.72, color=colour)
        left += widths
    cut = effective > limit
    ax.errorbar(
        np.where(cut, np.nan, effective),
        y,
        xerr=yerr(table, "effective_ms"),
        color="black",
        marker="|",
        markersize=10,
        linestyle="none",
        capsize=3,
        linewidth=1,
    )
    for index in np.flatnonzero(cut):
        link = table["wait_link_ms"].iloc[index] / effective[index]
        text = f"{effective[index]:,.0f} ms ({link:.0%} on the link) \u25b8"
        ax.text(limit, y[index], text, ha="right", va="center", fontsize=7, color="white")
    ax.set_xlim(0, limit)
    several = len({p for _, p in rows}) > 1
    ax.set_yticks(y, [f"{v} (P={p})" if several else v for v, p in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -0.6)  # first variant on top
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)


def panel_limit(effective: np.ndarray, high: np.ndarray) -> float:
    """A panel's scale: its longest bar within OUTLIER_FACTOR of the median (with the bar's
    interval) times MARGIN; longer bars are cut there."""
    present = ~np.isnan(effective)
    median = float(np.median(effective[present]))
    kept = present & (effective <= OUTLIER_FACTOR * median)
    return MARGIN * float(np.nanmax(np.fmax(effective[kept], high[kept])))


def compression(results: Results, path: Path) -> Path | None:
    """Voltage's (the baseline's) payload bits per layer over each variant's, device 0, per
    device count."""
    plan = results.plan
    if plan.empty or BASELINE not in set(plan["method"]):
        return None
    plan = plan[plan["rank"] == 0].copy()
    plan["variant"] = variant(plan)
    bits = plan.groupby(["devices", "variant"])["payload_bits_per_layer"].mean()
    style = styles(plan)
    labels, ratios, colours = [], [], []
    several = plan["devices"].nunique() > 1
    for devices in sorted(plan["devices"].unique()):
        if (devices, BASELINE) not in bits.index:
            continue
        for name in variant_order(plan[plan["devices"] == devices]):
            ratios.append(bits[(devices, BASELINE)] / bits[(devices, name)])
            labels.append(f"{name} (P={devices})" if several else name)
            colours.append(style[name].colour)
    fig, ax = plt.subplots(figsize=(8, BAR_IN * len(labels) + 1.4))
    bars = ax.barh(labels, ratios, color=colours, height=0.7)
    texts = ax.bar_label(bars, labels=[f"{r:,.0f}x" for r in ratios], fontsize=8, padding=3)
    ax.set_xscale("log")
    ax.set_ylim(len(labels) - 0.4, -0.6)
    ax.set_xlabel("compression ratio against Voltage: its payload bits per layer / the variant's")
    ax.set_title("Payload compression (device 0, computed from the plan: no spread)", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    _fit_labels(ax, texts, ratios, left=0.5)  # after the layout: it needs the final width
    return save(fig, path)


def _fit_labels(ax: Axes, texts: list, ends: list[float], left: float) -> None:
    """Widen a log x axis so that every bar's label ends inside the frame."""
    ax.set_xlim(left, max(ends))
    ax.figure.canvas.draw()
    width_px = ax.get_window_extent().width
    low = np.log10(left)
    right = np.log10(max(ends)) + 0.05
    for text, end in zip(texts, ends, strict=True):
        share = (text.get_window_extent().width + 12) / width_px  # label, padding and margin
        right = max(right, low + (np.log10(end) - low) / (1 - share))
    ax.set_xlim(left, 10**right)
