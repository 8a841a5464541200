"""What every figure of a run shares: variant names, their order and style, intervals, axes.

Every figure lists the method variants in one order (`variant_order`: voltage, prism, astra,
trace-nb, trace-b, each by decreasing tree level) and draws each variant in one colour and
marker (`styles`), so a variant looks the same in every figure. Measured values are medians
over repetitions with distribution-free 95% intervals (`testbed.results.stats`); `interval_caption`
says so, with n, in words a figure can carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogFormatter, NullLocator  # noqa: E402

from testbed.results import stats  # noqa: E402
from testbed.results.store import write_atomic  # noqa: E402
from testbed.results.variants import variant, variant_order  # noqa: E402

METHOD_COLOURS = {
    "single": "#555555",
    "voltage": "#d62728",
    "prism": "#ff7f0e",
    "astra": "#2ca02c",
    "trace-nb": "#9467bd",
    "trace-b": "#1f77b4",
}
OTHER_COLOURS = ("#8c564b", "#e377c2", "#17becf", "#bcbd22")
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "<", ">", "h", "p")
OFFSET_DECADES = 0.012  # horizontal spread between variants on a log rate axis
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Style:
    colour: tuple[float, float, float]
    marker: str
    offset: float  # factor on the x position (log axes): coinciding variants stay apart


def styles(frame: pd.DataFrame) -> dict[str, Style]:
    """A colour (one hue per method, lighter for coarser variants), a marker and an x offset
    per variant of `frame`, in `variant_order`."""
    order = variant_order(frame)
    methods = frame.assign(variant=variant(frame)).drop_duplicates("variant")
    method_of = dict(zip(methods["variant"], methods["method"].astype(str), strict=True))
    others = iter(OTHER_COLOURS * len(order))
    hues = {m: METHOD_COLOURS.get(m) or next(others) for m in dict.fromkeys(method_of.values())}
    result = {}
    for index, name in enumerate(order):
        siblings = [v for v in order if method_of[v] == method_of[name]]
        lighten = 0.55 * siblings.index(name) / max(len(siblings) - 1, 1)
        colour = tuple(c + (1 - c) * lighten for c in to_rgb(hues[method_of[name]]))
        offset = 10 ** (OFFSET_DECADES * (index - (len(order) - 1) / 2))
        result[name] = Style(colour, MARKERS[index % len(MARKERS)], offset)  # type: ignore[arg-type]
    return result


def intervals(ok: pd.DataFrame, values: list[str], how: stats.Aggregate = "mean") -> pd.DataFrame:
    """Per variant, device count and rate: medians with 95% intervals (`stats.summarize`)."""
    return stats.summarize(ok, ["variant", "devices", "bandwidth_mbit"], values, how, CONFIDENCE)


def yerr(table: pd.DataFrame, value: str) -> np.ndarray:
    """Error-bar lengths below and above the medians of `value`."""
    low = (table[value] - table[f"{value}_low"]).clip(lower=0)
    high = (table[f"{value}_high"] - table[value]).clip(lower=0)
    return np.vstack([low.to_numpy(), high.to_numpy()])


def interval_caption(table: pd.DataFrame) -> str:
    """What the markers and bars of `table` are, with n: 'median of n = 8 repetitions, ...'."""
    n_low, n_high = int(table["n"].min()), int(table["n"].max())
    n_text = f"n = {n_low}" if n_low == n_high else f"n = {n_low}-{n_high}"
    level = float(table["level"].min())
    if level < CONFIDENCE:
        return (
            f"median of {n_text} repetitions; bars: their range "
            f"(a {level:.0%} interval: too few repetitions for 95%)"
        )
    whole_range = stats.order_statistic_rank(n_high, CONFIDENCE)[0] == 1
    return f"median of {n_text} repetitions; bars: 95% CI of the median" + (
        f" (= the range, {level:.1%})" if whole_range else ""
    )


def rate_axis(ax: Axes, rates_mbit: list[float]) -> None:
    """A log x axis with a labelled tick at every rate of the run."""
    ax.set_xscale("log")
    ax.set_xticks(rates_mbit)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlim(min(rates_mbit) / 1.3, max(rates_mbit) * 1.3)
    ax.set_xlabel("link rate (Mbit/s, 10^6 bit/s)")


class _PlainLogFormatter(LogFormatter):
    """Labels between the decades as plain numbers (30000, not 3e+04)."""

    def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
        return f"{x:g}" if x < 1e6 else f"{x:.0e}"


def plain_log(ax: Axes, which: str = "y") -> None:
    """A log axis labelled 0.1, 1, 10 (and 2, 3, 5 between when it spans about a decade)."""
    if which == "x":
        ax.set_xscale("log")
    else:
        ax.set_yscale("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    # labels between the decades where the axis spans less than two of them (one on an x
    # axis, whose labels sit side by side and run into each other sooner)
    thresholds = (1, 0.4) if which == "x" else (2, 0.5)
    axis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False, minor_thresholds=thresholds))
    ax.grid(True, which="major", alpha=0.3)


def panels(count: int, width: float, height: float) -> tuple[plt.Figure, list[Axes]]:
    """`count` panels side by side, sharing the y axis."""
    fig, axes = plt.subplots(1, count, figsize=(width * count, height), sharey=True, squeeze=False)
    return fig, list(axes[0])


def save(fig: plt.Figure, path: Path) -> Path:
    """Written whole or not at all (`write_atomic`: a full disk names the file)."""
    try:
        write_atomic(
            path, lambda tmp: fig.savefig(tmp, format=path.suffix[1:], dpi=120, bbox_inches="tight")
        )
    finally:
        plt.close(fig)
    return path
