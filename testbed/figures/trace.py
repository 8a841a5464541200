"""trace.png: a run over a replayed bandwidth trace (`link.trace`), inference by inference.

Panels over the time since the replay started (when each inference began on device 0): the
rate in force on the links, the effective latency of every inference of every variant (the
slowest device's), the tree level (codewords) each inference used, which moves only under
`level_k: auto`, and, with an accuracy study's table (`report.level_accuracy`), the study's
top-1 at that level (`level_accuracy_pct`). Levels and accuracies are device 0's. One column
of panels per device count.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.axes import Axes

from testbed.figures.common import Style, plain_log, save, styles
from testbed.results.store import Results
from testbed.results.variants import variant_order

LEVEL_ACCURACY = "level_accuracy_pct"


def traced(results: Results) -> pd.DataFrame:
    """Per device count, variant and repetition of a trace run: when it started (trace_s),
    the rate then in force, the level and its accuracy (where the run has a table), from
    device 0; the slowest device's effective latency. Empty when the run replayed no trace."""
    ok = results.ok_trials()
    if "trace" not in ok or not ok["trace"].fillna("").astype(str).str.len().any():
        return pd.DataFrame()
    keys = ["devices", "variant", "repeat"]
    columns = ["method", "params", "K", "trace_s", "link_rate_mbit", "level_k"]
    if LEVEL_ACCURACY in ok and ok[LEVEL_ACCURACY].notna().any():
        columns.append(LEVEL_ACCURACY)
    first = ok[ok["rank"] == 0].set_index(keys)[columns]
    slowest = ok.groupby(keys)["effective_ms"].max()
    return first.join(slowest).reset_index().sort_values("trace_s")


def trace_timeline(results: Results, path: Path) -> Path | None:
    table = traced(results)
    if table.empty:
        return None
    counts = sorted(table["devices"].unique())
    style = styles(results.ok_trials())
    accuracy = LEVEL_ACCURACY in table
    heights = [1, 2, 1, 1] if accuracy else [1, 2, 1]
    fig, axes = plt.subplots(
        len(heights),
        len(counts),
        figsize=(9 * len(counts), 2 * sum(heights)),
        sharex="col",
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for column, devices in enumerate(counts):
        part = table[table["devices"] == devices]
        _rate_panel(axes[0, column], part, f"P={devices}: {results.config['link'].get('trace')}")
        _variant_panels(axes[1:, column], part, style)
        axes[-1, column].set_xlabel("time since the replay started (s), when each inference began")
    return save(fig, path)


def _rate_panel(ax: Axes, part: pd.DataFrame, title: str) -> None:
    rates = part.drop_duplicates("trace_s")
    ax.step(rates["trace_s"], rates["link_rate_mbit"], where="post", color="black")
    ax.set_ylabel("rate in force\n(Mbit/s)")
    ax.set_title(title)
    plain_log(ax)


def _variant_panels(axes: list[Axes], part: pd.DataFrame, style: dict[str, Style]) -> None:
    """Latency, level and (with a table) the level's accuracy of every variant over time."""
    latency_ax, level_ax, *rest = axes
    for name in variant_order(part):
        rows = part[part["variant"] == name]
        line = {
            "marker": style[name].marker,
            "markersize": 3,
            "linewidth": 0.8,
            "color": style[name].colour,
        }
        latency_ax.plot(rows["trace_s"], rows["effective_ms"], label=name, **line)
        level_ax.plot(rows["trace_s"], rows["level_k"], drawstyle="steps-post", **line)
        for accuracy_ax in rest:
            accuracy_ax.plot(rows["trace_s"], rows[LEVEL_ACCURACY], drawstyle="steps-post", **line)
    latency_ax.set_ylabel("effective latency (ms)\nslowest device")
    latency_ax.legend(fontsize=8)
    level_ax.set_ylabel("codewords at the\nlevel used")
    level_ax.set_yscale("log", base=2)
    for accuracy_ax in rest:
        accuracy_ax.set_ylabel("top-1 (%) of the\nlevel used (study)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
