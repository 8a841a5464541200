"""trace.png: a run over a replayed bandwidth trace (`link.trace`), inference by inference.

Three panels over the time since the replay started (when each inference began on device 0):
the rate in force on the links, the effective latency of every inference of every variant
(the slowest device's), and the tree level (codewords) each inference used, which moves only
under `level_k: auto`. One figure per device count.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from testbed.plots_common import ok_trials, plain_log, save, styles, variant_order
from testbed.results import Results


def traced(results: Results) -> pd.DataFrame:
    """Per device count, variant and repetition of a trace run: when it started (trace_s),
    the rate then in force and the level, from device 0; the slowest device's effective
    latency. Empty when the run replayed no trace."""
    ok = ok_trials(results)
    if "trace" not in ok or not ok["trace"].fillna("").astype(str).str.len().any():
        return pd.DataFrame()
    keys = ["devices", "variant", "repeat"]
    columns = ["method", "params", "K", "trace_s", "link_rate_mbit", "level_k"]
    first = ok[ok["rank"] == 0].set_index(keys)[columns]
    slowest = ok.groupby(keys)["effective_ms"].max()
    return first.join(slowest).reset_index().sort_values("trace_s")


def trace_timeline(results: Results, path: Path) -> Path | None:
    table = traced(results)
    if table.empty:
        return None
    counts = sorted(table["devices"].unique())
    style = styles(ok_trials(results))
    fig, axes = plt.subplots(3, len(counts), figsize=(9 * len(counts), 8), sharex="col",
                             squeeze=False, gridspec_kw={"height_ratios": [1, 2, 1]})  # fmt: skip
    for column, devices in enumerate(counts):
        rate_ax, latency_ax, level_ax = axes[:, column]
        part = table[table["devices"] == devices]
        rates = part.drop_duplicates("trace_s")
        rate_ax.step(rates["trace_s"], rates["link_rate_mbit"], where="post", color="black")
        rate_ax.set_ylabel("rate in force\n(Mbit/s)")
        rate_ax.set_title(f"P={devices}: {results.config['link'].get('trace')}")
        plain_log(rate_ax)
        for name in variant_order(part):
            rows = part[part["variant"] == name]
            colour, marker = style[name].colour, style[name].marker
            latency_ax.plot(rows["trace_s"], rows["effective_ms"], marker=marker, markersize=3,
                            linewidth=0.8, color=colour, label=name)  # fmt: skip
            level_ax.plot(rows["trace_s"], rows["level_k"], marker=marker, markersize=3,
                          linewidth=0.8, drawstyle="steps-post", color=colour)  # fmt: skip
        latency_ax.set_ylabel("effective latency (ms)\nslowest device")
        latency_ax.legend(fontsize=8)
        latency_ax.grid(True, alpha=0.3)
        level_ax.set_ylabel("codewords at the\nlevel used")
        level_ax.set_yscale("log", base=2)
        level_ax.grid(True, alpha=0.3)
        level_ax.set_xlabel("time since the replay started (s), when each inference began")
    return save(fig, path)
