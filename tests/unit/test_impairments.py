"""netem's impairment model as the serial emulator draws it, frame by frame: the parameters'
rules, and the draws against their theory (binomial intervals, the Gilbert-Elliott chain's
burst length, the delay distributions by a Kolmogorov-Smirnov test). No root, no sockets."""

from __future__ import annotations

import math
import statistics

import pytest
from scipy import stats

from testbed.experiment.netem_parameters import ImpairmentError, checked, impaired
from testbed.link.serial.netem_draws import (
    U32,
    Correlated,
    GilbertElliott,
    Impairments,
    distribution_table,
    threshold,
)

FRAMES = 200_000


def binomial_interval(n: int, p: float, z: float = 1.96) -> tuple[float, float]:
    half = z * math.sqrt(n * p * (1 - p))
    return n * p - half, n * p + half


def burst_lengths(lost: list[bool]) -> list[int]:
    runs, length = [], 0
    for flag in lost:
        if flag:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return runs


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"delay_ms": -1}, "delay_ms: must lie in 0..60000, got -1"),
        ({"delay_ms": math.inf}, "delay_ms: a finite number"),
        ({"delay_ms": True}, "delay_ms: a finite number"),
        ({"loss_pct": 101}, "loss_pct: must lie in 0..100"),
        ({"jitter_ms": 2}, "jitter_ms: jitter needs a delay"),
        ({"delay_ms": 5, "delay_distribution": "normal"}, "delay_distribution: a distribution"),
        (
            {"delay_ms": 5, "jitter_ms": 1, "delay_distribution": "gauss"},
            "delay_distribution: 'gauss' is not one of",
        ),
        ({"reorder_pct": 10}, "reorder_pct: reordering needs a delay"),
        ({"delay_ms": 5, "reorder_gap": 3}, "reorder_gap: a gap without reorder_pct"),
        ({"delay_ms": 5, "reorder_pct": 5, "reorder_gap": -1}, "reorder_gap: a whole number"),
        ({"loss_pct": 1, "loss_gemodel": {"p_pct": 1}}, "loss_gemodel: one loss model at a time"),
        ({"loss_gemodel": {"r_pct": 1}}, "loss_gemodel.p_pct: required"),
        ({"loss_gemodel": {"p_pct": 1, "h": 3}}, "loss_gemodel.h: not a parameter"),
        ({"loss_state": {"p13_pct": 150}}, "loss_state.p13_pct: must lie in 0..100"),
        ({"latency_ms": 5}, "latency_ms: not an impairment"),
    ],
)
def test_bad_parameters_are_refused_naming_the_parameter(parameters, message):
    with pytest.raises(ImpairmentError) as error:
        checked(parameters)
    assert str(error.value).startswith(message), str(error.value)


def test_defaults_are_tcs():
    none = checked({})
    assert not impaired(none) and none["loss_model"] == "random"
    ge = checked({"loss_gemodel": {"p_pct": 2}})["loss_gemodel"]
    assert ge == {"p_pct": 2, "r_pct": 98, "one_minus_h_pct": 100, "one_minus_k_pct": 0}
    state = checked({"loss_state": {"p13_pct": 3}})["loss_state"]
    assert state == {"p13_pct": 3, "p31_pct": 97, "p32_pct": 0, "p23_pct": 100, "p14_pct": 0}
    assert checked({"delay_ms": 5, "reorder_pct": 25})["reorder_gap"] == 1
    assert impaired(checked({"delay_ms": 5}))


def test_thresholds_and_correlation_are_netems():
    assert threshold(0) == 0 and threshold(100) == U32 - 1
    assert threshold(50) == round((U32 - 1) / 2)
    rng = __import__("random").Random(1)
    free = Correlated(rng, 0.0)
    tied = Correlated(rng, 100.0)  # rho = 2^32: every draw repeats the first
    first = tied.last
    assert [tied.draw() for _ in range(5)] == [first] * 5
    draws = [free.draw() / U32 for _ in range(50_000)]
    assert stats.kstest(draws, "uniform").pvalue > 0.01


def test_random_loss_falls_in_its_binomial_interval():
    model = Impairments({"loss_pct": 1.0}, seed=7)
    lost = sum(not model.frame() for _ in range(FRAMES))
    low, high = binomial_interval(FRAMES, 0.01)
    assert low <= lost <= high, lost


def test_gilbert_elliott_bursts_have_the_chains_mean_length():
    """Simple Gilbert (1-h = 100%, 1-k = 0): a frame is lost exactly in the bad state, which
    is left with probability r per frame: bursts are geometric with mean 1 / r, and the loss
    rate is p / (p + r)."""
    p, r = 1.0, 25.0
    model = GilbertElliott(__import__("random").Random(3), p, r, 100.0, 0.0)
    lost = [model.lost() for _ in range(FRAMES)]
    bursts = burst_lengths(lost)
    assert statistics.mean(bursts) == pytest.approx(100 / r, rel=0.10)
    low, high = binomial_interval(FRAMES, p / (p + r), z=4.0)  # losses come in bursts: wider
    assert low <= sum(lost) <= high


def test_four_state_losses_and_bursts():
    """p13 = 1%, p31 = 50% (p32 = 0, p23 = 100, p14 = 0 by default): bursts of mean length
    1 / p31 = 2 in state 3, which the chain is in a p13 / (p13 + p31) share of the time."""
    model = Impairments({"loss_state": {"p13_pct": 1.0, "p31_pct": 50.0}}, seed=11)
    lost = [not model.frame() for _ in range(FRAMES)]
    assert statistics.mean(burst_lengths(lost)) == pytest.approx(2.0, rel=0.10)
    assert sum(lost) / FRAMES == pytest.approx(1 / 51, rel=0.10)


def test_duplicates_and_reorders_count_like_netems():
    model = Impairments({"duplicate_pct": 2.0}, seed=5)
    copies = [len(model.frame()) for _ in range(FRAMES)]
    low, high = binomial_interval(FRAMES, 0.02)
    assert low <= copies.count(2) <= high and set(copies) == {1, 2}
    # gap 5 at 100%: frames 5, 10, 15, ... skip the delay (netem's "one out of N")
    every = Impairments({"delay_ms": 10.0, "reorder_pct": 100.0, "reorder_gap": 5}, seed=5)
    reordered = [every.frame()[0].reordered for _ in range(20)]
    assert [i + 1 for i, flag in enumerate(reordered) if flag] == [5, 10, 15, 20]
    some = Impairments({"delay_ms": 10.0, "reorder_pct": 25.0}, seed=5)  # gap 1: any frame
    count = sum(some.frame()[0].reordered for _ in range(FRAMES))
    low, high = binomial_interval(FRAMES, 0.25)
    assert low <= count <= high


def test_uniform_jitter_is_uniform_about_the_delay():
    model = Impairments({"delay_ms": 20.0, "jitter_ms": 5.0}, seed=2)
    delays_ms = [model.frame()[0].delay_s * 1e3 for _ in range(20_000)]
    assert min(delays_ms) >= 15.0 and max(delays_ms) < 25.0
    assert statistics.mean(delays_ms) == pytest.approx(20.0, abs=0.05)
    assert stats.kstest(delays_ms, "uniform", args=(15.0, 10.0)).pvalue > 0.01
    assert model.max_delay_s == pytest.approx(0.025)


@pytest.mark.parametrize("name", ["normal", "pareto", "paretonormal"])
def test_tables_are_tcs(name):
    table = distribution_table(name)
    assert len(table) == 4096 and max(map(abs, table)) <= 32768


def test_normal_jitter_follows_the_normal_table():
    """iproute2's normal table is 4096 quantiles of N(0, 1) times 8192, cut at 4 standard
    deviations: delay + jitter x t / 8192 is N(delay, jitter) to a KS test."""
    model = Impairments(
        {"delay_ms": 20.0, "jitter_ms": 2.0, "delay_distribution": "normal"}, seed=4
    )
    delays_ms = [model.frame()[0].delay_s * 1e3 for _ in range(20_000)]
    assert statistics.mean(delays_ms) == pytest.approx(20.0, abs=0.05)
    assert statistics.stdev(delays_ms) == pytest.approx(2.0, rel=0.03)
    assert stats.kstest(delays_ms, "norm", args=(20.0, 2.0)).pvalue > 0.01


def test_negative_draws_are_zero_and_the_same_seed_the_same_frames():
    wide = Impairments({"delay_ms": 1.0, "jitter_ms": 5.0}, seed=9)
    assert min(wide.frame()[0].delay_s for _ in range(2_000)) == 0.0
    one, two = (
        Impairments({"delay_ms": 5.0, "jitter_ms": 2.0, "loss_pct": 5, "duplicate_pct": 5}, 42)
        for _ in range(2)
    )
    assert [one.frame() for _ in range(5_000)] == [two.frame() for _ in range(5_000)]
