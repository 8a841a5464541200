"""The paper's Table V at six device counts: ViViT-B's compute with and without K/V buffers.

For each device count P (2, 3, 4, 6, 8 and 10, the paper's), device 0's compute per inference
of Trace-b at K = 1024 in process (bench.compute: all P devices in lockstep with the real wire
bytes, one torch thread), in two variants that alternate round by round:

- with buffers: the method's default (buffer rows gathered, attention over the distinct
  remote codewords: dedup on);
- without: `buffers: False, dedup: False`, the paper's full chain (the previous block's FFN,
  LN and the K/V projection) run for every remote token.

Printed per P: each variant's median over rounds with its distribution-free interval, the
buffers' gain 1 - with / without from the ratios paired by round, and the paper's figures
(testbed.report.paper.PAPER_TABLE_V) beside them.

Device 0 is the one timed. It holds CLS: ViViT-B's N = 3137 tokens are 3136 patches and CLS,
so at every P here device 0 holds ceil(N / P) tokens, the largest share, at most one token more
than any other device (1 in 314 at P = 10), and runs the head on CLS alone. So it is the
device an inference waits for, and the others of the even split compute as much to within a
token: its compute is the paper's per-device figure.

Usage: python -m bench.bench_buffers [--quick] [--rounds N] [--devices 2 3 4 6 8 10]
`--quick` uses ViViT-tiny with K = 64 at P = 2 and 3 over two rounds (a check that it runs).
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from bench.compute import bundle_for, compare
from testbed.report.paper import PAPER_TABLE_V
from testbed.results.stats import Interval, median_interval, paired_ratio_interval
from tracevq.models import build_model

logger = logging.getLogger(__name__)

DEVICE_COUNTS = tuple(PAPER_TABLE_V)
ROUNDS = 6
QUICK_DEVICE_COUNTS = (2, 3)
QUICK_ROUNDS = 2


@dataclass(frozen=True)
class Setup:
    """The model, codebook size and calibration inputs of one run."""

    model: str
    K: int
    calibration: int

    @classmethod
    def of(cls, quick: bool) -> Setup:
        # the calibration counts of bench_trace's ViViT lines: the cached bundles are shared
        return cls("vivit-tiny", 64, 4) if quick else cls("vivit-b", 1024, 1)


@dataclass(frozen=True)
class BufferGain:
    """Device 0's compute at one device count, without and with the buffers.

    Attributes:
        devices: P.
        without_ms: compute with the full chain for every remote token.
        with_ms: compute with the buffers (and dedup).
        gain: 1 - with / without, from the ratios paired by round.
    """

    devices: int
    without_ms: Interval
    with_ms: Interval
    gain: Interval


def variants(K: int) -> dict[str, dict]:
    """The two variants, as make_method kwargs."""
    return {
        "without": {"name": "trace-b", "K": K, "buffers": False, "dedup": False},
        "with": {"name": "trace-b", "K": K},
    }


def gain_of(ratio: Interval) -> Interval:
    """1 - ratio, its interval bounds swapped."""
    return Interval(ratio.n, 1 - ratio.median, 1 - ratio.high, 1 - ratio.low, ratio.level)


def measure(setup: Setup, device_counts: tuple[int, ...], rounds: int) -> list[BufferGain]:
    """Device 0's compute without and with buffers at each device count (one torch thread),
    each row printed as it is measured."""
    torch.set_num_threads(1)
    model = build_model(setup.model)
    bundle = bundle_for(model, setup.K, setup.calibration)
    rows = []
    for devices in tqdm(device_counts, desc=f"{setup.model} device counts", unit="P"):
        logger.debug("measuring P = %d, %d rounds", devices, rounds)
        times = compare(model, bundle, variants(setup.K), devices=devices, rounds=rounds)
        ratio = paired_ratio_interval(times["with"], times["without"])
        row = BufferGain(
            devices,
            median_interval(times["without"]),
            median_interval(times["with"]),
            gain_of(ratio),
        )
        tqdm.write(format_row(row))
        rows.append(row)
    return rows


def paper_row(devices: int) -> tuple[float, float, float]:
    """The paper's without, with (ms) and gain (%) at P = devices; NaNs where it has none."""
    without_ms, with_ms = PAPER_TABLE_V.get(devices, (math.nan, math.nan))
    return without_ms, with_ms, 100 * (without_ms - with_ms) / without_ms


def cell(value: Interval, scale: float = 1.0, digits: int | None = None) -> str:
    median, low, high = (scale * v for v in (value.median, value.low, value.high))
    if digits is None:  # whole ms for ViViT-B's seconds, tenths for the tiny model's few ms
        digits = 0 if median >= 100 else 1
    return f"{median:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def format_row(row: BufferGain) -> str:
    without_ms, with_ms, gain = paper_row(row.devices)
    paper = [f"{without_ms:.0f}", f"{with_ms:.0f}", f"{gain:.1f}"]
    paper = ["-" if text == "nan" else text for text in paper]
    ours = [cell(row.without_ms), cell(row.with_ms), cell(row.gain, 100, 1)]
    return line(str(row.devices), *ours, *paper)


def line(*cells: str) -> str:
    widths = (3, 24, 24, 20, 13, 10, 12)
    return "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))


def header(setup: Setup, rounds: int) -> str:
    title = (
        f"Table V: {setup.model}, trace-b K = {setup.K}, device 0's compute (ms) per "
        f"inference, one thread, median [interval] over {rounds} rounds interleaved; "
        "gain % = 100 (1 - with / without), paired by round"
    )
    columns = line(
        "P",
        "ours without",
        "ours with",
        "ours gain %",
        "paper without",
        "paper with",
        "paper gain %",
    )
    return f"{title}\n{columns}"


def run(
    quick: bool, rounds: int | None = None, device_counts: tuple[int, ...] | None = None
) -> tuple[Setup, list[BufferGain]]:
    """Measure and print the table (a row per device count as it is measured); the defaults
    are the full run's or --quick's."""
    setup = Setup.of(quick)
    rounds = rounds or (QUICK_ROUNDS if quick else ROUNDS)
    device_counts = device_counts or (QUICK_DEVICE_COUNTS if quick else DEVICE_COUNTS)
    print(header(setup, rounds), flush=True)
    rows = measure(setup, device_counts, rounds)
    level = rows[0].gain.level
    print(f"(intervals: order statistics of n = {rounds}, coverage {level:.3f})", flush=True)
    return setup, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_buffers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per device count")
    parser.add_argument("--devices", type=int, nargs="+", default=None, help="device counts")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.devices and min(args.devices) < 2:
        parser.error(f"every device count must be at least 2 (remote tokens), not {args.devices}")
    run(args.quick, args.rounds, tuple(args.devices) if args.devices else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
