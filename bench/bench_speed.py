"""How to make a device slower: a CPU quota, dilation in the worker, or both, block by block.

A device of speed s should take 1/s times as long for every block of compute, not the same
mean with holes in it. For each way of getting there, this runs the GEMM probe
(`devices.gemm`: a ViT-B/16 block's four products on N/2 = 99 rows, one thread, pinned to
one core) inside a control group of its own (testbed.kernel.cgroups) and reports, per speed,
the median block time against the ideal (the full-speed median / s), the 95th percentile over
the median, and the rate achieved over the full-speed rate (from the mean block time):

- `quota 100 ms (bare)`: a quota of s cores at the kernel's and Docker's default period;
- `quota P ms`: a quota at period P (100, 10, 2 ms; at least 1 ms / s, since the kernel's
  least quota is 1 ms) calibrated so that the achieved rate is
  the one asked (a shorter period costs throughput: at 2 ms half speed asks for more than
  half a core);
- `dilation`: no quota; the worker sleeps after each block until its wall time is its CPU
  time / s (devices.pace);
- `dilation + cap`: dilation under a quota of s cores at a 10 ms period, which bounds what
  the device takes from its neighbours.

Rounds interleave the ways (each probe a fresh process), so a noisy minute of the host falls
on all of them; the figures are medians over rounds. Needs root (cgroups).

Usage: python -m bench.bench_speed [--quick] [--rounds N] [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass

from testbed.kernel.cgroups import DeviceGroups

CORE = "1"  # the probe's core; the orchestrator and the shell keep to the other
SPEEDS = (0.5, 0.25)
PERIODS_MS = (100, 10, 2)
CAP_PERIOD_MS = 10


@dataclass(frozen=True)
class Way:
    name: str
    quota_cpus: float | None  # None: no quota
    period_ms: float
    dilation: bool


def probe(way: Way, speed: float, seconds: float) -> list[float]:
    """Every block's time (ms) of one probe run the way says."""
    groups = DeviceGroups("bench-speed").create(
        cpuset=CORE, quota_cpus=way.quota_cpus, period_us=round(way.period_ms * 1000)
    )
    argv = [sys.executable, "-m", "devices.gemm", "--blocks", "--seconds", str(seconds)]
    if way.dilation:
        argv += ["--speed", str(speed)]
    try:
        done = subprocess.run(
            argv, preexec_fn=groups.join, capture_output=True, text=True, check=True
        )
    finally:
        groups.remove()
    return json.loads(done.stdout)["times_ms"]


def calibrated(speed: float, period_ms: float, full_mean_ms: float, seconds: float) -> float:
    """The quota (cores) at `period_ms` whose mean block time is full_mean_ms / speed."""
    quota = speed
    for _ in range(3):
        mean = statistics.fmean(probe(Way("", quota, period_ms, False), speed, seconds))
        quota = min(1.0, max(1 / period_ms, quota * (mean * speed / full_mean_ms)))
    return quota


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_speed", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="one round, short probes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="per probe")
    args = parser.parse_args(argv)
    rounds, seconds = (1, 0.5) if args.quick else (args.rounds, args.seconds)
    full = Way("full speed", None, 100, False)
    full_mean = statistics.fmean(probe(full, 1.0, seconds))
    ways: dict[float, list[Way]] = {}
    for speed in SPEEDS:
        ways[speed] = [Way("quota 100 ms (bare)", speed, 100, False)]
        for shortest in PERIODS_MS:
            period = max(shortest, 1 / speed)  # the kernel's least quota is 1 ms
            quota = calibrated(speed, period, full_mean, seconds)
            ways[speed].append(Way(f"quota {period:g} ms (q={quota:.3f})", quota, period, False))
        ways[speed].append(Way("dilation", None, 100, True))
        ways[speed].append(Way(f"dilation + cap {CAP_PERIOD_MS} ms", speed, CAP_PERIOD_MS, True))
    times: dict[tuple[float, str], list[list[float]]] = defaultdict(list)
    for _ in range(rounds):
        times[(1.0, full.name)].append(probe(full, 1.0, seconds))
        for speed, listed in ways.items():
            for way in listed:
                times[(speed, way.name)].append(probe(way, speed, seconds))
    full_median = statistics.median(statistics.median(t) for t in times[(1.0, full.name)])
    full_rate = 1 / statistics.median(statistics.fmean(t) for t in times[(1.0, full.name)])
    print(f"{'speed':>5}  {'way':30} {'median ms':>9} {'/ideal':>7} {'p95/med':>8} {'rate':>6}")
    for (speed, name), runs in times.items():
        median = statistics.median(statistics.median(t) for t in runs)
        spread = statistics.median(p95(t) / statistics.median(t) for t in runs)
        rate = 1 / statistics.median(statistics.fmean(t) for t in runs) / full_rate
        ideal = full_median / speed
        shown = f"{median:9.2f} {median / ideal:7.3f} {spread:8.2f} {rate:6.3f}"
        print(f"{speed:5.2f}  {name:30} {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
