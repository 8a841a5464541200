"""Requirement gating shared by all tests.

A test that needs something the machine lacks is skipped, unless the matching variable asks
for it, in which case it fails: CI sets `TESTBED_REQUIRE_DOCKER=1` and `TESTBED_REQUIRE_ROOT=1`
so that a docker or netns test can never look like a pass by being skipped.

- `docker`-marked tests, and any test using `docker_client` / `worker_image`, need an engine.
- `netns`-marked tests, and any test using `root`, need euid 0 and iproute2's `ip`.
- `guest`-marked tests, and any test using `netem_guest`, need the netem reference guest
  (`checks.guest`: QEMU, busybox, and Debian's kernel package once);
  `TESTBED_REQUIRE_GUEST=1` makes its absence a failure.

And what the host took: a VM's hypervisor runs other guests on its vCPUs (steal time in
/proc/stat), which no emulator, tbf included, can clock through. A failing test's report says
how much was stolen while it ran, and the summary how much over the session. A test of real
links and devices (`netns`, `docker`) that fails while the host stole at least RERUN_SHARE of
the machine's CPU measured nothing but the host: it runs again, at most RERUNS times, and
its report and the summary say so; a failure on a quiet host is reported at once. (On
2026-12-02 the host stole 10% of the CPU over a whole test session and 38-46% in some
seconds; every probe of those seconds read its link 5-8% slow, tbf's as much as the serial
emulator's.)
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

REQUIRE_DOCKER = "TESTBED_REQUIRE_DOCKER"
REQUIRE_ROOT = "TESTBED_REQUIRE_ROOT"
REQUIRE_GUEST = "TESTBED_REQUIRE_GUEST"


def require_or_skip(available: bool, why: str, env: str) -> None:
    """Does nothing if `available`; else fails when `env` is "1", and skips otherwise."""
    if available:
        return
    if os.environ.get(env) == "1":
        pytest.fail(f"{why} (required because {env}=1)", pytrace=False)
    pytest.skip(f"{why} (set {env}=1 to make this a failure)")


@functools.cache
def docker_problem() -> str | None:
    """Why Docker cannot be used here, or None when an engine answers through the SDK."""
    try:
        import docker
    except ImportError:
        return "the docker SDK is not installed (pip install -e '.[dev]')"
    try:
        client = docker.from_env()
        client.ping()
        client.close()
    except Exception as error:  # any failure to reach the engine means "no Docker"
        return f"no Docker engine answers ({type(error).__name__}: {error}); run `make docker-up`"
    return None


@functools.cache
def root_problem() -> str | None:
    """Why root network tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (euid 0)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    return None


@functools.cache
def guest_problem() -> str | None:
    """Why the netem reference guest cannot be built or booted here, or None."""
    from checks.guest.build import build_problem

    return build_problem()


def stolen_s() -> float:
    """CPU time the hypervisor has taken from this machine's vCPUs since boot (all CPUs'
    steal in /proc/stat), in seconds; 0 where the kernel does not count it."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()  # cpu user nice system idle iowait irq softirq steal
    except OSError:
        return 0.0
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


STOLEN = pytest.StashKey[float]()
SESSION_STOLEN = {"start": stolen_s(), "since": time.monotonic()}
RERUN_SHARE = 0.05  # of every CPU's time, stolen during a failed call: measured again
RERUNS = 3
RERUN_LOG: list[str] = []


def stolen_share(stolen: float, seconds: float) -> float:
    return stolen / (seconds * (os.cpu_count() or 1)) if seconds > 0 else 0.0


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """Runs a test of real links and devices again when its call failed while the host stole
    RERUN_SHARE of the CPU or more (see the module docstring); other tests as pytest does."""
    if not any(item.get_closest_marker(mark) for mark in ("netns", "docker", "guest")):
        return None
    from _pytest.runner import runtestprotocol

    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    notes = []
    for attempt in range(RERUNS + 1):
        if attempt:
            item._initrequest()  # type: ignore[attr-defined]  # fresh fixtures, as a rerun
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        call = next((r for r in reports if r.when == "call"), None)
        if call is None or not call.failed or attempt == RERUNS:
            break
        share = stolen_share(item.stash.get(STOLEN, 0.0), call.duration)
        if share < RERUN_SHARE:
            break
        lines = call.longreprtext.splitlines()
        first = next((line for line in lines if line.startswith("E ")), "E failed")[1:].strip()
        first = first[:200]
        notes.append(f"attempt {attempt + 1} failed while the host stole {share:.0%}: {first}")
    if notes:
        RERUN_LOG.append(f"{item.nodeid}: " + "; ".join(notes))
        for report in reports:
            if report.when == "call":
                report.sections.append(("host", "\n".join(["measured again:", *notes])))
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    item.stash[STOLEN] = stolen_s()
    yield
    item.stash[STOLEN] = stolen_s() - item.stash[STOLEN]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and report.failed and STOLEN in item.stash:
        took = f"{item.stash[STOLEN]:.2f} s of CPU stolen by the host in {call.duration:.1f} s"
        report.sections.append(("host", took))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    stolen = stolen_s() - SESSION_STOLEN["start"]
    elapsed = time.monotonic() - SESSION_STOLEN["since"]
    terminalreporter.write_line(f"host: {stolen:.1f} s of CPU stolen in {elapsed:.0f} s")
    for line in RERUN_LOG:
        terminalreporter.write_line(f"host: measured again: {line}")


# Unit tests that hold a duration to a bound: beside other tests they would measure the host
# (make test's second pass runs tests side by side). Every integration test runs alone too,
# but for those TOGETHER names.
ALONE = (
    "tests/integration/",  # real devices, links, boards, guests: they time what they carry
    "tests/unit/test_virtual_time.py",  # the host's busy cores; warm-ups taking turns
    "tests/unit/test_probe.py",  # real transfers' rates and receive timestamps
    "tests/unit/test_codec.py::test_pack_is_fast",
)
# Integration tests that time nothing but how soon a failure ends a run (tens of seconds
# against a receive timeout of minutes): lifecycles, faults, refusals, images. They run side
# by side; separate runs are isolated by their run ids (test_faults' two runs at once say so).
# test_clean_netns stays alone: its `clean()` without a run id would see the others' runs.
TOGETHER = (
    "tests/integration/test_faults.py",
    "tests/integration/test_run.py::test_a_failing_trial_is_recorded_and_resume_reruns_only_it",
    "tests/integration/test_run.py::test_interrupt_removes_devices_and_keeps_finished_trials",
    "tests/integration/test_run_secret.py",
    "tests/integration/test_local_backend.py",
    "tests/integration/test_image.py",
    "tests/integration/test_compose.py",
)


def named(nodeid: str, prefixes: tuple[str, ...]) -> bool:
    """Whether `nodeid` is one of `prefixes` (a folder, a file, or a test with all its
    parameters)."""
    return any(
        nodeid.startswith(prefix)
        and (prefix.endswith("/") or nodeid[len(prefix) :][:1] in ("", ":", "["))
        for prefix in prefixes
    )


def alone(nodeid: str) -> bool:
    """Whether the test `nodeid` runs in make test's first pass, one at a time."""
    return named(nodeid, ALONE) and not named(nodeid, TOGETHER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks `alone` (make test's first pass, one at a time) what ALONE names and TOGETHER
    does not."""
    for item in items:
        if alone(item.nodeid):
            item.add_marker(pytest.mark.alone)


@pytest.fixture(autouse=True)
def fixed_random_state() -> None:
    """Every test starts from the same global random state (torch, numpy, random), so what it
    draws without a generator of its own does not depend on which tests ran before it in its
    process: under make test's side-by-side pass that order changes from run to run (a
    codeword set drawn so once made the screen decide rows meant to defeat it)."""
    import random

    import numpy
    import torch

    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Gates marked tests even when they use none of the fixtures below."""
    if item.get_closest_marker("docker") is not None:
        problem = docker_problem()
        require_or_skip(problem is None, problem or "", REQUIRE_DOCKER)
    if item.get_closest_marker("netns") is not None:
        problem = root_problem()
        require_or_skip(problem is None, problem or "", REQUIRE_ROOT)
    if item.get_closest_marker("guest") is not None:
        problem = guest_problem()
        require_or_skip(problem is None, problem or "", REQUIRE_GUEST)


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """A `docker.DockerClient` from the environment (gated by TESTBED_REQUIRE_DOCKER)."""
    problem = docker_problem()
    require_or_skip(problem is None, problem or "", REQUIRE_DOCKER)
    import docker

    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture(scope="session")
def worker_image(docker_client: Any) -> str:
    """Builds the worker image once per session (cached layers make it quick) and gives its tag.

    Skipped (or failed, under TESTBED_REQUIRE_DOCKER=1) only when the local base cannot be made
    here (no debootstrap, not root); any other build failure is a test error.
    """
    from testbed.backends.docker.base_image import default_base_problem
    from testbed.backends.docker.image import build_image

    problem = default_base_problem()
    require_or_skip(problem is None, problem or "", REQUIRE_DOCKER)
    return build_image()


@pytest.fixture
def root() -> None:
    """Gates a test on root and iproute2 (TESTBED_REQUIRE_ROOT)."""
    problem = root_problem()
    require_or_skip(problem is None, problem or "", REQUIRE_ROOT)


@pytest.fixture(scope="session")
def netem_guest() -> Callable[..., list[Any]]:
    """Runs a batch of commands in one boot of the netem reference guest, its image built
    (or found in .cache/netem-guest) once per session: `netem_guest(commands, timeout_s=...)`
    gives each command's `checks.guest.boot.Completed` (gated by
    TESTBED_REQUIRE_GUEST)."""
    problem = guest_problem()
    require_or_skip(problem is None, problem or "", REQUIRE_GUEST)
    from checks.guest.boot import run
    from checks.guest.build import build

    began = time.monotonic()
    image = build()
    print(f"\nnetem guest: image {image.initramfs.name} ready in {time.monotonic() - began:.1f} s")
    return functools.partial(run, image=image)
