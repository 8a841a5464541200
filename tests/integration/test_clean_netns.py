"""`testbed.clean` on real leftovers: two runs of the local backend hold their lock and their
namespaces; one orchestrator is SIGKILLed (it cannot clean up), the other stays alive. A bare
clean removes the dead run's namespaces and lock and leaves the live run alone.

Both orchestrators are killed and both runs' namespaces removed in the fixture's finaliser,
also when the test fails. What remains is checked with iproute2 (`ip netns list`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import testbed.backends.docker.backend
from testbed.clean import clean
from testbed.kernel.names import run_tag
from testbed.kernel.netns import remove_leftovers
from testbed.sweep.lock import lock_path, read_locks

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[2]

ORCHESTRATOR = """
import sys, time
from pathlib import Path
from testbed.backends.base import DeviceSpec
from testbed.backends.local import LocalBackend
from testbed.sweep.lock import RunLock

run_id, run_dir = sys.argv[1], Path(sys.argv[2])
with RunLock(run_id, run_dir), LocalBackend(run_id, run_dir) as backend:
    backend.start(DeviceSpec(count=2, cpus=1, memory_mb=256))
    print("started", flush=True)
    time.sleep(120)
"""


def namespaces(run_id: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    prefix = f"tb-{run_tag(run_id)}-"
    return sorted(line.split()[0] for line in listed.stdout.splitlines() if prefix in line)


@pytest.fixture
def two_runs(root: None, tmp_path: Path, monkeypatch) -> Iterator[dict[str, subprocess.Popen]]:
    """Two orchestrators, each holding its run's lock and namespaces, by run id."""
    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(testbed.backends.docker.backend, "engine_available", lambda: False)
    runs: dict[str, subprocess.Popen] = {}
    try:
        for role in ("live", "killed"):
            run_id = f"test-clean-{role}-{uuid.uuid4().hex[:6]}"
            runs[run_id] = subprocess.Popen(
                [sys.executable, "-c", ORCHESTRATOR, run_id, str(tmp_path / run_id)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
                env=os.environ.copy(),
            )
            assert runs[run_id].stdout.readline().strip() == "started"
        yield runs
    finally:
        for run_id, process in runs.items():
            process.kill()
            process.wait()
            remove_leftovers(run_id)


def test_clean_leaves_a_live_run_alone_and_removes_a_killed_one(two_runs) -> None:
    live, killed = list(two_runs)
    assert len(namespaces(live)) == len(namespaces(killed)) == 3  # switch and two devices
    two_runs[killed].send_signal(signal.SIGKILL)
    two_runs[killed].wait(timeout=10)
    assert len(namespaces(killed)) == 3  # a killed orchestrator leaves its namespaces

    report = clean()

    assert namespaces(killed) == [] and not lock_path(killed).exists()
    assert len(namespaces(live)) == 3 and read_locks()[live].alive()
    assert two_runs[live].poll() is None  # its devices' namespaces were not touched
    kept = [line for line in report.kept if live in line]
    assert kept and "its orchestrator is running" in kept[0]
    assert not any(tag in item for item in report.removed for tag in [run_tag(live)])
    assert any(f"tb-{run_tag(killed)}-sw" in item for item in report.removed)

    report = clean(run_id=live)  # named, but alive: still kept
    assert len(namespaces(live)) == 3 and report.removed == []
    report = clean(run_id=live, everything=True)
    assert namespaces(live) == []


def test_clean_removes_the_namespace_of_a_killed_qdisc_probe_only() -> None:
    """The qdisc probe's throwaway namespace is named by its process: one left by a dead
    process goes, one of a live process (this one) stays."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    names = [
        f"tbprobe-{int(dead.stdout)}-{uuid.uuid4().hex[:6]}",
        f"tbprobe-{os.getpid()}-{uuid.uuid4().hex[:6]}",
    ]
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True)
        removed = clean().removed
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"netns {names[0]}" in removed and names[0] not in listed
        assert names[1] in listed
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
