"""`python -m tracevq.train STUDY.yaml [...]`: the same as `python -m accuracy STUDY.yaml [...]`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from accuracy.__main__ import main as study_main  # the library's one import of the study

    return study_main(argv)


if __name__ == "__main__":
    sys.exit(main())
