"""The worker image, built without any container registry.

Three pieces, each cached so that a rebuild after a code change takes seconds:

- the base image `trace-testbed/base:bookworm`: a Debian minbase root file system made by
  debootstrap from the host's own Debian mirror (read from /etc/apt), tarred once to
  `.cache/base/` and loaded with `docker import`. A base the user names with `--base` is used
  as is, and pulled only when they also pass `--pull`.
- the wheelhouse `.cache/wheelhouse/`: `pip download` on the host of the project's runtime
  dependencies (pyproject's `[project].dependencies` plus its build backend), for the base
  image's CPython 3.11 on glibc 2.36. The testbed extra (pandas, docker ...) is host-only.
- `devices/Dockerfile`: installs the wheelhouse into a venv with `--no-index`, then the
  project sources with `--no-deps --no-index`. `docker build` runs with `--network none`, so
  a build that works proves nothing came from the network.

Usage: `python -m testbed.image build [--base IMAGE [--pull]] [--tag TAG]`.
This module uses the docker CLI (argument lists only) and must never import torch.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from testbed.dockerd import engine_answers
from testbed.errors import ImageError, TestbedError

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
WORKER_TAG = "trace-testbed/worker:latest"
DEFAULT_BASE = "trace-testbed/base:bookworm"
DOCKERFILE = "devices/Dockerfile"
SUITE = "bookworm"
BASE_PACKAGES = tuple(
    "python3 python3-venv python3-pip iproute2 ethtool procps ca-certificates".split()
)
BASE_PYTHON = "3.11"  # CPython of Debian bookworm, whose wheels the wheelhouse holds
BASE_GLIBC_MINOR = 36  # bookworm ships glibc 2.36
# Trimmed from the root file system: documentation and the apt caches debootstrap leaves.
ROOTFS_TRIM = ("usr/share/doc", "usr/share/man", "usr/share/info", "var/lib/apt/lists")
DPKG_NODOC = "path-exclude=/usr/share/doc/*\npath-exclude=/usr/share/man/*\n"
OUTPUT_TAIL_LINES = 40
SOURCE_LABEL = "trace-testbed.source"  # the key of the sources an image was built from
SOURCE_DIRS = ("tracevq", "devices", "testbed")  # what the Dockerfile copies, with these:
SOURCE_FILES = (DOCKERFILE, "pyproject.toml", ".dockerignore")


# ---------------------------------------------------------------------------------------------
# Pure parts: apt sources, requirements, wheel platforms (unit-tested without Docker)
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


def _key(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------
def run_step(step: str, args: Sequence[str], *, capture: bool = False) -> str:
    """Runs one command; raises ImageError naming `step` with the output's tail on failure.

    With `capture`, stdout is returned and stderr kept apart; otherwise both are merged,
    logged line by line at DEBUG (long steps such as debootstrap stay visible with -v).
    """
    log.debug("%s: %s", step, shlex.join(args))
    if capture:
        proc = subprocess.run(args, capture_output=True, text=True, errors="replace")
        if proc.returncode != 0:
            raise _step_error(step, args, proc.returncode, proc.stderr.splitlines())
        return proc.stdout
    tail: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
    with subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.debug("  %s", line.rstrip())
            tail.append(line.rstrip())
    if proc.returncode != 0:
        raise _step_error(step, args, proc.returncode, list(tail))
    return ""


def _step_error(step: str, args: Sequence[str], code: int, lines: list[str]) -> ImageError:
    tail = "\n".join(lines[-OUTPUT_TAIL_LINES:]) or "(no output)"
    return ImageError(f"{step} failed (exit {code}): {shlex.join(args)}\n{tail}")


def image_id(tag: str) -> str | None:
    """The image's id, or None when no such image is present locally."""
    args = ["docker", "image", "inspect", "--format", "{{.Id}}", tag]
    log.debug("check image: %s", shlex.join(args))
    proc = subprocess.run(args, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _inspect(tag: str, template: str) -> str:
    args = ["docker", "image", "inspect", "--format", template, tag]
    return run_step(f"docker image inspect {tag}", args, capture=True)


def image_env(tag: str) -> dict[str, str]:
    out = _inspect(tag, "{{range .Config.Env}}{{println .}}{{end}}")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def image_size_bytes(tag: str) -> int:
    return int(_inspect(tag, "{{.Size}}").strip())


# ---------------------------------------------------------------------------------------------
# Base image (debootstrap -> cached tarball -> docker import)
# ---------------------------------------------------------------------------------------------
def base_key(machine: str) -> str:
    """Identifies the base's contents: a new package list or suite gives a new base."""
    return _key(SUITE, "minbase", BASE_PACKAGES, machine, ROOTFS_TRIM, DPKG_NODOC)


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


def default_base_problem(cache: Path = PROJECT_ROOT / ".cache") -> str | None:
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
        make_rootfs_tarball(tarball, mirror or choose_mirror(read_host_sources()))
    log.info("importing %s from %s", DEFAULT_BASE, tarball)
    changes = ['CMD ["/bin/bash"]', "ENV LANG=C.UTF-8", f"ENV TESTBED_BASE_KEY={key}"]
    args = ["docker", "import", "--message", f"debootstrap {SUITE} minbase"]
    for change in changes:
        args += ["--change", change]
    _replacing(DEFAULT_BASE, "docker import of the base", args + [str(tarball), DEFAULT_BASE])


def make_rootfs_tarball(tarball: Path, mirror: str) -> None:
    """debootstrap into a scratch folder next to `tarball`, trim it and tar it (needs root)."""
    problem = _debootstrap_problem()
    if problem is not None:
        raise ImageError(f"{problem}; or pass --base IMAGE")
    target = tarball.parent / "rootfs.tmp"
    debs = tarball.parent / "debs"  # .deb cache: a second debootstrap downloads nothing
    debs.mkdir(parents=True, exist_ok=True)
    _remove_tree(target)
    log.info("debootstrap %s from %s (about a minute, once)", SUITE, mirror)
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


# ---------------------------------------------------------------------------------------------
# Wheelhouse and worker image
# ---------------------------------------------------------------------------------------------
def ensure_wheelhouse(root: Path) -> Path:
    """Downloads the runtime wheels once per requirement set; returns the wheelhouse folder."""
    wheelhouse = root / ".cache" / "wheelhouse"
    requirements = runtime_requirements(root / "pyproject.toml")
    machine = platform.machine()
    key = _key(requirements, BASE_PYTHON, wheel_platforms(machine))
    if (wheelhouse / ".key").is_file() and (wheelhouse / ".key").read_text() == key:
        log.info("wheelhouse %s is current", wheelhouse)
        return wheelhouse
    fresh = wheelhouse.with_name("wheelhouse.partial")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    (fresh / "requirements.txt").write_text("\n".join(requirements) + "\n")
    log.info("downloading wheels: %s", ", ".join(requirements))
    args = pip_download_args(fresh / "requirements.txt", fresh, machine)
    run_step("pip download of the wheelhouse", args)
    (fresh / ".key").write_text(key)
    shutil.rmtree(wheelhouse, ignore_errors=True)
    fresh.rename(wheelhouse)
    return wheelhouse


def _replacing(tag: str, step: str, args: list[str]) -> None:
    """Runs a command that (re)makes `tag`, then removes the image the tag pointed to before.

    Without this every rebuild would leave a dangling GB-sized image behind. A removal that
    fails (a container still uses the old image) is only logged.
    """
    previous = image_id(tag)
    run_step(step, args)
    if previous is not None and previous != image_id(tag):
        removal = ["docker", "image", "rm", previous]
        log.debug("remove replaced image: %s", shlex.join(removal))
        proc = subprocess.run(removal, capture_output=True, text=True)
        if proc.returncode != 0:
            log.debug("kept %s: %s", previous, proc.stderr.strip())


def build_image(
    tag: str = WORKER_TAG,
    base: str | None = None,
    *,
    pull: bool = False,
    mirror: str | None = None,
    rebuild_base: bool = False,
    root: Path = PROJECT_ROOT,
) -> str:
    """Builds the worker image from local sources only and returns its tag.

    The Dockerfile's `deps` stage (the venv of wheels) is tagged `<repository>-deps` so that
    its cache survives `docker image prune` and a replaced one can be removed.
    """
    if shutil.which("docker") is None:
        raise ImageError("the docker CLI is not installed (apt-get install docker.io)")
    if not engine_answers():
        raise ImageError("the Docker engine is not answering; start it with `make docker-up`")
    if base is None:
        base = DEFAULT_BASE
        ensure_default_base(root / ".cache", mirror, rebuild_base)
    else:
        ensure_named_base(base, pull)
    wheelhouse = ensure_wheelhouse(root)
    key = source_key(root, image_id(base), (wheelhouse / ".key").read_text())
    if image_id(tag) is not None and _inspect(tag, _label_template(SOURCE_LABEL)).strip() == key:
        log.info("%s is current (sources %s)", tag, key)
        return tag
    build = ["docker", "build", "--network", "none", "--file", str(root / DOCKERFILE)]
    build += ["--build-arg", f"BASE={base}"]
    deps_tag = tag.rsplit(":", 1)[0] + "-deps:latest"
    log.info("docker build %s (base %s)", tag, base)
    deps_build = build + ["--target", "deps", "--tag", deps_tag, str(root)]
    _replacing(deps_tag, "docker build of the wheel venv", deps_build)
    labelled = build + ["--label", f"{SOURCE_LABEL}={key}", "--tag", tag, str(root)]
    _replacing(tag, "docker build of the worker image", labelled)
    return tag


def source_key(root: Path, *extra: object) -> str:
    """Identifies what a worker image is built from: the files the Dockerfile copies (caches
    excluded, as in .dockerignore) and `extra` (the base's id, the wheelhouse's key). Equal
    keys let a run skip `docker build`, whose cached no-op still costs seconds."""
    digest = hashlib.sha256(repr(extra).encode())
    paths = [root / name for name in SOURCE_FILES]
    for directory in SOURCE_DIRS:
        paths += sorted(
            path
            for path in (root / directory).rglob("*")
            if path.is_file()
            and "__pycache__" not in path.parts
            and path.suffix != ".pyc"
            and not any(part.endswith(".egg-info") for part in path.parts)
        )
    for path in paths:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"(missing)")
    return digest.hexdigest()[:16]


def _label_template(label: str) -> str:
    return '{{index .Config.Labels "' + label + '"}}'


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.image",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build the worker image without any registry")
    build.add_argument("--tag", default=WORKER_TAG)
    build.add_argument("--base", help=f"base image used as is (default: local {DEFAULT_BASE})")
    build.add_argument("--pull", action="store_true", help="pull --base if it is not local")
    build.add_argument("--mirror", help="Debian mirror for debootstrap (default: the host's)")
    build.add_argument("--rebuild-base", action="store_true", help="debootstrap the base again")
    build.add_argument("-v", "--verbose", action="store_true", help="log every command")
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s")
    started = time.monotonic()
    try:
        tag = build_image(
            args.tag, args.base, pull=args.pull, mirror=args.mirror, rebuild_base=args.rebuild_base
        )
        size_mb = image_size_bytes(tag) / 1e6
    except TestbedError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"built {tag} ({size_mb:.0f} MB) in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
