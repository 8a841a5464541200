"""The shared medium at more devices and kinds of bulk than CI runs: P devices sending bulk
at once on one 20 Mbit/s cell, their total and Jain's fairness index over their shares.

Run as root from the repository root: `python -m bench.cell` (about 6 s per device count,
kind of bulk and repetition; `--counts 2 4 8 --bulk udp cubic bbr --repeats 3` by default).
The measurement is `checks.cell.bulk_on_the_cell`, also the CI test's (tests/integration/
test_cell_netns.py), which runs it with UDP at P = 2 and 4. Prints one line per run, then the
median total and the least fairness per count and kind of bulk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from checks.cell import BULK, CELL_MBIT, bulk_on_the_cell, cell_of, jain, mbit


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
                total = mbit(sum(carried.values()))
                totals.append(total)
                fairness.append(jain(list(carried.values())))
                shares = " ".join(f"{mbit(b):.2f}" for b in carried.values())
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
