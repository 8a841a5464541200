"""Bandwidth traces: a link's rate over time, read from a file or generated, replayed by
`testbed.link.replay` on a live link.

A trace is a step function: rate `rates_mbit[i]` from `times_s[i]` until the next step, over
`duration_s`, then (looped) again from the start. Rates are tc's (10^6 bit/s). Two formats:

- CSV: a header `t_s,mbit` and one row per step, times ascending from 0; the last row's rate
  holds until `duration_s`, which is the last time plus the median step length unless a row
  `t_s` = duration with an empty rate ends the file. Two more columns may follow, `delay_ms`
  and `loss_pct` (either or both, in that order): each step's one-way delay and random loss,
  laid over the link profile's while the step is in force (the serial emulator's; on tbf,
  netem's).
- Mahimahi's packet-delivery traces (`*.mahimahi`, or `--format mahimahi`): one line per
  delivery opportunity of a 1500-byte packet, its time in whole milliseconds, ascending; the
  file repeats after its last time. Read as the rate of each `bin_ms` window.

Generated traces (`generate`, seeded, documented in `MODELS`) are what `netem_profiles/`
ships: `python -m testbed.link.traces generate` rewrites them.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import math
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.errors import ConfigError
from testbed.experiment.netem_parameters import ImpairmentError, checked
from testbed.source import PROFILES_DIR

MAHIMAHI_PACKET_BYTES = 1500


IMPAIRMENT_COLUMNS = ("delay_ms", "loss_pct")  # optional, after t_s and mbit


@dataclass(frozen=True)
class RateTrace:
    times_s: tuple[float, ...]
    rates_mbit: tuple[float, ...]
    duration_s: float
    name: str = "trace"
    # per step, netem's parameters of IMPAIRMENT_COLUMNS the trace gives (empty: none)
    impairments: tuple[dict[str, float], ...] = ()

    def __post_init__(self) -> None:
        where = f"trace {self.name}"
        if not self.times_s or len(self.times_s) != len(self.rates_mbit):
            raise ConfigError(f"{where}: needs one rate per step time, and at least one step")
        if self.times_s[0] != 0:
            raise ConfigError(f"{where}: the first step starts at t = 0, not {self.times_s[0]:g}")
        if any(b <= a for a, b in zip(self.times_s, self.times_s[1:], strict=False)):
            raise ConfigError(f"{where}: step times must increase")
        if not self.duration_s > self.times_s[-1]:
            raise ConfigError(f"{where}: the duration must exceed the last step's time")
        bad = [r for r in self.rates_mbit if not (math.isfinite(r) and r > 0)]
        if bad:
            raise ConfigError(f"{where}: rates must be finite and positive, got {bad[0]!r}")
        if self.impairments and len(self.impairments) != len(self.times_s):
            raise ConfigError(f"{where}: needs the impairments of every step, or of none")
        for step, parameters in enumerate(self.impairments):
            try:
                checked(parameters)
            except ImpairmentError as error:
                raise ConfigError(
                    f"{where}: step {step} (t = {self.times_s[step]:g} s): {error}"
                ) from None

    def impairments_at(self, t_s: float) -> dict[str, float]:
        """The trace's impairments in force at `t_s` (looped; empty where it gives none)."""
        if not self.impairments:
            return {}
        position = t_s % self.duration_s
        return self.impairments[bisect.bisect_right(self.times_s, position) - 1]

    @property
    def max_delay_ms(self) -> float:
        return max((step.get("delay_ms", 0.0) for step in self.impairments), default=0.0)

    def rate_at(self, t_s: float) -> float:
        """The rate in force at `t_s` seconds after the start (looped)."""
        position = t_s % self.duration_s
        return self.rates_mbit[bisect.bisect_right(self.times_s, position) - 1]

    def changes(self, start_s: float = 0.0) -> Iterator[tuple[float, float]]:
        """(time, rate) of every step from `start_s` on, looping for ever: time in seconds
        from the trace's start, the first one at `start_s` itself."""
        loop = math.floor(start_s / self.duration_s)
        yield start_s, self.rate_at(start_s)
        while True:
            base = loop * self.duration_s
            for t, rate in zip(self.times_s, self.rates_mbit, strict=True):
                if base + t > start_s:
                    yield base + t, rate
            loop += 1

    def stretched(self, factor: float) -> RateTrace:
        """The same trace played `factor` times slower (its steps `factor` times longer)."""
        if not factor > 0:
            raise ConfigError(f"trace {self.name}: stretch must be positive, got {factor!r}")
        return RateTrace(
            tuple(t * factor for t in self.times_s),
            self.rates_mbit,
            self.duration_s * factor,
            self.name,
            self.impairments,
        )

    def mean_mbit(self) -> float:
        """The time-weighted mean rate over one period."""
        ends = (*self.times_s[1:], self.duration_s)
        lengths = [end - start for start, end in zip(self.times_s, ends, strict=True)]
        return sum(r * d for r, d in zip(self.rates_mbit, lengths, strict=True)) / self.duration_s


def read_csv(path: Path) -> RateTrace:
    path = Path(path)
    times, rates, steps, end = [], [], [], None
    with path.open(newline="") as handle:
        rows = list(csv.reader(line for line in handle if not line.lstrip().startswith("#")))
    header = [c.strip() for c in rows[0]] if rows else []
    extra = tuple(header[2:])
    if header[:2] != ["t_s", "mbit"] or extra not in _EXTRA_HEADERS:
        raise ConfigError(
            f"{path}: a trace CSV starts with the header 't_s,mbit', optionally followed by "
            f"{' and '.join(IMPAIRMENT_COLUMNS)} (in that order); got {','.join(header)!r}"
        )
    width = len(header)
    for number, row in enumerate(rows[1:], start=2):
        cells = [c.strip() for c in row] + [""] * (width - len(row))
        try:
            t = float(cells[0])
            if cells[1] == "":
                end = t
                continue
            rate = float(cells[1])
            step = {name: float(cell) for name, cell in zip(extra, cells[2:width], strict=True)}
        except ValueError:
            raise ConfigError(f"{path}:{number}: not a number in {row!r}") from None
        if end is not None:
            raise ConfigError(f"{path}:{number}: a row after the end row (t_s with no rate)")
        times.append(t)
        rates.append(rate)
        steps.append(step)
    if not times:
        raise ConfigError(f"{path}: no steps")
    if end is None:
        lengths = np.diff(times)
        end = times[-1] + (statistics.median(lengths) if len(lengths) else 1.0)
    return RateTrace(tuple(times), tuple(rates), end, path.stem, tuple(steps) if extra else ())


_EXTRA_HEADERS = {(), IMPAIRMENT_COLUMNS[:1], IMPAIRMENT_COLUMNS[1:], IMPAIRMENT_COLUMNS}


def read_mahimahi(path: Path, bin_ms: int = 500) -> RateTrace:
    """A Mahimahi trace as the rate of each `bin_ms` window (the last window ends with the
    file's last opportunity, where Mahimahi loops)."""
    path = Path(path)
    stamps = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.strip()
        if not text:
            continue
        if not text.isdigit():
            raise ConfigError(f"{path}:{number}: a Mahimahi trace holds whole milliseconds")
        stamps.append(int(text))
    if not stamps or any(b < a for a, b in zip(stamps, stamps[1:], strict=False)):
        raise ConfigError(f"{path}: Mahimahi timestamps must be present and non-decreasing")
    period_ms = max(stamps[-1], 1)
    bins = math.ceil(period_ms / bin_ms)
    counts = np.bincount(np.minimum(np.array(stamps) // bin_ms, bins - 1), minlength=bins)
    lengths = [min(bin_ms, period_ms - i * bin_ms) for i in range(bins)]
    rates = [
        float(max(c, 1e-3)) * MAHIMAHI_PACKET_BYTES * 8 / (n / 1000) / 1e6
        for c, n in zip(counts, lengths, strict=True)
    ]
    return RateTrace(
        tuple(i * bin_ms / 1000 for i in range(bins)), tuple(rates), period_ms / 1000, path.stem
    )


def write_mahimahi(trace: RateTrace, path: Path) -> Path:
    """One period of `trace` as delivery opportunities: each 1500-byte packet's ms time."""
    stamps, debt = [], 0.0
    for ms in range(1, round(trace.duration_s * 1000) + 1):
        debt += trace.rate_at((ms - 1) / 1000) * 1e6 / 8 / 1000 / MAHIMAHI_PACKET_BYTES
        while debt >= 1:
            stamps.append(ms)
            debt -= 1
    path.write_text("".join(f"{s}\n" for s in stamps))
    return path


def write_csv(trace: RateTrace, path: Path, comment: str = "") -> Path:
    lines = [f"# {line}" for line in comment.splitlines()] + ["t_s,mbit"]
    lines += [f"{t:g},{r:.3f}" for t, r in zip(trace.times_s, trace.rates_mbit, strict=True)]
    lines.append(f"{trace.duration_s:g},")
    path.write_text("\n".join(lines) + "\n")
    return path


def load_trace(path: str | Path, directory: Path = PROFILES_DIR) -> RateTrace:
    """A trace file by path, or by name in `netem_profiles/`; the format from its suffix."""
    path = Path(path)
    if not path.is_absolute() and not path.exists():
        path = directory / path
    if not path.is_file():
        raise ConfigError(f"trace file not found: {path}")
    return read_mahimahi(path) if path.suffix == ".mahimahi" else read_csv(path)


# Generated traces ----------------------------------------------------------------------------

MODELS = {
    "walking-wifi": (
        "Someone walking away from an access point and back, 60 s: the rate follows the "
        "distance (20 Mbit/s near, 3 far, log-distance falloff), with 1 s steps and a "
        "lognormal fading of 15%."
    ),
    "lte-drops": (
        "An LTE uplink, 60 s: 8 Mbit/s on average, 1 s steps of a mean-reverting "
        "lognormal walk (sigma 25%), and three drops to 0.5-1 Mbit/s lasting 2-4 s."
    ),
    "step-20-2-20": "20 Mbit/s for 10 s, 2 Mbit/s for 10 s, 20 Mbit/s for 10 s.",
    "step-20-1-20": "20 Mbit/s for 10 s, 1 Mbit/s for 10 s, 20 Mbit/s for 10 s.",
}


def generate(name: str, seed: int = 0) -> RateTrace:
    rng = np.random.default_rng(seed)
    if name == "walking-wifi":
        t = np.arange(60.0)
        distance = 1 + 14 * np.sin(np.pi * t / 60)  # metres: 1 -> 15 -> 1
        rate = 20 * (1 - np.log(distance) / np.log(15) * (1 - 3 / 20))
        rate = rate * rng.lognormal(0, 0.15, len(t))
    elif name == "lte-drops":
        t = np.arange(60.0)
        walk = np.zeros(len(t))
        for i in range(1, len(t)):
            walk[i] = 0.7 * walk[i - 1] + rng.normal(0, 0.25)
        rate = 8 * np.exp(walk)
        for start in rng.choice(np.arange(5, 55, 10), 3, replace=False):
            length = int(rng.integers(2, 5))
            rate[start : start + length] = rng.uniform(0.5, 1.0, length)
    elif name.startswith("step-20-"):
        low = {"step-20-2-20": 2.0, "step-20-1-20": 1.0}[name]
        return RateTrace((0.0, 10.0, 20.0), (20.0, low, 20.0), 30.0, name)
    else:
        raise ConfigError(f"unknown trace model {name!r}; known: {', '.join(MODELS)}")
    rate = np.clip(rate, 0.25, None).round(3)
    return RateTrace(tuple(float(v) for v in t), tuple(float(v) for v in rate), 60.0, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.link.traces",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["generate"])
    parser.add_argument("--out", type=Path, default=PROFILES_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, model in MODELS.items():
        trace = generate(name, args.seed)
        command = "python -m testbed.link.traces generate"
        comment = f"{model}\nGenerated by `{command}` (seed {args.seed})."
        print(write_csv(trace, args.out / f"{name}.csv", comment))
    lte = generate("lte-drops", args.seed)
    print(write_mahimahi(lte, args.out / "lte-drops.mahimahi"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
