"""Medians with distribution-free confidence intervals, for repetitions of a trial.

A trial's repetitions are few (3 to 20) and their distribution is skewed (a slow minute of the
shared host, a retransmission), so the testbed reports medians with the confidence interval of
the median from order statistics: with the values sorted, x_(j) <= median <= x_(n+1-j) holds
with probability P(j <= B <= n - j), B ~ binomial(n, 1/2), whatever the distribution. The
narrowest such pair reaching the asked confidence is used, and `level` says the coverage it
actually has. Below six repetitions no pair reaches 95%: the interval is then [min, max] and
its lower level is stated, never a narrower interval.

Methods are compared by ratios of repetitions paired in time (a session runs the repetitions
of its trials interleaved, so repetition i of two methods saw the same state of the host).

A link's counts and delays (testbed.results.fidelity) use two more: the Wilson score interval
of a proportion (frames lost of frames drawn), and the distribution-free interval of any
quantile from order statistics, as the median's above with binomial(n, q).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

import numpy as np
import pandas as pd

Aggregate = Literal["mean", "max"]


@dataclass(frozen=True)
class Interval:
    """A median and its confidence interval.

    Attributes:
        n: values used (NaNs dropped).
        median: their median.
        low: lower bound (an order statistic).
        high: upper bound (an order statistic).
        level: coverage the interval actually has (>= the asked confidence when n allows).
    """

    n: int
    median: float
    low: float
    high: float
    level: float


@functools.lru_cache(maxsize=1024)
def order_statistic_rank(n: int, confidence: float = 0.95) -> tuple[int, float]:
    """The 1-based rank j of the interval [x_(j), x_(n+1-j)] and its coverage.

    The largest j (narrowest interval) whose coverage 1 - 2 P(B <= j - 1) reaches
    `confidence`; j = 1 ([min, max], coverage 1 - 2^(1-n)) when none does.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, not {confidence}")
    if n < 1:
        raise ValueError(f"need at least one value, not {n}")
    total = 2**n
    rank, tail = 1, 1  # tail = sum of C(n, i) for i < rank: P(B <= rank - 1) * 2^n
    while rank + 1 <= (n + 1) // 2:
        next_tail = tail + math.comb(n, rank)
        if 1 - 2 * next_tail / total < confidence:
            break
        rank, tail = rank + 1, next_tail
    return rank, 1 - 2 * tail / total


def median_interval(
    values: Sequence[float] | np.ndarray | pd.Series, confidence: float = 0.95
) -> Interval:
    """The median of `values` (NaNs ignored) with its distribution-free interval."""
    data = pd.Series(values).astype("float64").to_numpy()  # pd.NA of Int64/Float64 too
    data = np.sort(data[~np.isnan(data)])
    n = len(data)
    if n == 0:
        return Interval(0, math.nan, math.nan, math.nan, math.nan)
    rank, level = order_statistic_rank(n, confidence)
    return Interval(n, float(np.median(data)), float(data[rank - 1]), float(data[n - rank]), level)


def paired_ratio_interval(
    numerator: pd.Series, denominator: pd.Series, confidence: float = 0.95
) -> Interval:
    """Median of numerator_i / denominator_i over repetitions i, with its interval.

    Args:
        numerator: one value per repetition, indexed by repetition.
        denominator: the same for the other method; only repetitions in both are used.
        confidence: asked coverage of the interval.
    """
    for series in (numerator, denominator):
        if not series.index.is_unique:
            raise ValueError("one value per repetition expected: aggregate the devices first")
    numerator, denominator = numerator.align(denominator, join="inner")
    ratios = numerator.astype(float) / denominator.astype(float)
    return median_interval(ratios.to_numpy(), confidence)


def by_repetition(
    frame: pd.DataFrame, keys: list[str], values: list[str], how: Aggregate = "mean"
) -> pd.DataFrame:
    """One row per group of `keys` and repetition: `values` aggregated over its devices.

    Only rows with status ok. `how`: "mean" over devices, or "max" (an inference ends when
    its slowest device does). Returns `keys`, "repeat" and `values` as columns.
    """
    if how not in ("mean", "max"):
        raise ValueError(f"per-repetition aggregate must be 'mean' or 'max', not {how!r}")
    ok = frame[frame["status"] == "ok"] if "status" in frame else frame
    numbers = ok[values].astype(float)
    grouped = numbers.groupby([ok[k] for k in keys + ["repeat"]], dropna=False, sort=False)
    return grouped.agg(how).reset_index()


def tails(frame: pd.DataFrame, keys: list[str], value: str, how: Aggregate = "max") -> pd.DataFrame:
    """Per group of `keys`, the 95th and 99th percentiles over repetitions of `value`
    (aggregated over each repetition's devices): `<value>_p95`, `<value>_p99` (linear
    interpolation; with few repetitions the 99th is close to the largest)."""
    per = by_repetition(frame, keys, [value], how)
    grouped = per.groupby(keys, dropna=False)[value]
    return pd.DataFrame(
        {f"{value}_p95": grouped.quantile(0.95), f"{value}_p99": grouped.quantile(0.99)}
    ).reset_index()


def summarize(
    frame: pd.DataFrame,
    keys: list[str],
    values: list[str],
    per_repetition: Aggregate = "mean",
    confidence: float = 0.95,
) -> pd.DataFrame:
    """Medians over repetitions with their intervals, per group of `keys`.

    Args:
        frame: rows of one device and repetition each (trials); only status ok is used.
        keys: the grouping columns, e.g. method, params, devices, bandwidth_mbit.
        values: the columns to summarize.
        per_repetition: how a repetition's devices are combined first: "mean" or "max".
        confidence: asked coverage of the intervals.

    Returns:
        One row per group: `keys`, `n` (repetitions), per value v the columns v (median),
        v_low and v_high, and `level`: the lowest coverage among the values' intervals (they
        share it unless a value is missing in some repetitions).
    """
    repetitions = by_repetition(frame, keys, values, per_repetition)
    rows = []
    for group, part in repetitions.groupby(keys, dropna=False, sort=True):
        row = dict(zip(keys, group, strict=True))
        row["n"] = len(part)
        levels = []
        for value in values:
            interval = median_interval(part[value].to_numpy(), confidence)
            row[value] = interval.median
            row[f"{value}_low"], row[f"{value}_high"] = interval.low, interval.high
            levels.append(interval.level)
        row["level"] = np.nanmin(levels) if not np.isnan(levels).all() else math.nan
        rows.append(row)
    columns = keys + ["n"] + [f"{v}{s}" for v in values for s in ("", "_low", "_high")]
    table = pd.DataFrame(rows, columns=columns + ["level"])
    return table.astype({key: frame[key].dtype for key in keys})


def proportion_interval(
    successes: int, n: int, confidence: float = 0.99, design_effect: float = 1.0
) -> tuple[float, float]:
    """The Wilson score interval of a proportion, `successes` of `n` independent draws.

    `design_effect` (>= 1): the variance of the count over the binomial's, for draws that
    come in runs (a Markov chain's); the interval is then that of n / design_effect draws.
    (nan, nan) for n = 0."""
    if n <= 0:
        return math.nan, math.nan
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    n_eff = n / design_effect
    p = successes / n
    centre = p + z * z / (2 * n_eff)
    spread = z * math.sqrt(p * (1 - p) / n_eff + z * z / (4 * n_eff * n_eff))
    scale = 1 + z * z / n_eff
    low = 0.0 if successes == 0 else (centre - spread) / scale  # exact at the ends
    high = 1.0 if successes == n else (centre + spread) / scale
    return max(0.0, low), min(1.0, high)


def _binomial_cdf(n: int, q: float) -> np.ndarray:
    """P(B <= k) for k = 0..n, B ~ binomial(n, q), from the terms' logarithms (n of thousands)."""
    k = np.arange(n + 1)
    log_terms = np.array(
        [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in k]
    )
    log_terms += k * math.log(q) + (n - k) * math.log1p(-q)
    return np.minimum(np.cumsum(np.exp(log_terms)), 1.0)


def quantile_interval(
    values: Sequence[float] | np.ndarray, q: float, confidence: float = 0.99
) -> Interval:
    """The `q` quantile of `values` (NaNs ignored) with its distribution-free interval
    [x_(j), x_(k)]: x_(j) <= the quantile <= x_(k) with probability P(j <= B <= k - 1), B ~
    binomial(n, q), whatever the distribution, each tail at most (1 - confidence) / 2. Where n
    is too small for that, the bound is the smallest or largest value, and `level` says the
    coverage the interval has. `median` holds the sample quantile (linear interpolation)."""
    if not 0 < q < 1:
        raise ValueError(f"a quantile lies between 0 and 1, not {q}")
    data = np.sort(np.asarray(values, dtype="float64"))
    data = data[~np.isnan(data)]
    n = len(data)
    if n == 0:
        return Interval(0, math.nan, math.nan, math.nan, math.nan)
    cdf, tail = _binomial_cdf(n, q), (1 - confidence) / 2
    # j: the largest with P(B <= j - 1) <= tail; k: the smallest with P(B >= k) <= tail
    low = max(1, int(np.searchsorted(cdf, tail, side="right")))
    high = min(n, max(low + 1, int(np.searchsorted(cdf, 1 - tail, side="left")) + 1))
    level = float(cdf[high - 1] - cdf[low - 1])
    sample = float(np.quantile(data, q))
    return Interval(n, sample, float(data[low - 1]), float(data[min(high, n) - 1]), level)
