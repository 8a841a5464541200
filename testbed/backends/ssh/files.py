"""What the ssh backend deploys and when: the project's source archive and its SHA-256; a
board's code directory is current when its DIGEST file names that archive, and a run file is
copied when the board's copy is missing or has another SHA-256.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Mapping
from pathlib import Path

from testbed.source import SOURCE_ROOT

DEPLOYED = ("tracevq", "devices", "testbed", "pyproject.toml")


def uploads_needed(local: Mapping[str, str], remote: Mapping[str, str | None]) -> list[str]:
    """Names whose board copy is missing or differs (by SHA-256) from ours, in our order."""
    return [name for name, digest in local.items() if remote.get(name) != digest]


def code_is_current(marker: str | None, digest: str) -> bool:
    """Whether a deployed code directory's DIGEST file says it holds this archive."""
    return marker is not None and marker.strip() == digest


def source_files(root: Path = SOURCE_ROOT) -> list[Path]:
    """The files of the deployed project, sorted, without byte-code caches."""
    files = []
    for name in DEPLOYED:
        path = root / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for candidate in candidates:
            parts = candidate.relative_to(root).parts
            if candidate.is_file() and "__pycache__" not in parts and candidate.suffix != ".pyc":
                files.append(candidate)
    return files


def source_archive(root: Path = SOURCE_ROOT) -> tuple[bytes, str]:
    """A reproducible .tar.gz of the project (same files, same bytes) and its SHA-256."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped:
        with tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in source_files(root):
                data = path.read_bytes()
                info = tarfile.TarInfo(path.relative_to(root).as_posix())
                info.size, info.mtime = len(data), 0
                info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
                tar.addfile(info, io.BytesIO(data))
    archive = buffer.getvalue()
    return archive, hashlib.sha256(archive).hexdigest()
