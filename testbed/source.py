"""This checkout's folders, for whatever must find them from code: the source root (which holds
`testbed/`, `devices/` and `tracevq/`), the shipped link and device profiles and traces, the
caches, and the environment under which a child Python imports this checkout. Standard library
only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[1]
PROFILES_DIR = SOURCE_ROOT / "netem_profiles"
DEVICE_PROFILES_DIR = SOURCE_ROOT / "device_profiles"
EXPERIMENTS_DIR = SOURCE_ROOT / "experiments"
CACHE_DIR = SOURCE_ROOT / ".cache"


def python_env(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """`base` (this process's environment by default) with the source root first on
    PYTHONPATH, plus `extra`: what a Python started on this host needs to run our modules."""
    env = dict(os.environ if base is None else base, **extra)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SOURCE_ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(SOURCE_ROOT), *paths])
    return env
