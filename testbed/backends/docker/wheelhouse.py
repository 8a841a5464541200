"""The wheelhouse `.cache/wheelhouse/`: the worker image's runtime wheels, downloaded once.

`pip download` on the host of the project's runtime dependencies (pyproject's
`[project].dependencies` plus its build backend) for the base image's CPython 3.11 on glibc
2.36, whatever the host's Python; the testbed extra (pandas, docker ...) stays host-only. The
folder is downloaded again only when that requirement set changes.
"""

from __future__ import annotations

import logging
import platform
import shutil
import sys
import tomllib
from pathlib import Path

from testbed import voice
from testbed.backends.docker.image_steps import cache_key, run_step

log = logging.getLogger(__name__)

BASE_PYTHON = "3.11"  # CPython of Debian bookworm, whose wheels the wheelhouse holds
BASE_GLIBC_MINOR = 36  # bookworm ships glibc 2.36


def runtime_requirements(pyproject: Path) -> list[str]:
    """What the worker image installs: `[project].dependencies` plus the build backend.

    The build backend (setuptools) is needed because the project itself is installed offline
    with `--no-build-isolation`. Optional extras (testbed, train, dev) stay on the host.
    """
    data = tomllib.loads(pyproject.read_text())
    requirements = list(data["project"].get("dependencies", []))
    requirements += data.get("build-system", {}).get("requires", [])
    return list(dict.fromkeys(requirements))


def wheel_platforms(machine: str, glibc_minor: int = BASE_GLIBC_MINOR) -> list[str]:
    """pip `--platform` tags a glibc-2.<glibc_minor> system accepts, newest first.

    pip does not expand `manylinux_2_36` to older manylinux tags by itself, so list them all.
    """
    oldest = 5 if machine in ("x86_64", "i686") else 17
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(glibc_minor, oldest - 1, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{name}_{machine}" for minor, name in legacy.items() if minor >= oldest]
    return tags


def pip_download_args(requirements_file: Path, dest: Path, machine: str) -> list[str]:
    """The `pip download` command for the base image's Python, whatever the host's Python."""
    args = [sys.executable, "-m", "pip", "download", "--dest", str(dest)]
    args += ["--requirement", str(requirements_file), "--only-binary=:all:"]
    args += ["--python-version", BASE_PYTHON, "--implementation", "cp"]
    for tag in wheel_platforms(machine):
        args += ["--platform", tag]
    return args


def ensure_wheelhouse(root: Path) -> Path:
    """Downloads the runtime wheels once per requirement set; returns the wheelhouse folder."""
    wheelhouse = root / ".cache" / "wheelhouse"
    requirements = runtime_requirements(root / "pyproject.toml")
    machine = platform.machine()
    key = cache_key(requirements, BASE_PYTHON, wheel_platforms(machine))
    if (wheelhouse / ".key").is_file() and (wheelhouse / ".key").read_text() == key:
        log.info("wheelhouse %s is current", wheelhouse)
        return wheelhouse
    fresh = wheelhouse.with_name("wheelhouse.partial")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    (fresh / "requirements.txt").write_text("\n".join(requirements) + "\n")
    args = pip_download_args(fresh / "requirements.txt", fresh, machine)
    with voice.phase("wheelhouse", f"pip download of {len(requirements)} runtime packages"):
        run_step("pip download of the wheelhouse", args)
    (fresh / ".key").write_text(key)
    shutil.rmtree(wheelhouse, ignore_errors=True)
    fresh.rename(wheelhouse)
    return wheelhouse
