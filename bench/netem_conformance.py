"""The serial emulator held against the kernel's netem, every row of `checks.netem_conformance`
(the same parameters, the same number of packets, side by side, a two-sample test per row at
5 %): the command of docs/netem-conformance.md.

Run from the repository root: `python -m bench.netem_conformance [--netns]` (3-4 minutes;
the netem reference guest, `checks.guest`, is built first where it is missing). `--csv` names
the CSV (default docs/netem-conformance.csv); the markdown table goes to stdout. With
`--netns` (root), the row NETNS_ROW is also measured through the real switch in two network
namespaces (bench/netem_switch_delays.py): its one-way delays by the kernel's receive
timestamps, against netem's.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from bench.netem_switch_delays import switch_delays_ms
from checks.netem_conformance import chosen_rows, conformance
from checks.netem_verdicts import Result, Row, Sample, compare, markdown, write_csv
from testbed.errors import TestbedError
from testbed.experiment.netem_parameters import ImpairmentError

NETNS_ROW = "uniform 50 ms ± 20 ms"  # `--netns` measures its delays through the real switch
NETNS_MESSAGES = 1000


def switch_rows(
    row: Row, packets: int, seed: int, netem: Sample, noise_ms: list[float]
) -> list[Result]:
    """For NETNS_ROW: netem's delays against those the serial switch delivers in namespaces
    (the guest's noise added, as to the draws); nothing for the other rows."""
    if row.name != NETNS_ROW:
        return []
    count = min(packets, NETNS_MESSAGES)
    delays = switch_delays_ms(row.parameters, seed, count)
    noisy = [d + noise_ms[i % len(noise_ms)] for i, d in enumerate(delays)]
    switch = Sample([], [], [], noisy, 0)
    name = f"{row.name}, the switch in namespaces ({count:,} messages 40 ms apart)"
    return [compare(Row(name, row.measure, row.parameters), packets, netem, switch)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.netem_conformance", description=__doc__)
    parser.add_argument("--packets", type=int, default=3000, help="per row, on each side")
    parser.add_argument("--seed", type=int, default=1, help="the emulator's first row's seed")
    parser.add_argument("--rows", nargs="+", metavar="MEASURE", help="loss duplicate ...")
    parser.add_argument("--csv", type=Path, default=Path("docs/netem-conformance.csv"))
    parser.add_argument(
        "--netns", action="store_true", help=f"{NETNS_ROW}: also the switch in namespaces (root)"
    )
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        chosen = chosen_rows(options.rows, options.packets)
    except ValueError as error:
        print(f"netem_conformance: {error}", file=sys.stderr)
        return 2
    beside = switch_rows if options.netns else None
    try:
        results = conformance(chosen, options.packets, options.seed, beside=beside)
        write_csv(results, options.csv)
    except (TestbedError, ImpairmentError, OSError, RuntimeError) as error:
        print(f"netem_conformance: {error}", file=sys.stderr)
        return 1
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
