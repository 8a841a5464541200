"""Names that become path components (experiment names, run ids, profile names): slugs.

A slug is letters, digits, `.`, `_` and `-`, at most 100 characters, and not `.` or `..`, so
`results/<experiment>/<run-id>` always lies under the results root.
"""

from __future__ import annotations

import re

SLUG = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
SLUG_RULE = "letters, digits, '.', '_' and '-' only (at most 100), not '.' or '..'"


def is_slug(name: object) -> bool:
    return isinstance(name, str) and bool(SLUG.match(name)) and name not in (".", "..")


def check_slug(name: str, what: str) -> str:
    """`name` if it is a slug; else ValueError saying what a `what` may be called."""
    if not is_slug(name):
        raise ValueError(f"{what} {name!r} is used as a directory name: {SLUG_RULE}")
    return name
