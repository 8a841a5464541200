"""`python -m testbed.clean [--run RUN_ID]`: remove what a crashed run left behind.

Containers and networks labelled `testbed.run` (Docker, when an engine answers), and the
local backend's network namespaces, veths and bridges (by their name pattern, as root).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from testbed.errors import TestbedError


def clean(run_id: str | None) -> list[str]:
    from testbed.backends.docker import engine_available, remove_by_label
    from testbed.backends.local import remove_leftovers

    removed: list[str] = []
    if engine_available():
        removed += remove_by_label(run_id)
    if os.geteuid() == 0:
        removed += remove_leftovers(run_id)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.clean", description=__doc__)
    parser.add_argument("--run", help="only this run id (default: every testbed run)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        removed = clean(args.run)
    except TestbedError as error:
        print(f"testbed.clean: {error}", file=sys.stderr)
        return 1
    for item in removed:
        print(f"removed {item}")
    print(f"{len(removed)} leftovers removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
