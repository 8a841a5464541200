"""Two samples of what a link did to N packets, netem's and the serial emulator's, judged row
by row (`checks.netem_conformance` makes them): counts against the emulator's own spread,
burst lengths by chi-square, delays by Kolmogorov-Smirnov; the table and its CSV."""

from __future__ import annotations

import csv
import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scipy import stats

from testbed.experiment.netem_parameters import checked
from testbed.kernel.netem import netem_options

SIGNIFICANCE = 0.05
MIN_BIN_BURSTS = 10


@dataclass(frozen=True)
class Row:
    """One comparison: netem's parameters (as a profile names them) and what is compared."""

    name: str
    measure: str  # "loss", "duplicate", "reorder", "delay" or "order"
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Sample:
    """What one side did to N packets, packet by packet."""

    lost: list[bool]
    duplicated: list[bool]
    reordered: list[bool]
    delays_ms: list[float]  # of the packets that arrived, in the order sent
    out_of_order: int  # packets that arrived after a later-sent one


@dataclass(frozen=True)
class Result:
    """One row of the table (and of the CSV: its columns are these fields)."""

    row: str
    parameters: str
    packets: int
    netem: str
    serial: str
    test: str
    p_value: float

    @property
    def agrees(self) -> bool:
        return self.p_value >= SIGNIFICANCE


def bursts(lost: list[bool]) -> list[int]:
    """The lengths of the runs of consecutive losses."""
    lengths, run_length = [], 0
    for gone in [*lost, False]:
        if gone:
            run_length += 1
        elif run_length:
            lengths.append(run_length)
            run_length = 0
    return lengths


def burst_test(a: list[int], b: list[int]) -> float:
    """Chi-square on the two burst-length histograms, lengths merged from the longest down
    until each bin holds MIN_BIN_BURSTS of both together; 1.0 when one bin is all there is."""
    top = max([*a, *b, 1])
    bins: list[list[int]] = []
    pending = [0, 0]
    for length in range(top, 0, -1):
        pending[0] += a.count(length)
        pending[1] += b.count(length)
        if sum(pending) >= MIN_BIN_BURSTS:
            bins.append(pending)
            pending = [0, 0]
    if bins:
        bins[-1] = [bins[-1][0] + pending[0], bins[-1][1] + pending[1]]
    if len(bins) < 2 or not all(sum(column) for column in zip(*bins, strict=True)):
        return 1.0
    return float(stats.chi2_contingency(bins).pvalue)


def count_test(a: int, b: int, packets: int) -> float:
    return float(stats.fisher_exact([[a, packets - a], [b, packets - b]]).pvalue)


def share(flags: list[bool]) -> str:
    return f"{sum(flags)} ({100 * sum(flags) / len(flags):.2f}%)"


def quantiles(delays_ms: list[float]) -> str:
    q = statistics.quantiles(delays_ms, n=20)
    return "p5/p50/p95 " + "/".join(f"{q[k]:.1f}" for k in (0, 9, 18))


def lag1(values: list[float]) -> float:
    return statistics.correlation(values[:-1], values[1:])


COUNTED = {"loss": "lost", "duplicate": "duplicated", "reorder": "reordered"}


def counted(sample: Sample, measure: str) -> int:
    return sum(getattr(sample, COUNTED[measure]))


def monte_carlo_p(observed: int, counts: list[int]) -> float:
    """Two-sided: the share of the emulator's runs at least as far from their mean as
    `observed` (one more on both sides of the fraction: never 0)."""
    mean = statistics.fmean(counts)
    extreme = sum(abs(c - mean) >= abs(observed - mean) for c in counts)
    return (1 + extreme) / (1 + len(counts))


def compare(
    row: Row, packets: int, netem: Sample, serial: Sample, counts: list[int] | None = None
) -> Result:
    """The row's Result; `counts` (a count row's): the emulator's runs' counts."""
    words = " ".join(netem_options(checked(row.parameters)))
    if row.measure in COUNTED:
        assert counts is not None
        field = COUNTED[row.measure]
        flags, own = getattr(netem, field), getattr(serial, field)
        p = monte_carlo_p(sum(flags), counts)
        runs = f"{statistics.fmean(counts):.0f} ± {statistics.stdev(counts):.0f}"
        netem_text, serial_text = f"{field} {share(flags)}", f"{field} {share(own)}, runs {runs}"
        test = f"Monte Carlo ({len(counts)} runs)"
        if row.measure == "loss":
            a, b = bursts(netem.lost), bursts(serial.lost)
            p_burst = burst_test(a, b)
            netem_text += f", mean burst {statistics.fmean(a or [0]):.2f}"
            serial_text += f", mean burst {statistics.fmean(b or [0]):.2f}"
            test += f" p {p:.3f}; bursts chi-square p {p_burst:.3f}"
            p = min(p, p_burst)
        return Result(row.name, words, packets, netem_text, serial_text, test, p)
    if row.measure == "order":
        p = count_test(netem.out_of_order, serial.out_of_order, packets)
        return Result(
            row.name,
            words,
            packets,
            f"{netem.out_of_order} arrived after a later one",
            f"{serial.out_of_order} arrived after a later one",
            "Fisher",
            p,
        )
    p = float(stats.ks_2samp(netem.delays_ms, serial.delays_ms).pvalue)
    return Result(
        row.name,
        words,
        packets,
        f"{quantiles(netem.delays_ms)} ms, lag-1 r {lag1(netem.delays_ms):.2f}",
        f"{quantiles(serial.delays_ms)} ms, lag-1 r {lag1(serial.delays_ms):.2f}",
        "Kolmogorov-Smirnov",
        p,
    )


def markdown(results: Sequence[Result]) -> str:
    lines = [
        "| row | netem | serial emulator | test | p | at 5% |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        verdict = "agrees" if r.agrees else "**differs**"
        lines.append(
            f"| {r.row} (`{r.parameters}`) | {r.netem} | {r.serial} | {r.test} "
            f"| {r.p_value:.3f} | {verdict} |"
        )
    return "\n".join(lines)


def write_csv(results: Sequence[Result], path: Path) -> None:
    names = [f.name for f in dataclasses.fields(Result)]
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=[*names, "agrees"])
        writer.writeheader()
        for r in results:
            writer.writerow({**dataclasses.asdict(r), "agrees": r.agrees})
