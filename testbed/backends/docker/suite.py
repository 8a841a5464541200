"""Which Debian or Ubuntu suite the base image is made of, and from where.

The host's own distribution decides: `/etc/os-release` names it (an Ubuntu derivative such as
Linux Mint through its UBUNTU_CODENAME), and the mirror is the one the host's apt already uses
for that suite (classic `sources.list` lines and deb822 `.sources` stanzas both), checked with
the keyring apt trusts for it. A suite known here says which CPython and glibc its base has,
so that the wheelhouse downloads wheels for them. A host of another family (Fedora, Arch), or
a suite not known here, gets the default, Debian bookworm, from a mirror the user names.

Pure functions of files, unit-tested on the files real distributions ship; nothing here runs a
command.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from testbed.errors import ImageError

log = logging.getLogger(__name__)

DEBOOTSTRAP_SCRIPTS = Path("/usr/share/debootstrap/scripts")


@dataclass(frozen=True)
class Family:
    """What the suites of one distribution share."""

    name: str
    keyring: str  # the archive keyring, where apt's source names none
    keyring_package: str
    generic_script: str  # debootstrap's script for a suite newer than the host's debootstrap
    components: tuple[str, ...]  # archive components the base's packages come from


DEBIAN = Family(
    "Debian",
    "/usr/share/keyrings/debian-archive-keyring.gpg",
    "debian-archive-keyring",
    "sid",
    ("main",),
)
# python3-pip is in main on Ubuntu, but a package moved to universe must not stop the build
UBUNTU = Family(
    "Ubuntu",
    "/usr/share/keyrings/ubuntu-archive-keyring.gpg",
    "ubuntu-keyring",
    "gutsy",
    ("main", "universe"),
)


@dataclass(frozen=True)
class Suite:
    """A release the base can be debootstrapped from, with the runtime its packages give."""

    name: str
    family: Family
    python: str  # the CPython of its python3 package: the wheelhouse's target
    glibc_minor: int  # glibc 2.<glibc_minor> of its libc6

    @property
    def tag(self) -> str:
        return f"trace-testbed/base:{self.name}"


SUITES = {
    suite.name: suite
    for suite in (
        Suite("bookworm", DEBIAN, "3.11", 36),  # Debian 12
        Suite("trixie", DEBIAN, "3.13", 41),  # Debian 13
        Suite("jammy", UBUNTU, "3.10", 35),  # Ubuntu 22.04
        Suite("noble", UBUNTU, "3.12", 39),  # Ubuntu 24.04
    )
}
DEFAULT_SUITE = SUITES["bookworm"]
# for a release not in SUITES (Debian testing, an Ubuntu interim release)
FALLBACK_SUITES = {DEBIAN: DEFAULT_SUITE, UBUNTU: SUITES["noble"]}


# ---------------------------------------------------------------------------------------------
# The host's distribution
# ---------------------------------------------------------------------------------------------
def parse_os_release(text: str) -> dict[str, str]:
    """`KEY=value` lines of os-release(5); quotes removed, comments skipped."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key and not key.startswith("#"):
            fields[key] = value.strip().strip("\"'")
    return fields


def read_os_release(etc: Path = Path("/etc")) -> dict[str, str]:
    """The host's os-release fields ({} when it has none: not a systemd-era Linux)."""
    for path in (etc / "os-release", etc.parent / "usr/lib/os-release"):
        if path.is_file():
            return parse_os_release(path.read_text())
    return {}


def host_family(os_release: Mapping[str, str]) -> Family | None:
    """Debian or Ubuntu for those and their derivatives (ID_LIKE), else None."""
    ids = {os_release.get("ID", "")} | set(os_release.get("ID_LIKE", "").split())
    return UBUNTU if "ubuntu" in ids else DEBIAN if "debian" in ids else None


def host_codename(os_release: Mapping[str, str]) -> str | None:
    """The Debian or Ubuntu suite the host runs (a derivative's base suite), or None."""
    family = host_family(os_release)
    if family is None:
        return None
    base_codename = "UBUNTU_CODENAME" if family is UBUNTU else "DEBIAN_CODENAME"
    return os_release.get(base_codename) or os_release.get("VERSION_CODENAME") or None


def host_suite(os_release: Mapping[str, str], min_python: tuple[int, int] = (3, 0)) -> Suite:
    """The host's own suite when it is known here and its CPython is at least `min_python`
    (the project's requires-python); else its family's fallback (Ubuntu 22.04 and an Ubuntu
    interim release get noble), and bookworm for a host of another family."""
    codename = host_codename(os_release)
    suite = SUITES.get(codename or "")
    if suite is not None and _version(suite.python) >= min_python:
        return suite
    fallback = FALLBACK_SUITES.get(host_family(os_release), DEFAULT_SUITE)
    if codename is not None:
        why = (
            "is not one of " + ", ".join(SUITES) if suite is None else f"has Python {suite.python}"
        )
        log.info("the host's suite %s %s: the base is %s", codename, why, fallback.name)
    return fallback


def _version(dotted: str) -> tuple[int, int]:
    major, minor = dotted.split(".")[:2]
    return int(major), int(minor)


def host_name(os_release: Mapping[str, str]) -> str:
    return (
        os_release.get("PRETTY_NAME") or os_release.get("NAME") or "a host without /etc/os-release"
    )


# ---------------------------------------------------------------------------------------------
# Apt sources
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AptSource:
    """One binary-package source of apt."""

    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    signed_by: str | None = None  # the keyring file apt checks this source with, if named


def parse_one_line_sources(text: str) -> list[AptSource]:
    """Parses the classic `deb [options] uri suite component...` format (deb-src is skipped)."""
    sources = []
    for raw in text.splitlines():
        tokens = raw.split("#", 1)[0].split()
        if not tokens or tokens[0] != "deb":
            continue
        tokens = tokens[1:]
        options: dict[str, str] = {}
        if tokens and tokens[0].startswith("["):  # options: [ arch=amd64 signed-by=... ]
            end = next((i for i, t in enumerate(tokens) if t.endswith("]")), len(tokens) - 1)
            for option in " ".join(tokens[: end + 1]).strip("[]").split():
                key, _, value = option.partition("=")
                options[key] = value
            tokens = tokens[end + 1 :]
        if len(tokens) >= 2:
            signed_by = options.get("signed-by")
            sources.append(AptSource(tokens[0], (tokens[1],), tuple(tokens[2:]), signed_by))
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
        signed_by = stanza.get("signed-by") or None
        for uri in stanza.get("uris", "").split():
            sources.append(AptSource(uri, suites, components, signed_by))
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


def choose_source(sources: Sequence[AptSource], suite: str) -> AptSource | None:
    """The first http(s)/file source that carries `suite` itself with component main."""
    for source in sources:
        scheme = source.uri.split(":", 1)[0]
        if scheme in ("http", "https", "file") and suite in source.suites:
            if "main" in source.components:
                return source
    return None


# ---------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Debootstrap:
    """How the base's root file system is made: a suite, from a mirror, checked with a keyring.

    `script` is a debootstrap script's path when the host's debootstrap has none named after the
    suite (an older debootstrap than the suite), else None: debootstrap finds its own.
    """

    suite: Suite
    mirror: str
    keyring: str
    script: str | None


def plan_debootstrap(
    suite: Suite,
    sources: Sequence[AptSource],
    mirror: str | None = None,
    *,
    host: str = "this host",
    scripts: Path = DEBOOTSTRAP_SCRIPTS,
) -> Debootstrap:
    """The suite from `mirror` when given, else from the host source that carries it.

    The keyring is the one the host's apt names for that source, else the family's archive
    keyring: debootstrap checks the mirror's Release file with it.
    """
    if mirror is not None:
        uri, signed_by = mirror, None
    else:
        source = choose_source(sources, suite.name)
        if source is None:
            raise ImageError(
                f"no {suite.family.name} mirror for suite '{suite.name}' (component main) in "
                f"/etc/apt/sources.list(.d) of {host}; pass --mirror URL of a "
                f"{suite.family.name} mirror (make image IMAGE_ARGS='--mirror URL') or set "
                "TESTBED_BASE=IMAGE"
            )
        uri, signed_by = source.uri, source.signed_by
    # Signed-By may also hold fingerprints or a whole key block: only a file is a keyring
    keyring = suite.family.keyring
    if signed_by and signed_by.startswith("/") and len(signed_by.split()) == 1:
        keyring = signed_by
    script = None
    if not (scripts / suite.name).exists():
        script = str(scripts / suite.family.generic_script)
    return Debootstrap(suite, uri, keyring, script)


def host_plan(
    mirror: str | None = None,
    *,
    min_python: tuple[int, int] = (3, 0),
    etc: Path = Path("/etc"),
    scripts: Path = DEBOOTSTRAP_SCRIPTS,
) -> Debootstrap:
    """The plan for this host's base: its own suite (`host_suite`) from its own mirror."""
    os_release = read_os_release(etc)
    suite = host_suite(os_release, min_python)
    sources = read_host_sources(etc / "apt") if mirror is None else []
    codename = host_codename(os_release)
    own_mirror = codename in SUITES or os_release.get("ID") == suite.family.name.lower()
    if codename not in (None, suite.name) and own_mirror:
        # Debian's and Ubuntu's mirrors carry every current suite of their family: the fallback
        # comes from the mirror of the host's own release (not from a derivative's mirror)
        carried = (replace(s, suites=(*s.suites, suite.name)) for s in sources)
        sources = [s for s in carried if codename in s.suites]
    host = host_name(os_release)
    return plan_debootstrap(suite, sources, mirror, host=host, scripts=scripts)


def keyring_problem(plan: Debootstrap) -> str | None:
    """Why debootstrap could not check the mirror's signature here, or None."""
    if Path(plan.keyring).is_file():
        return None
    return (
        f"debootstrap of {plan.suite.name} checks its mirror with {plan.keyring}, which is "
        f"missing (install {plan.suite.family.keyring_package})"
    )


def runtime_problem(suite: Suite, dpkg_status: str) -> str | None:
    """Whether a debootstrapped root file system (its `var/lib/dpkg/status`) has the CPython
    and glibc `suite` says, which the wheelhouse is downloaded for; None when it has."""
    versions = {
        stanza["package"]: stanza.get("version", "")
        for stanza in _deb822_stanzas(dpkg_status)
        if "package" in stanza and "installed" in stanza.get("status", "").split()
    }
    python = ".".join(versions.get("python3", "").split(".")[:2])
    glibc = versions.get("libc6", "").split("-")[0]
    if python == suite.python and glibc.split(".")[:2] == ["2", str(suite.glibc_minor)]:
        return None
    return (
        f"the {suite.name} root file system has python3 {python or '(none)'} and glibc "
        f"{glibc or '(none)'}, not the Python {suite.python} and glibc 2.{suite.glibc_minor} "
        f"the wheelhouse is made for (testbed/backends/docker/suite.py: SUITES)"
    )
