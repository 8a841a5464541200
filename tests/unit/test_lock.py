"""The run lock (testbed.sweep.lock) and how testbed.clean judges a run by it, without
privileges."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from testbed.backends.base import Leftovers
from testbed.backends.local import LocalBackend
from testbed.clean import RunLeftovers, why_keep
from testbed.errors import TestbedError
from testbed.sweep.lock import RUN_DIR_LOCK, Holder, RunLock, lock_path, read_locks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "state"
    monkeypatch.setenv("TESTBED_STATE_DIR", str(directory))
    return directory


def dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


def test_a_lock_names_this_process_in_both_places_and_goes_at_the_end(state, tmp_path):
    run_dir = tmp_path / "results" / "x" / "run-1"
    with RunLock("run-1", run_dir):
        facts = json.loads(lock_path("run-1").read_text())
        assert facts == json.loads((run_dir / RUN_DIR_LOCK).read_text())
        assert facts["pid"] == os.getpid() and facts["run_dir"] == str(run_dir)
        assert read_locks()["run-1"].alive() is True
    assert not lock_path("run-1").exists() and not (run_dir / RUN_DIR_LOCK).exists()
    with pytest.raises(RuntimeError), RunLock("run-1", run_dir):
        raise RuntimeError("a failed run")
    assert read_locks() == {}


def test_a_live_run_cannot_be_locked_twice(state, tmp_path):
    with RunLock("run-2", tmp_path / "run-2"):
        with pytest.raises(TestbedError, match=f"held by pid {os.getpid()}"):
            RunLock("run-2", tmp_path / "run-2").__enter__()
        assert lock_path("run-2").exists()


def test_a_dead_or_reused_pid_is_gone_and_its_lock_is_taken_over(state, tmp_path):
    me = Holder.this_process("run-3", tmp_path)
    assert me.alive() is True
    assert replace(me, pid=dead_pid()).alive() is False
    assert replace(me, start_ticks=me.start_ticks + 1).alive() is False  # same pid, reused
    assert replace(me, boot_id="another-boot").alive() is False
    assert replace(me, host="another-host").alive() is None
    state.mkdir()
    stale = replace(me, pid=dead_pid())
    lock_path("run-3").write_text(json.dumps(stale.__dict__))
    with RunLock("run-3", tmp_path / "run-3"):
        assert read_locks()["run-3"].pid == os.getpid()


def test_run_ids_are_slugs(state, tmp_path):
    with pytest.raises(TestbedError, match="a run id is letters"):
        RunLock("../escape", tmp_path)


def test_clean_keeps_live_and_unlocked_runs_and_removes_dead_ones(tmp_path):
    me = Holder.this_process("live", tmp_path)
    namespace = Leftovers("aaaaaaaa", None, ("namespace tb-aaaaaaaa-sw",))
    live = RunLeftovers("aaaaaaaa", "live", [(LocalBackend, namespace)], holder=me)
    dead = replace(live, holder=replace(me, pid=dead_pid()))
    unlocked = replace(live, run_id=None, holder=None)
    elsewhere = replace(live, holder=replace(me, host="board-7"))
    assert "its orchestrator is running (pid" in why_keep(live, chosen=False, everything=False)
    assert why_keep(live, chosen=True, everything=False) is not None
    assert why_keep(live, chosen=False, everything=True) is None
    assert why_keep(dead, chosen=False, everything=False) is None
    assert "no lock" in why_keep(unlocked, chosen=False, everything=False)
    assert why_keep(unlocked, chosen=True, everything=False) is None
    assert "cannot be checked" in why_keep(elsewhere, chosen=False, everything=False)


HOLDER = """
import sys, time
from pathlib import Path
from testbed.sweep import interrupts
from testbed.sweep.lock import RunLock
interrupts.install()
try:
    with RunLock(sys.argv[1], Path(sys.argv[2])):
        print("locked", flush=True)
        time.sleep(60)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_sigterm_releases_the_lock(state, tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "run-4", str(tmp_path / "run-4")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "locked"
        assert read_locks()["run-4"].pid == process.pid
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 130
    finally:
        process.kill()
        process.wait()
    assert read_locks() == {} and not (tmp_path / "run-4" / RUN_DIR_LOCK).exists()
