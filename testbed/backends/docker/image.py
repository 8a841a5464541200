"""The worker image, built without any container registry.

Three pieces, each cached so that a rebuild after a code change takes seconds:

- the base image `trace-testbed/base:<suite>`: a minbase root file system of the host's own
  Debian or Ubuntu suite (bookworm here, noble on Ubuntu 24.04; bookworm on a host of another
  family, given --mirror) made by debootstrap from the host's own mirror (read from /etc/apt),
  tarred once to `.cache/base/` and loaded with `docker import`. A base the user names with
  `--base` (or `TESTBED_BASE`, which every run's build reads too) is used as is, and pulled
  only when they also pass `--pull`.
- the wheelhouse `.cache/wheelhouse/`: `pip download` on the host of the project's runtime
  dependencies (pyproject's `[project].dependencies` plus its build backend, torch's CPU
  build), for the base image's CPython and glibc (the suite's, or those a named base reports).
  The testbed extra (pandas, docker ...) is host-only.
- `devices/Dockerfile`: installs the wheelhouse into a venv with `--no-index`, then the
  project sources with `--no-deps --no-index`. `docker build` runs with `--network none`, so
  a build that works proves nothing came from the network.

Usage: `python -m testbed.backends.docker.image build [--base IMAGE [--pull]] [--tag TAG]`.
This module uses the docker CLI (argument lists only) and must never import torch.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from testbed import voice
from testbed.backends.docker.base_image import (
    ensure_default_base,
    ensure_named_base,
    named_base_runtime,
)
from testbed.backends.docker.engine import engine_answers
from testbed.backends.docker.image_steps import (
    image_id,
    image_size_bytes,
    inspect_image,
    replace_image,
)
from testbed.backends.docker.wheelhouse import ensure_wheelhouse
from testbed.errors import ImageError, TestbedError
from testbed.source import SOURCE_ROOT

WORKER_TAG = "trace-testbed/worker:latest"
DOCKERFILE = "devices/Dockerfile"
SOURCE_LABEL = "trace-testbed.source"  # the key of the sources an image was built from
SOURCE_DIRS = ("tracevq", "devices", "testbed")  # what the Dockerfile copies, with these:
SOURCE_FILES = (DOCKERFILE, "pyproject.toml", ".dockerignore")
# a base image used as is by `make image` and by every run's build (a host that cannot
# debootstrap its own suite: docs/user-guide.md, Setup)
BASE_ENV = "TESTBED_BASE"


def build_image(
    tag: str = WORKER_TAG,
    base: str | None = None,
    *,
    pull: bool = False,
    mirror: str | None = None,
    rebuild_base: bool = False,
    root: Path = SOURCE_ROOT,
) -> str:
    """Builds the worker image from local sources only and returns its tag.

    The Dockerfile's `deps` stage (the venv of wheels) is tagged `<repository>-deps` so that
    its cache survives `docker image prune` and a replaced one can be removed.
    """
    if shutil.which("docker") is None:
        raise ImageError("the docker CLI is not installed (apt-get install docker.io)")
    if not engine_answers():
        raise ImageError("the Docker engine is not answering; start it with `make docker-up`")
    base = base or os.environ.get(BASE_ENV) or None
    if base is None:
        suite = ensure_default_base(root / ".cache", mirror, rebuild_base)
        base, python, glibc_minor = suite.tag, suite.python, suite.glibc_minor
    else:
        ensure_named_base(base, pull)
        python, glibc_minor = named_base_runtime(base)
    wheelhouse = ensure_wheelhouse(root, python, glibc_minor)
    key = source_key(root, image_id(base), (wheelhouse / ".key").read_text())
    if (
        image_id(tag) is not None
        and inspect_image(tag, _label_template(SOURCE_LABEL)).strip() == key
    ):
        voice.say(f"worker image: {tag} is current (sources {key})")
        return tag
    build = ["docker", "build", "--network", "none", "--file", str(root / DOCKERFILE)]
    build += ["--build-arg", f"BASE={base}"]
    deps_tag = tag.rsplit(":", 1)[0] + "-deps:latest"
    deps_build = build + ["--target", "deps", "--tag", deps_tag, str(root)]
    with voice.phase("worker image", f"docker build {tag} (base {base}, no network)"):
        replace_image(deps_tag, "docker build of the wheel venv", deps_build, say_steps=True)
        labelled = build + ["--label", f"{SOURCE_LABEL}={key}", "--tag", tag, str(root)]
        replace_image(tag, "docker build of the worker image", labelled, say_steps=True)
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
        prog="python -m testbed.backends.docker.image",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build the worker image without any registry")
    build.add_argument("--tag", default=WORKER_TAG)
    build.add_argument(
        "--base",
        help=f"base image used as is (default: ${BASE_ENV}, else the local "
        "trace-testbed/base:<the host's suite>)",
    )
    build.add_argument("--pull", action="store_true", help="pull --base if it is not local")
    build.add_argument(
        "--mirror",
        help="mirror of the host's Debian or Ubuntu suite for debootstrap (default: the host's "
        "apt source); on a host of another family, a Debian mirror (bookworm)",
    )
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
