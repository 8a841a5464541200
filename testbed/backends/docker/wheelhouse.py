"""The wheelhouse `.cache/wheelhouse/`: the worker image's runtime wheels, downloaded once.

`pip download` on the host of the project's runtime dependencies (pyproject's
`[project].dependencies` plus its build backend) for the base image's CPython and glibc
(bookworm's 3.11 and 2.36, noble's 3.12 and 2.39 ...), whatever the host's Python; the testbed
extra (pandas, docker ...) stays host-only. torch is the CPU build: PyPI's x86_64 torch is the
CUDA one, with gigabytes of nvidia wheels a CPU device never loads: taken from pip's own
indexes where they have it (a mirror, a wheel folder), else from torch's CPU index. The folder
is downloaded again only when that requirement set or its target changes.
"""

from __future__ import annotations

import logging
import platform
import re
import shutil
import sys
import tomllib
from pathlib import Path

from testbed import voice
from testbed.backends.docker.image_steps import cache_key, run_step
from testbed.errors import ImageError

log = logging.getLogger(__name__)

# where torch's CPU builds are (`torch==2.13.0+cpu`): on x86_64 PyPI has only the CUDA build
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_BUILD_MACHINES = ("x86_64",)


def runtime_requirements(pyproject: Path) -> list[str]:
    """What the worker image installs: `[project].dependencies` plus the build backend.

    The build backend (setuptools) is needed because the project itself is installed offline
    with `--no-build-isolation`. Optional extras (testbed, train, dev) stay on the host.
    """
    data = tomllib.loads(pyproject.read_text())
    requirements = list(data["project"].get("dependencies", []))
    requirements += data.get("build-system", {}).get("requires", [])
    return list(dict.fromkeys(requirements))


def required_python(pyproject: Path) -> tuple[int, int]:
    """The oldest CPython the project installs on: `requires-python = ">=3.11"` gives (3, 11)."""
    spec = tomllib.loads(pyproject.read_text())["project"].get("requires-python", "")
    match = re.search(r">=\s*(\d+)\.(\d+)", spec)
    return (int(match.group(1)), int(match.group(2))) if match else (3, 0)


def wheel_platforms(machine: str, glibc_minor: int) -> list[str]:
    """pip `--platform` tags a glibc-2.<glibc_minor> system accepts, newest first.

    pip does not expand `manylinux_2_36` to older manylinux tags by itself, so list them all.
    """
    oldest = 5 if machine in ("x86_64", "i686") else 17
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(glibc_minor, oldest - 1, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags += [f"{name}_{machine}" for minor, name in legacy.items() if minor >= oldest]
    return tags


def cpu_torch_constraints(requirements: list[str], machine: str) -> list[str]:
    """Constraints that hold an exact torch pin to its CPU build where PyPI's is CUDA's.

    `torch==2.13.0` stays the requirement (the image installs it as such); the constraint
    `torch==2.13.0+cpu` makes pip fail rather than fall back to the CUDA build.
    """
    if machine not in CUDA_BUILD_MACHINES:
        return []
    constraints = []
    for requirement in requirements:
        name, sep, version = requirement.replace(" ", "").partition("==")
        if sep and name.lower() == "torch" and "+" not in version:
            constraints.append(f"torch=={version}+cpu")
    return constraints


def pip_download_args(
    requirements_file: Path,
    dest: Path,
    machine: str,
    python: str,
    glibc_minor: int,
    torch_index: bool = True,
) -> list[str]:
    """The `pip download` command for the base image's Python, whatever the host's Python.

    The requirement file's folder may hold `constraints.txt` (`cpu_torch_constraints`);
    `torch_index` then adds torch's CPU index to pip's own.
    """
    args = [sys.executable, "-m", "pip", "download", "--dest", str(dest)]
    args += ["--requirement", str(requirements_file), "--only-binary=:all:"]
    constraints = requirements_file.with_name("constraints.txt")
    if constraints.is_file():
        args += ["--constraint", str(constraints)]
        if torch_index:
            args += ["--extra-index-url", TORCH_CPU_INDEX]
    args += ["--python-version", python, "--implementation", "cp"]
    for tag in wheel_platforms(machine, glibc_minor):
        args += ["--platform", tag]
    return args


def ensure_wheelhouse(root: Path, python: str, glibc_minor: int) -> Path:
    """Downloads the runtime wheels for CPython `python` on glibc 2.<glibc_minor> once per
    requirement set; returns the wheelhouse folder."""
    wheelhouse = root / ".cache" / "wheelhouse"
    requirements = runtime_requirements(root / "pyproject.toml")
    machine = platform.machine()
    key = cache_key(requirements, python, wheel_platforms(machine, glibc_minor))
    if (wheelhouse / ".key").is_file() and (wheelhouse / ".key").read_text() == key:
        log.info("wheelhouse %s is current", wheelhouse)
        return wheelhouse
    fresh = wheelhouse.with_name("wheelhouse.partial")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    (fresh / "requirements.txt").write_text("\n".join(requirements) + "\n")
    constraints = cpu_torch_constraints(requirements, machine)
    if constraints:
        (fresh / "constraints.txt").write_text("\n".join(constraints) + "\n")
    doing = f"pip download of {len(requirements)} runtime packages for CPython {python}"
    with voice.phase("wheelhouse", doing):
        if constraints:
            _download_cpu_torch(fresh, machine, python, glibc_minor, constraints)
        else:
            args = pip_download_args(
                fresh / "requirements.txt", fresh, machine, python, glibc_minor
            )
            run_step("pip download of the wheelhouse", args)
    (fresh / ".key").write_text(key)
    shutil.rmtree(wheelhouse, ignore_errors=True)
    fresh.rename(wheelhouse)
    return wheelhouse


def _download_cpu_torch(
    fresh: Path, machine: str, python: str, glibc_minor: int, constraints: list[str]
) -> None:
    """From pip's own indexes first: a mirror or a wheel folder that has torch's CPU build
    needs nothing else, and a machine without internet access would otherwise wait on every
    package's retries at torch's index (2 min 20 s here); then, where they lack it, with
    torch's CPU index added (what was downloaded stays)."""
    requirements = fresh / "requirements.txt"
    try:
        run_step(
            "pip download from pip's own indexes",
            pip_download_args(requirements, fresh, machine, python, glibc_minor, False),
        )
        return
    except ImageError:
        log.info("pip's own indexes lack %s: adding %s", ", ".join(constraints), TORCH_CPU_INDEX)
    run_step(  # what to look at when torch's CPU build was not found
        f"pip download of the wheelhouse ({', '.join(constraints)}: from {TORCH_CPU_INDEX} "
        "or pip's own index)",
        pip_download_args(requirements, fresh, machine, python, glibc_minor),
    )
