"""The base image `trace-testbed/base:<suite>`, made without any container registry.

A minbase root file system of the host's own Debian or Ubuntu suite (`suite`: bookworm on this
project's Debian hosts, noble on Ubuntu 24.04), made by debootstrap from the mirror the host's
apt uses, trimmed, tarred once to `.cache/base/` and loaded with `docker import`. The image
carries the key of what it is made of (`TESTBED_BASE_KEY`), and a base whose key is current is
kept. A base the user names instead is used as is, and pulled only when they ask for it.
"""

from __future__ import annotations

import logging
import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

from testbed import voice
from testbed.backends.docker.image_steps import (
    cache_key,
    image_env,
    image_id,
    replace_image,
    run_step,
)
from testbed.backends.docker.suite import (
    Debootstrap,
    Suite,
    host_plan,
    host_suite,
    keyring_problem,
    read_os_release,
    runtime_problem,
)
from testbed.backends.docker.wheelhouse import required_python
from testbed.errors import ImageError
from testbed.source import CACHE_DIR, SOURCE_ROOT

log = logging.getLogger(__name__)

BASE_PACKAGES = tuple(
    "python3 python3-venv python3-pip iproute2 ethtool procps ca-certificates".split()
)
# Trimmed from the root file system: documentation and the apt caches debootstrap leaves.
ROOTFS_TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "var/lib/apt/lists")
DPKG_NODOC = "path-exclude=/usr/share/doc/*\npath-exclude=/usr/share/man/*\n"
# what a named base says of itself, for the wheelhouse: "3.11 glibc 2.36"
RUNTIME_PROBE = "import platform, sys; print('%d.%d' % sys.version_info[:2], *platform.libc_ver())"


def default_suite() -> Suite:
    """The suite of the base made here: the host's own (bookworm on a host of another family)."""
    return host_suite(read_os_release(), _project_python())


def _project_python() -> tuple[int, int]:
    return required_python(SOURCE_ROOT / "pyproject.toml")


# ---------------------------------------------------------------------------------------------
# Base image (debootstrap -> cached tarball -> docker import)
# ---------------------------------------------------------------------------------------------
def base_key(suite: Suite, machine: str) -> str:
    """Identifies the base's contents: a new package list or suite gives a new base."""
    return cache_key(suite.name, "minbase", BASE_PACKAGES, machine, ROOTFS_TRIM, DPKG_NODOC)


def rootfs_tarball(cache: Path, suite: Suite, key: str) -> Path:
    return cache / "base" / f"rootfs-{suite.name}-{platform.machine()}-{key}.tar"


def debootstrap_args(plan: Debootstrap, target: Path, debs: Path) -> list[str]:
    """The debootstrap command of `plan` into `target`, keeping the .debs in `debs`."""
    args = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}"]
    components = plan.suite.family.components
    if components != ("main",):
        args.append(f"--components={','.join(components)}")
    args += [f"--keyring={plan.keyring}", f"--cache-dir={debs}"]
    args += [plan.suite.name, str(target), plan.mirror]
    return args if plan.script is None else [*args, plan.script]


def _base_is_current(suite: Suite, key: str) -> bool:
    if image_id(suite.tag) is None:
        return False
    return image_env(suite.tag).get("TESTBED_BASE_KEY") == key


def _debootstrap_problem() -> str | None:
    if shutil.which("debootstrap") is None:
        return "building the base image needs debootstrap (apt-get install debootstrap)"
    if os.geteuid() != 0:
        return "building the base image needs root (debootstrap)"
    return None


def default_base_problem(cache: Path = CACHE_DIR) -> str | None:
    """Why the host's default base cannot be made here, or None (it exists or can be made)."""
    suite = default_suite()
    key = base_key(suite, platform.machine())
    if _base_is_current(suite, key) or rootfs_tarball(cache, suite, key).is_file():
        return None
    return _debootstrap_problem()


def ensure_default_base(cache: Path, mirror: str | None, rebuild: bool) -> Suite:
    """Makes the host suite's base present and current, from the cached tarball when there is
    one; returns its suite (the image's tag and Python follow from it)."""
    suite = default_suite()
    key = base_key(suite, platform.machine())
    if not rebuild and _base_is_current(suite, key):
        log.info("base image %s is current", suite.tag)
        return suite
    tarball = rootfs_tarball(cache, suite, key)
    if rebuild or not tarball.is_file():
        plan = host_plan(mirror, min_python=_project_python())
        doing = f"debootstrap {suite.name} from {plan.mirror} (about a minute, once per machine)"
        with voice.phase("base image", doing):
            make_rootfs_tarball(tarball, plan)
    voice.say(f"base image: docker import {suite.tag}")
    changes = ['CMD ["/bin/bash"]', "ENV LANG=C.UTF-8", f"ENV TESTBED_BASE_KEY={key}"]
    args = ["docker", "import", "--message", f"debootstrap {suite.name} minbase"]
    for change in changes:
        args += ["--change", change]
    replace_image(suite.tag, "docker import of the base", args + [str(tarball), suite.tag])
    return suite


def make_rootfs_tarball(tarball: Path, plan: Debootstrap) -> None:
    """debootstrap into a scratch folder next to `tarball`, trim it and tar it (needs root)."""
    problem = _debootstrap_problem() or keyring_problem(plan)
    if problem is not None:
        raise ImageError(f"{problem}; or set TESTBED_BASE=IMAGE")
    target = tarball.parent / "rootfs.tmp"
    debs = tarball.parent / "debs"  # .deb cache: a second debootstrap downloads nothing
    debs.mkdir(parents=True, exist_ok=True)
    _remove_tree(target)
    run_step("debootstrap", debootstrap_args(plan, target, debs))
    problem = runtime_problem(plan.suite, (target / "var/lib/dpkg/status").read_text())
    if problem is not None:
        raise ImageError(problem)
    _trim_rootfs(target)
    partial = tarball.with_suffix(".tar.partial")
    args = ["tar", "--create", "--file", str(partial), "--directory", str(target)]
    args += ["--numeric-owner", "--one-file-system", "--exclude=./dev/*", "."]
    run_step("tar of the base root file system", args)
    partial.replace(tarball)
    _remove_tree(target)


def _trim_rootfs(target: Path) -> None:
    for relative in ROOTFS_TRIM:
        for child in (target / relative).glob("*"):
            if child.name in ("lock", "partial"):  # apt expects these in var/lib/apt/lists
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    apt_cache = target / "var/cache/apt"
    for leftover in [*apt_cache.glob("*.bin"), *apt_cache.glob("archives/*.deb")]:
        leftover.unlink()
    (target / "etc/dpkg/dpkg.cfg.d/01-testbed-nodoc").write_text(DPKG_NODOC)


def _remove_tree(path: Path) -> None:
    """rmtree that first unmounts what a failed debootstrap may have left mounted below."""
    if not path.exists():
        return
    prefix = str(path.resolve()) + "/"
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mountpoint in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        run_step("unmount leftover", ["umount", "--lazy", mountpoint])
    shutil.rmtree(path)


def ensure_named_base(base: str, pull: bool) -> None:
    """A base the user named: used as is; pulled only if they asked for it."""
    if image_id(base) is not None:
        return
    if not pull:
        raise ImageError(
            f"base image {base!r} is not present locally; pass --pull to pull it "
            "from its registry, or omit --base (and TESTBED_BASE) to build the local base"
        )
    run_step(f"docker pull {base}", ["docker", "pull", base])


def named_base_runtime(base: str) -> tuple[str, int]:
    """The CPython version and glibc minor of a base the user named, asked of the image."""
    args = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3"]
    args += [base, "-c", RUNTIME_PROBE]
    log.debug("python of the base: %s", shlex.join(args))
    proc = subprocess.run(args, capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ImageError(f"base image {base!r} cannot run python3, which the worker needs: {last}")
    return parse_runtime_report(base, proc.stdout)


def parse_runtime_report(base: str, report: str) -> tuple[str, int]:
    """("3.11", 36) from RUNTIME_PROBE's "3.11 glibc 2.36"."""
    words = report.split()
    if len(words) == 3 and words[1] == "glibc" and words[2].startswith("2."):
        return words[0], int(words[2].split(".")[1])
    raise ImageError(
        f"base image {base!r} reports python3 and libc {report.strip()!r}: the wheelhouse "
        "holds manylinux wheels, which need CPython on glibc"
    )
