"""Pure parts of the worker image build: apt sources, wheelhouse requirements, pip tags."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testbed.backends.docker.suite import (
    SUITES,
    AptSource,
    choose_source,
    parse_deb822_sources,
    parse_one_line_sources,
    plan_debootstrap,
    read_host_sources,
)
from testbed.backends.docker.wheelhouse import (
    TORCH_CPU_INDEX,
    cpu_torch_constraints,
    pip_download_args,
    runtime_requirements,
    wheel_platforms,
)
from testbed.errors import ImageError
from testbed.source import SOURCE_ROOT

ONE_LINE_SAMPLE = """\
# deb http://commented.example/debian bookworm main
deb-src http://deb.debian.org/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] https://packages.example.com/apt stable main
deb [ arch=amd64 ] http://mirror.example.org/debian bookworm-updates main
deb http://mirror.example.org/debian bookworm main contrib   # trailing comment
"""

DEB822_SAMPLE = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://src.example.org/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://disabled.example.org/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 -----END PGP PUBLIC KEY BLOCK-----
"""


def test_one_line_format_skips_comments_sources_and_options() -> None:
    sources = parse_one_line_sources(ONE_LINE_SAMPLE)
    assert sources == [
        AptSource(
            "https://packages.example.com/apt",
            ("stable",),
            ("main",),
            signed_by="/usr/share/keyrings/x.gpg",
        ),
        AptSource("http://mirror.example.org/debian", ("bookworm-updates",), ("main",)),
        AptSource("http://mirror.example.org/debian", ("bookworm",), ("main", "contrib")),
    ]
    source = choose_source(sources, "bookworm")
    assert source is not None and source.uri == "http://mirror.example.org/debian"


def test_deb822_format_skips_disabled_and_source_stanzas() -> None:
    sources = parse_deb822_sources(DEB822_SAMPLE)
    assert [s.uri for s in sources] == [
        "http://deb.debian.org/debian",
        "http://deb.debian.org/debian-security",
    ]
    assert sources[0].suites == ("bookworm", "bookworm-updates")
    assert sources[0].signed_by == "/usr/share/keyrings/debian-archive-keyring.gpg"
    assert sources[1].signed_by is not None and "BEGIN PGP" in sources[1].signed_by
    source = choose_source(sources, "bookworm")
    assert source is not None and source.uri == "http://deb.debian.org/debian"


def test_mirror_needs_the_suite_itself_with_main() -> None:
    bookworm = SUITES["bookworm"]
    security_only = [
        AptSource("http://deb.debian.org/debian-security", ("bookworm-security",), ("main",))
    ]
    with pytest.raises(ImageError, match="no Debian mirror for suite 'bookworm'"):
        plan_debootstrap(bookworm, security_only)
    cdrom = [AptSource("cdrom:[Debian 12]/", ("bookworm",), ("main",))]
    with pytest.raises(ImageError):
        plan_debootstrap(bookworm, cdrom)


def test_host_sources_read_list_and_sources_files_only(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text("deb http://a.example/debian bookworm main\n")
    parts = tmp_path / "sources.list.d"
    parts.mkdir()
    (parts / "debian.sources").write_text(DEB822_SAMPLE)
    (parts / "old.list.disabled-by-admin").write_text("deb http://off.example bookworm main\n")
    uris = [s.uri for s in read_host_sources(tmp_path)]
    assert uris == [
        "http://a.example/debian",
        "http://deb.debian.org/debian",
        "http://deb.debian.org/debian-security",
    ]


def test_wheelhouse_requirements_are_runtime_deps_and_build_backend(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\n'
        '[project]\nname = "x"\ndependencies = ["torch==2.13.0", "numpy>=1.26"]\n'
        '[project.optional-dependencies]\ntestbed = ["pandas>=2.1", "docker>=7"]\n'
    )
    assert runtime_requirements(pyproject) == ["torch==2.13.0", "numpy>=1.26", "setuptools>=68"]


def test_project_wheelhouse_holds_what_the_worker_imports() -> None:
    requirements = runtime_requirements(SOURCE_ROOT / "pyproject.toml")
    names = {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower() for r in requirements}
    assert "torch==2.13.0" in requirements  # pinned CPU build: never an unpinned torch
    assert {"torch", "numpy", "pyyaml", "pydantic", "safetensors", "tqdm"} <= names
    assert names.isdisjoint({"pandas", "pyarrow", "matplotlib", "docker", "pyroute2"})


def test_wheel_platforms_cover_every_glibc_up_to_bookworm() -> None:
    tags = wheel_platforms("x86_64", glibc_minor=36)
    assert tags[0] == "manylinux_2_36_x86_64"
    assert {
        "manylinux_2_28_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
        "manylinux1_x86_64",
    } <= set(tags)
    assert "manylinux_2_37_x86_64" not in tags
    assert "manylinux1_aarch64" not in wheel_platforms("aarch64", glibc_minor=36)


def test_pip_download_targets_the_base_python(tmp_path: Path) -> None:
    args = pip_download_args(tmp_path / "requirements.txt", tmp_path, "x86_64", "3.11", 36)
    assert args[1:4] == ["-m", "pip", "download"]
    assert args[args.index("--python-version") + 1] == "3.11"
    assert args[args.index("--platform") + 1] == "manylinux_2_36_x86_64"
    assert "--only-binary=:all:" in args
    assert "--constraint" not in args  # no constraints.txt beside the requirements


def test_pip_download_follows_a_noble_base_and_holds_torch_to_its_cpu_build(
    tmp_path: Path,
) -> None:
    noble = SUITES["noble"]
    requirements = runtime_requirements(SOURCE_ROOT / "pyproject.toml")
    (tmp_path / "requirements.txt").write_text("\n".join(requirements))
    constraints = cpu_torch_constraints(requirements, "x86_64")
    assert constraints == ["torch==2.13.0+cpu"]
    (tmp_path / "constraints.txt").write_text("\n".join(constraints))
    args = pip_download_args(
        tmp_path / "requirements.txt", tmp_path, "x86_64", noble.python, noble.glibc_minor
    )
    assert args[args.index("--python-version") + 1] == "3.12"  # cp312 wheels, abi cp312
    assert args[args.index("--platform") + 1] == "manylinux_2_39_x86_64"
    assert args[args.index("--constraint") + 1] == str(tmp_path / "constraints.txt")
    assert args[args.index("--extra-index-url") + 1] == TORCH_CPU_INDEX
    own = pip_download_args(
        tmp_path / "requirements.txt", tmp_path, "x86_64", "3.12", 39, torch_index=False
    )
    assert "--constraint" in own and "--extra-index-url" not in own  # pip's own indexes first


def test_cpu_constraint_only_for_an_exact_torch_pin_where_pypi_has_cuda() -> None:
    assert cpu_torch_constraints(["torch==2.13.0", "numpy>=1.26"], "aarch64") == []
    assert cpu_torch_constraints(["torch>=2.4"], "x86_64") == []
    assert cpu_torch_constraints(["torch==2.13.0+cpu"], "x86_64") == []
    assert cpu_torch_constraints(["Torch == 2.5.1"], "x86_64") == ["torch==2.5.1+cpu"]


def test_dockerfile_installs_offline_only() -> None:
    dockerfile = (SOURCE_ROOT / "devices" / "Dockerfile").read_text()
    instructions = dockerfile.replace("\\\n", " ").splitlines()  # join continued lines
    pip_installs = [line for line in instructions if "pip install" in line]
    assert len(pip_installs) == 2
    assert all("--no-index" in command for command in pip_installs)
    assert re.search(r"^ARG BASE=trace-testbed/base:bookworm$", dockerfile, re.M)
