"""What a result depends on besides the experiment: versions, kernel, qdiscs, cores, commit."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from typing import Any

from testbed.backends.base import Backend
from testbed.source import SOURCE_ROOT

PACKAGES = ("torch", "numpy", "pandas", "pyroute2", "docker", "pydantic", "trace-testbed")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _output(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, cwd=SOURCE_ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> dict[str, Any]:
    commit = _output(["git", "rev-parse", "HEAD"])
    dirty = _output(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"commit": commit, "dirty": bool(dirty) if dirty is not None else None}


def collect(backend: Backend, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The environment record saved as environment.json with every run."""
    uname = platform.uname()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "packages": {name: _version(name) for name in PACKAGES},
        "kernel": uname.release,
        "machine": uname.machine,
        "host_cores": os.cpu_count(),
        "backend": backend.name,
        "git": git_commit(),
        **backend.versions(),
    }
    info.update(extra or {})
    return info
