"""timeline.png: a run with a timeline of device events (`timeline`), inference by inference.

Per device count and session (a rate, an impairment or fleet variant), the effective latency of
every measured inference of every variant (the slowest device's), against the inference's
index, with a vertical line before the first inference that ran under each event (the rows
name them, testbed.results.rows.events_felt; a leave is marked at the inference it cut short,
whose rows failed). Under it, every device's speed in force. One column of panels per session.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from testbed.figures.common import save, styles
from testbed.results.store import Results
from testbed.results.variants import variant_order


def timed(results: Results) -> pd.DataFrame:
    """The ok rows of a run whose rows name events; empty otherwise."""
    ok = results.ok_trials()
    if "events" not in ok or not ok["events"].fillna("").astype(str).str.len().any():
        return pd.DataFrame()
    return ok


def timeline_figure(results: Results, path: Path) -> Path | None:
    ok = timed(results)
    if ok.empty:
        return None
    sessions = list(dict.fromkeys(ok.sort_values("planned")["session_id"]))
    style = styles(ok)
    fig, axes = plt.subplots(
        2,
        len(sessions),
        figsize=(8 * len(sessions), 7),
        sharex="col",
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 1]},
    )
    for column, session in enumerate(sessions):
        part = ok[ok["session_id"] == session]
        latency, speed = axes[0, column], axes[1, column]
        slowest = part.groupby(["variant", "repeat"])["effective_ms"].max().reset_index()
        for name in variant_order(part):
            rows = slowest[slowest["variant"] == name]
            look = style[name]
            latency.plot(
                rows["repeat"],
                rows["effective_ms"],
                marker=look.marker,
                color=look.colour,
                label=name,
            )
        for at, label in _event_marks(results.trials[results.trials["session_id"] == session]):
            for ax in (latency, speed):
                ax.axvline(at - 0.5, color="grey", linestyle="--", linewidth=1)
            latency.annotate(
                label,
                (at - 0.5, 1),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=8,
            )
        latency.set_yscale("log")
        latency.set_ylabel("effective latency (ms), slowest device")
        latency.set_title(f"session {session} ({part['repeat'].nunique()} inferences per variant)")
        latency.legend(fontsize=8)
        speeds = part.groupby(["rank", "repeat"])["device_speed"].median().reset_index()
        for rank, rows in speeds.groupby("rank"):
            speed.step(rows["repeat"], rows["device_speed"], where="mid", label=f"device {rank}")
        speed.set_ylim(0, max(1.0, speeds["device_speed"].max()) * 1.05)
        speed.set_ylabel("speed in force")
        speed.set_xlabel("measured inference (index within each variant)")
        speed.legend(fontsize=8)
    return save(fig, path)


def _event_marks(rows: pd.DataFrame) -> list[tuple[int, str]]:
    """Per event label ("speed d1=0.5 at 2 s"), the first inference whose rows name it."""
    marks: dict[str, int] = {}
    for repeat, text in rows.sort_values("repeat")[["repeat", "events"]].itertuples(index=False):
        for label in str(text or "").split("; "):
            if label and label not in marks and repeat >= 0:
                marks[label] = int(repeat)
    return [(at, label) for label, at in marks.items()]
