"""A file written whole: into a temporary file beside it, then renamed over it, so that a
reader sees the old file or the new one, never half of one. Standard library only.

(`tracevq.bundle` and `devices.records` write their files the same way with their own few
lines: the packages below the testbed cannot import it.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[Path], object]) -> Path:
    """Calls `write(temporary)`, then renames the temporary file to `path`. On any error
    (a full disk, Ctrl-C) the temporary file is removed and the error raised: what was at
    `path` before stays whole. The temporary name is this process's and thread's own, so
    that two writers of one path do not write into each other's file."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path
