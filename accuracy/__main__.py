"""`python -m accuracy STUDY.yaml [...]`: train, fine-tune, build trees, save, evaluate.

Exit codes: 0 done, 2 bad configuration or data (the message names the field or file),
130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tracevq.errors import TraceError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m accuracy", description=__doc__)
    parser.add_argument("study", nargs="+", type=Path, help="study YAML file(s) (configs/)")
    parser.add_argument("--output", help="results root (default: the file's `output`)")
    parser.add_argument("--jobs", type=int, help="parallel processes (default: the file's)")
    parser.add_argument("--seeds", type=int, nargs="+", help="replace the file's seeds")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from accuracy.report import write_report
    from accuracy.settings import load_settings
    from accuracy.study import run_study

    overrides = {
        key: value
        for key, value in (("output", args.output), ("jobs", args.jobs), ("seeds", args.seeds))
        if value is not None
    }
    try:
        studies = [load_settings(path, **overrides) for path in args.study]
        for settings in studies:
            rows = run_study(settings, progress=not args.quiet)
            write_report(rows, settings, settings.run_dir)
            print(f"{settings.name}: results in {settings.run_dir}")
    except TraceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
