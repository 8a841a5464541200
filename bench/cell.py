"""The shared medium at more devices and kinds of bulk than CI runs: P devices sending bulk
at once on one 20 Mbit/s cell, their total and Jain's fairness index over their shares.

Run as root from the repository root: `python -m bench.cell` (about 6 s per device count,
kind of bulk and repetition; `--counts 2 4 8 --bulk udp cubic bbr --repeats 3` by default).
The measurement is the CI test's (tests/integration/test_cell_netns.py: every device to the
next, 3 s of steady traffic by the emulator's byte counters after 1 s), which CI runs with UDP
at P = 2 and 4. Prints one line per run, then the median total and the least fairness per
count and kind of bulk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from tests.integration.test_cell_netns import (
    BULK,
    CELL_MBIT,
    WINDOW_S,
    bulk_on_the_cell,
    cell_of,
    jain,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cell", description=__doc__)
    parser.add_argument("--counts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--bulk", nargs="+", choices=BULK, default=list(BULK))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.cell: run as root (network namespaces)", file=sys.stderr)
        return 2
    summary = []
    for count in args.counts:
        for bulk in args.bulk:
            totals, fairness = [], []
            for repeat in range(args.repeats):
                cells = cell_of(count)
                try:
                    carried = bulk_on_the_cell(next(cells), bulk)
                finally:
                    cells.close()  # stops the switch, deletes the namespaces
                total = sum(carried.values()) * 8 / WINDOW_S / 1e6
                totals.append(total)
                fairness.append(jain(list(carried.values())))
                shares = " ".join(f"{8 * b / WINDOW_S / 1e6:.2f}" for b in carried.values())
                print(
                    f"P={count} {bulk} #{repeat}: {total:.3f} Mbit/s in all "
                    f"({100 * (total / CELL_MBIT - 1):+.2f} %), Jain {fairness[-1]:.4f}; {shares}"
                )
            summary.append((count, bulk, statistics.median(totals), min(fairness)))
    print(f"\n{CELL_MBIT:g} Mbit/s cell  bulk   median total     off  least Jain")
    for count, bulk, total, least in summary:
        off = 100 * (total / CELL_MBIT - 1)
        print(f"P={count:<16}{bulk:<7}{total:>12.3f}{off:>+8.2f} %{least:>10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
