import math

import numpy as np
import pandas as pd
import pytest

from testbed.results.stats import (
    Interval,
    by_repetition,
    median_interval,
    order_statistic_rank,
    paired_ratio_interval,
    summarize,
)


def coverage(n: int, rank: int) -> float:
    """P(rank <= B <= n - rank) for B ~ binomial(n, 1/2): the order-statistic interval's."""
    return sum(math.comb(n, i) for i in range(rank, n - rank + 1)) / 2**n


@pytest.mark.parametrize(
    ("n", "rank"),
    [(3, 1), (6, 1), (10, 2), (20, 6)],  # n = 3: too few for 95%, the range and its 75%
)
def test_order_statistics_are_the_narrowest_pair_reaching_95_percent(n, rank):
    assert order_statistic_rank(n, 0.95) == (rank, pytest.approx(coverage(n, rank)))
    assert coverage(n, rank + 1) < 0.95  # the next pair inward misses 95%
    values = np.arange(1.0, n + 1)[::-1]  # unsorted on purpose: n, ..., 1
    interval = median_interval(values)
    assert (interval.low, interval.high) == (rank, n + 1 - rank)  # x_(j), x_(n+1-j)
    assert interval.median == (n + 1) / 2
    assert interval.level == pytest.approx(coverage(n, rank))


def test_levels_match_the_binomial_arithmetic():
    assert order_statistic_rank(3)[1] == 0.75  # 1 - 2 / 2^3
    assert order_statistic_rank(5)[1] == 1 - 2 / 2**5  # 0.9375 < 0.95: still the range
    assert order_statistic_rank(6)[1] == 1 - 2 / 2**6
    assert order_statistic_rank(10)[1] == 1 - 2 * (1 + 10) / 2**10
    assert order_statistic_rank(20)[1] == pytest.approx(
        1 - 2 * sum(math.comb(20, i) for i in range(6)) / 2**20
    )
    assert order_statistic_rank(10, 0.5) == (4, pytest.approx(coverage(10, 4)))


def test_one_value_and_nans():
    assert median_interval([4.0]) == Interval(1, 4.0, 4.0, 4.0, 0.0)
    assert median_interval([float("nan"), 2.0, 1.0, 3.0]) == Interval(3, 2.0, 1.0, 3.0, 0.75)
    empty = median_interval([float("nan")])
    assert empty.n == 0 and math.isnan(empty.median) and math.isnan(empty.level)
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0, 2.0], confidence=95)


def test_interval_covers_the_true_median_of_a_skewed_distribution():
    generator = np.random.default_rng(20261130)
    draws, n = 2000, 12
    samples = generator.lognormal(mean=1.0, sigma=1.0, size=(draws, n))  # median e^1
    covered = [
        interval.low <= math.e <= interval.high
        for interval in (median_interval(sample) for sample in samples)
    ]
    assert np.mean(covered) >= 0.94
    assert median_interval(samples[0]).level == pytest.approx(coverage(n, 3))


def test_paired_ratio_pairs_repetitions_by_index():
    # repetition 2 was slow for both methods (a busy minute): the ratios do not see it
    numerator = pd.Series([10.0, 11.0, 30.0, 10.5], index=[0, 1, 2, 3])
    denominator = pd.Series([100.0, 300.0, 110.0, 105.0], index=[0, 2, 1, 3])
    interval = paired_ratio_interval(numerator, denominator)
    assert interval.n == 4
    assert interval.median == pytest.approx(0.1)
    assert (interval.low, interval.high) == (pytest.approx(0.1), pytest.approx(0.1))
    assert interval.level == pytest.approx(1 - 2 / 2**4)
    short = paired_ratio_interval(numerator, denominator.drop(3))
    assert short.n == 3  # a repetition missing on one side is left out
    with pytest.raises(ValueError, match="one value per repetition"):
        paired_ratio_interval(pd.concat([numerator, numerator]), denominator)


def toy_trials() -> pd.DataFrame:
    """Two devices x three repetitions of two methods, and a failed row to ignore."""
    rows = []
    for method, base in (("voltage", 100.0), ("trace-b", 10.0)):
        for repeat in range(3):
            for rank in range(2):
                effective = base * (1 + repeat) + rank * 2  # device 1 is 2 ms slower
                rows.append(
                    dict(
                        method=method,
                        params=pd.NA,
                        devices=2,
                        bandwidth_mbit=10.0,
                        repeat=repeat,
                        rank=rank,
                        status="ok",
                        effective_ms=effective,
                        wait_ms=float(rank),
                    )
                )
    rows.append(dict(rows[0], status="failed", repeat=-1, effective_ms=1e6))
    return pd.DataFrame(rows)


def test_summarize_averages_devices_then_takes_medians_over_repetitions():
    keys = ["method", "params", "devices", "bandwidth_mbit"]
    table = summarize(toy_trials(), keys, ["effective_ms", "wait_ms"]).set_index("method")
    assert list(table.columns) == [
        "params",
        "devices",
        "bandwidth_mbit",
        "n",
        "effective_ms",
        "effective_ms_low",
        "effective_ms_high",
        "wait_ms",
        "wait_ms_low",
        "wait_ms_high",
        "level",
    ]
    voltage = table.loc["voltage"]
    assert voltage["n"] == 3
    # per repetition the mean of the two devices: 101, 201, 301
    assert (voltage["effective_ms"], voltage["effective_ms_low"]) == (201.0, 101.0)
    assert voltage["effective_ms_high"] == 301.0
    assert voltage["wait_ms"] == 0.5 and voltage["level"] == 0.75
    assert table.loc["trace-b", "effective_ms"] == 21.0
    slowest = summarize(toy_trials(), keys, ["effective_ms"], per_repetition="max")
    assert slowest.set_index("method").loc["voltage", "effective_ms"] == 202.0


def test_by_repetition_keeps_one_row_per_repetition():
    table = by_repetition(toy_trials(), ["method"], ["effective_ms"], how="max")
    assert len(table) == 6
    assert table.set_index(["method", "repeat"]).loc[("trace-b", 0), "effective_ms"] == 12.0
    with pytest.raises(ValueError, match="mean"):
        by_repetition(toy_trials(), ["method"], ["effective_ms"], how="median")
