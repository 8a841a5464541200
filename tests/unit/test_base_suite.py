"""The base image's suite chosen from the host's own files: os-release and apt's sources as
Debian 12 and 13, Ubuntu 22.04 and 24.04 and Linux Mint 22 ship them (tests/unit/hosts/), and
what follows from the choice: mirror, keyring, debootstrap script and arguments, tag, the
base's key and the CPython the wheelhouse is made for."""

from __future__ import annotations

from pathlib import Path

import pytest

from testbed.backends.docker.base_image import (
    base_key,
    debootstrap_args,
    parse_runtime_report,
)
from testbed.backends.docker.suite import (
    SUITES,
    host_plan,
    host_suite,
    read_os_release,
    runtime_problem,
)
from testbed.backends.docker.wheelhouse import required_python
from testbed.errors import ImageError
from testbed.source import SOURCE_ROOT

HOSTS = Path(__file__).parent / "hosts"
PROJECT_PYTHON = required_python(SOURCE_ROOT / "pyproject.toml")  # (3, 11)
# the debootstrap scripts of Debian bookworm's debootstrap (1.0.128): jammy, but no noble
BOOKWORM_DEBOOTSTRAP = ("bookworm", "trixie", "sid", "jammy", "gutsy", "focal")


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    folder = tmp_path / "scripts"
    folder.mkdir()
    for name in BOOKWORM_DEBOOTSTRAP:
        (folder / name).write_text("")
    return folder


# host: (suite, mirror, keyring) for the project's Python; the script is the suite's own, or
# Ubuntu's generic one where bookworm's debootstrap has none
EXPECTED = {
    "debian-12": (
        "bookworm",
        "http://deb.debian.org/debian",
        "/usr/share/keyrings/debian-archive-keyring.gpg",  # its Signed-By
    ),
    "debian-12-classic": (
        "bookworm",
        "http://deb.debian.org/debian/",
        "/usr/share/keyrings/debian-archive-keyring.gpg",  # Debian's, no signed-by option
    ),
    "debian-13": (
        "trixie",
        "http://deb.debian.org/debian/",
        "/usr/share/keyrings/debian-archive-keyring.pgp",  # its Signed-By
    ),
    "ubuntu-22.04": (  # jammy's Python 3.10 is older than the project's: noble, same mirror
        "noble",
        "http://de.archive.ubuntu.com/ubuntu/",
        "/usr/share/keyrings/ubuntu-archive-keyring.gpg",  # Ubuntu's, no signed-by option
    ),
    "ubuntu-24.04": (
        "noble",
        "http://archive.ubuntu.com/ubuntu/",
        "/usr/share/keyrings/ubuntu-archive-keyring.gpg",  # its Signed-By
    ),
    "linuxmint-22": (  # UBUNTU_CODENAME=noble; its own packages.linuxmint.com is not the base's
        "noble",
        "http://archive.ubuntu.com/ubuntu",
        "/usr/share/keyrings/ubuntu-archive-keyring.gpg",
    ),
}


@pytest.mark.parametrize("host", sorted(EXPECTED))
def test_each_host_debootstraps_its_own_suite_from_its_own_mirror(host: str, scripts: Path) -> None:
    plan = host_plan(etc=HOSTS / host / "etc", scripts=scripts, min_python=PROJECT_PYTHON)
    suite, mirror, keyring = EXPECTED[host]
    assert (plan.suite.name, plan.mirror, plan.keyring) == (suite, mirror, keyring)
    assert plan.suite.tag == f"trace-testbed/base:{suite}"
    expected_script = None if suite in BOOKWORM_DEBOOTSTRAP else str(scripts / "gutsy")
    assert plan.script == expected_script


def test_noble_with_an_older_debootstrap_runs_its_ubuntu_script(scripts: Path) -> None:
    plan = host_plan(etc=HOSTS / "ubuntu-24.04" / "etc", scripts=scripts, min_python=PROJECT_PYTHON)
    args = debootstrap_args(plan, Path("/x/rootfs"), Path("/x/debs"))
    assert args == [
        "debootstrap",
        "--variant=minbase",
        "--include=python3,python3-venv,python3-pip,iproute2,ethtool,procps,ca-certificates",
        "--components=main,universe",
        "--keyring=/usr/share/keyrings/ubuntu-archive-keyring.gpg",
        "--cache-dir=/x/debs",
        "noble",
        "/x/rootfs",
        "http://archive.ubuntu.com/ubuntu/",
        str(scripts / "gutsy"),
    ]
    (scripts / "noble").write_text("")  # a debootstrap that knows noble finds its own
    assert (
        host_plan(
            etc=HOSTS / "ubuntu-24.04" / "etc", scripts=scripts, min_python=PROJECT_PYTHON
        ).script
        is None
    )


def test_bookworm_keeps_its_tag_key_and_debootstrap_command(scripts: Path) -> None:
    """This project's hosts: the base cached before hosts chose their suite stays current."""
    plan = host_plan(etc=HOSTS / "debian-12" / "etc", scripts=scripts, min_python=PROJECT_PYTHON)
    assert plan.suite.tag == "trace-testbed/base:bookworm"
    assert base_key(plan.suite, "x86_64") == "c13c8f0fdc03"  # .cache/base/rootfs-bookworm-...
    args = debootstrap_args(plan, Path("/x/rootfs"), Path("/x/debs"))
    assert "--components" not in " ".join(args)  # debootstrap's default: main
    assert args[-3:] == ["bookworm", "/x/rootfs", "http://deb.debian.org/debian"]
    assert base_key(SUITES["noble"], "x86_64") != base_key(plan.suite, "x86_64")


def test_jammy_is_the_base_of_22_04_only_for_a_project_that_runs_on_python_3_10(
    scripts: Path,
) -> None:
    assert PROJECT_PYTHON == (3, 11)  # pyproject's requires-python: jammy's 3.10 is too old
    etc = HOSTS / "ubuntu-22.04" / "etc"
    plan = host_plan(etc=etc, scripts=scripts, min_python=(3, 10))
    assert (plan.suite.name, plan.mirror) == ("jammy", "http://de.archive.ubuntu.com/ubuntu/")
    assert plan.script is None  # bookworm's debootstrap knows jammy


def test_each_suite_gives_the_wheelhouse_its_python() -> None:
    runtimes = {name: (suite.python, suite.glibc_minor) for name, suite in SUITES.items()}
    assert runtimes == {
        "bookworm": ("3.11", 36),
        "trixie": ("3.13", 41),
        "jammy": ("3.10", 35),
        "noble": ("3.12", 39),
    }


def test_a_host_of_another_family_gets_bookworm_from_the_mirror_it_names(scripts: Path) -> None:
    etc = HOSTS / "fedora-41" / "etc"
    assert host_suite(read_os_release(etc)) is SUITES["bookworm"]
    with pytest.raises(ImageError) as refused:
        host_plan(etc=etc, scripts=scripts, min_python=PROJECT_PYTHON)
    assert str(refused.value) == (
        "no Debian mirror for suite 'bookworm' (component main) in /etc/apt/sources.list(.d) "
        "of Fedora Linux 41 (Workstation Edition); pass --mirror URL of a Debian mirror "
        "(make image IMAGE_ARGS='--mirror URL') or set TESTBED_BASE=IMAGE"
    )
    plan = host_plan(
        "http://deb.debian.org/debian", etc=etc, scripts=scripts, min_python=PROJECT_PYTHON
    )
    assert (plan.suite.name, plan.mirror) == ("bookworm", "http://deb.debian.org/debian")
    assert plan.keyring == "/usr/share/keyrings/debian-archive-keyring.gpg"


def test_an_ubuntu_release_not_known_here_gets_noble_from_its_own_mirror(
    tmp_path: Path, scripts: Path
) -> None:
    noble = HOSTS / "ubuntu-24.04" / "etc"
    etc = tmp_path / "etc"
    (etc / "apt" / "sources.list.d").mkdir(parents=True)
    release = (noble / "os-release").read_text().replace("noble", "plucky")
    (etc / "os-release").write_text(release.replace("24.04.1 LTS", "25.04"))
    sources = (noble / "apt" / "sources.list.d" / "ubuntu.sources").read_text()
    (etc / "apt" / "sources.list.d" / "ubuntu.sources").write_text(
        sources.replace("noble", "plucky")
    )
    plan = host_plan(etc=etc, scripts=scripts, min_python=PROJECT_PYTHON)
    assert (plan.suite.name, plan.mirror) == ("noble", "http://archive.ubuntu.com/ubuntu/")


def test_a_derivative_of_an_unknown_release_must_name_a_mirror(
    tmp_path: Path, scripts: Path
) -> None:
    etc = tmp_path / "etc"
    (etc / "apt").mkdir(parents=True)
    (etc / "os-release").write_text(
        'PRETTY_NAME="Kali GNU/Linux Rolling"\nID=kali\nID_LIKE=debian\n'
        "VERSION_CODENAME=kali-rolling\n"
    )
    (etc / "apt" / "sources.list").write_text(
        "deb http://http.kali.org/kali kali-rolling main contrib non-free non-free-firmware\n"
    )
    with pytest.raises(ImageError, match="suite 'bookworm' .* of Kali GNU/Linux Rolling"):
        host_plan(etc=etc, scripts=scripts, min_python=PROJECT_PYTHON)


def test_the_rootfs_must_have_the_python_its_suite_promises() -> None:
    status = (HOSTS / "debian-12" / "var" / "lib" / "dpkg" / "status").read_text()
    assert runtime_problem(SUITES["bookworm"], status) is None
    problem = runtime_problem(SUITES["noble"], status)
    assert problem == (
        "the noble root file system has python3 3.11 and glibc 2.36, not the Python 3.12 and "
        "glibc 2.39 the wheelhouse is made for (testbed/backends/docker/suite.py: SUITES)"
    )


def test_a_named_base_reports_its_python_and_glibc() -> None:
    assert parse_runtime_report("b", "3.12 glibc 2.39\n") == ("3.12", 39)
    with pytest.raises(ImageError, match="'alpine:3' reports python3 and libc '3.12'"):
        parse_runtime_report("alpine:3", "3.12  \n")  # musl: platform.libc_ver() is empty
