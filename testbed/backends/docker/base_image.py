"""The base image `trace-testbed/base:bookworm`, made without any container registry.

A Debian minbase root file system made by debootstrap from the host's own Debian mirror (read
from the apt sources in /etc/apt, one-line and deb822 formats), trimmed, tarred once to
`.cache/base/` and loaded with `docker import`. The image carries the key of what it is made
of (`TESTBED_BASE_KEY`), and a base whose key is current is kept. A base the user names instead
is used as is, and pulled only when they ask for it.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed import voice
from testbed.backends.docker.image_steps import (
    cache_key,
    image_env,
    image_id,
    replace_image,
    run_step,
)
from testbed.errors import ImageError
from testbed.source import CACHE_DIR

log = logging.getLogger(__name__)

DEFAULT_BASE = "trace-testbed/base:bookworm"
SUITE = "bookworm"
BASE_PACKAGES = tuple(
    "python3 python3-venv python3-pip iproute2 ethtool procps ca-certificates".split()
)
# Trimmed from the root file system: documentation and the apt caches debootstrap leaves.
ROOTFS_TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "var/lib/apt/lists")
DPKG_NODOC = "path-exclude=/usr/share/doc/*\npath-exclude=/usr/share/man/*\n"


# ---------------------------------------------------------------------------------------------
# Apt sources (unit-tested without Docker)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AptSource:
    """One binary-package source line of apt."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]


def parse_one_line_sources(text: str) -> list[AptSource]:
    """Parses the classic `deb [options] uri suite component...` format (deb-src is skipped)."""
    sources = []
    for raw in text.splitlines():
        tokens = raw.split("#", 1)[0].split()
        if not tokens or tokens[0] != "deb":
            continue
        tokens = tokens[1:]
        if tokens and tokens[0].startswith("["):  # options: [ arch=amd64 signed-by=... ]
            while tokens and not tokens[0].endswith("]"):
                tokens = tokens[1:]
            tokens = tokens[1:]
        if len(tokens) >= 2:
            sources.append(AptSource(tokens[0], (tokens[1],), tuple(tokens[2:])))
    return sources


def parse_deb822_sources(text: str) -> list[AptSource]:
    """Parses the deb822 `.sources` format (stanzas of `Types:`, `URIs:`, `Suites:` ...)."""
    sources = []
    for stanza in _deb822_stanzas(text):
        enabled = stanza.get("enabled", "yes").strip().lower() not in ("no", "false", "0")
        if "deb" not in stanza.get("types", "").split() or not enabled:
            continue
        suites = tuple(stanza.get("suites", "").split())
        components = tuple(stanza.get("components", "").split())
        for uri in stanza.get("uris", "").split():
            sources.append(AptSource(uri, suites, components))
    return sources


def _deb822_stanzas(text: str) -> list[dict[str, str]]:
    stanzas: list[dict[str, str]] = [{}]
    key = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if not line.strip():
            if stanzas[-1]:
                stanzas.append({})
            key = None
        elif line[0] in " \t" and key is not None:  # continuation of the previous field
            stanzas[-1][key] += " " + line.strip()
        elif ":" in line:
            key, value = line.split(":", 1)
            key = key.strip().lower()
            stanzas[-1][key] = value.strip()
    return [s for s in stanzas if s]


def read_host_sources(apt_dir: Path = Path("/etc/apt")) -> list[AptSource]:
    """All enabled binary sources of the host, in apt's order (disabled-file names are ignored)."""
    sources = []
    main_list = apt_dir / "sources.list"
    if main_list.is_file():
        sources += parse_one_line_sources(main_list.read_text())
    parts = apt_dir / "sources.list.d"
    for path in sorted(parts.glob("*")) if parts.is_dir() else []:
        if path.suffix == ".list":
            sources += parse_one_line_sources(path.read_text())
        elif path.suffix == ".sources":
            sources += parse_deb822_sources(path.read_text())
    return sources


def choose_mirror(sources: Sequence[AptSource], suite: str = SUITE) -> str:
    """The first http(s)/file source that carries `suite` itself with component main."""
    for source in sources:
        scheme = source.uri.split(":", 1)[0]
        if scheme in ("http", "https", "file") and suite in source.suites:
            if "main" in source.components:
                return source.uri
    raise ImageError(
        f"no Debian mirror for suite '{suite}' (component main) in /etc/apt/sources.list(.d); "
        "pass --mirror URL or --base IMAGE"
    )


# ---------------------------------------------------------------------------------------------
# Base image (debootstrap -> cached tarball -> docker import)
# ---------------------------------------------------------------------------------------------
def base_key(machine: str) -> str:
    """Identifies the base's contents: a new package list or suite gives a new base."""
    return cache_key(SUITE, "minbase", BASE_PACKAGES, machine, ROOTFS_TRIM, DPKG_NODOC)


def rootfs_tarball(cache: Path, key: str) -> Path:
    return cache / "base" / f"rootfs-{SUITE}-{platform.machine()}-{key}.tar"


def _base_is_current(key: str) -> bool:
    if image_id(DEFAULT_BASE) is None:
        return False
    return image_env(DEFAULT_BASE).get("TESTBED_BASE_KEY") == key


def _debootstrap_problem() -> str | None:
    if shutil.which("debootstrap") is None:
        return "building the base image needs debootstrap (apt-get install debootstrap)"
    if os.geteuid() != 0:
        return "building the base image needs root (debootstrap)"
    return None


def default_base_problem(cache: Path = CACHE_DIR) -> str | None:
    """Why `DEFAULT_BASE` cannot be made on this machine, or None (it exists or can be made)."""
    key = base_key(platform.machine())
    if _base_is_current(key) or rootfs_tarball(cache, key).is_file():
        return None
    return _debootstrap_problem()


def ensure_default_base(cache: Path, mirror: str | None, rebuild: bool) -> None:
    """Makes `DEFAULT_BASE` present and current, from the cached tarball when there is one."""
    key = base_key(platform.machine())
    if not rebuild and _base_is_current(key):
        log.info("base image %s is current", DEFAULT_BASE)
        return
    tarball = rootfs_tarball(cache, key)
    if rebuild or not tarball.is_file():
        mirror = mirror or choose_mirror(read_host_sources())
        doing = f"debootstrap {SUITE} from {mirror} (about a minute, once per machine)"
        with voice.phase("base image", doing):
            make_rootfs_tarball(tarball, mirror)
    voice.say(f"base image: docker import {DEFAULT_BASE}")
    changes = ['CMD ["/bin/bash"]', "ENV LANG=C.UTF-8", f"ENV TESTBED_BASE_KEY={key}"]
    args = ["docker", "import", "--message", f"debootstrap {SUITE} minbase"]
    for change in changes:
        args += ["--change", change]
    replace_image(DEFAULT_BASE, "docker import of the base", args + [str(tarball), DEFAULT_BASE])


def make_rootfs_tarball(tarball: Path, mirror: str) -> None:
    """debootstrap into a scratch folder next to `tarball`, trim it and tar it (needs root)."""
    problem = _debootstrap_problem()
    if problem is not None:
        raise ImageError(f"{problem}; or pass --base IMAGE")
    target = tarball.parent / "rootfs.tmp"
    debs = tarball.parent / "debs"  # .deb cache: a second debootstrap downloads nothing
    debs.mkdir(parents=True, exist_ok=True)
    _remove_tree(target)
    args = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}"]
    args += [f"--cache-dir={debs}", SUITE, str(target), mirror]
    run_step("debootstrap", args)
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
            "from its registry, or omit --base to build the local base"
        )
    run_step(f"docker pull {base}", ["docker", "pull", base])
