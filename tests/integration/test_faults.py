"""Faults during a run: a device's container killed mid-session, the serial link emulator
killed mid-session, a device out of memory (docker backend), a full `--out` (local
backend), two runs at once.

A death has one outcome: the session ends at once (not after the workers' timeout), its
trials fail with a reason that names what died and quotes the workers' last lines, the
sessions those devices had left are recorded as not run, the run exits 1 without a
traceback, and nothing is left running (no container, network or namespace of the run).
A full disk stops the run with one line naming the file, leaves every file it wrote whole,
and `--resume` finishes the run once there is room.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from testbed.kernel.names import run_tag
from testbed.results.store import load

pytestmark = [pytest.mark.netns, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # the workers' receive timeout: a session that waited for it would show
ENDS_WITHIN_S = 30  # from the kill to the run's exit


def long_experiment(tmp_path: Path) -> Path:
    """Two sessions of vit-tiny at 1 and 5 Mbit/s, the first long enough to be cut."""
    experiment = {
        "name": "faults",
        "model": {"name": "vit-tiny"},
        "devices": {"count": [2], "cpus": 1, "memory_mb": 1024},
        "link": {"profile": "ideal", "bandwidth_mbit": [1, 5], "emulator": "serial"},
        "methods": [{"name": "voltage"}],
        "repeats": 400,
        "warmup": 1,
        "timeout_s": TIMEOUT_S,
    }
    path = tmp_path / "faults.yaml"
    path.write_text(yaml.safe_dump(experiment))
    return path


def start_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "testbed.run", str(long_experiment(tmp_path)), "--out", str(out)]
        + ["--backend", "docker"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return process, out


def wait_for(what: str, found, process: subprocess.Popen, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        assert process.poll() is None, f"the run ended before {what}: {process.communicate()}"
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"no {what} within {timeout_s} s: {process.communicate()}")


def worker_running(docker_client, run_id: str, rank: int):
    """The container of device `rank` of the run once its worker runs, else None."""
    name = f"testbed-{run_id}-d{rank}"
    for container in docker_client.containers.list(filters={"name": name}):
        processes = container.top().get("Processes") or []
        if any("devices.worker" in " ".join(p) for p in processes):
            return container
    return None


def run_dir_of(out: Path) -> Path | None:
    runs = [p for p in out.glob("*/*") if p.is_dir()]
    return runs[0] if runs else None


def finish(process: subprocess.Popen, killed_at: float) -> str:
    _, stderr = process.communicate(timeout=TIMEOUT_S * 2)
    assert time.monotonic() - killed_at < ENDS_WITHIN_S, "the run waited out the workers"
    assert process.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return stderr


def check_left_nothing(docker_client, run_id: str) -> None:
    label = {"label": f"testbed.run={run_id}"}
    assert docker_client.containers.list(all=True, filters=label) == []
    assert docker_client.networks.list(filters=label) == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert run_tag(run_id) not in namespaces


def check_rows(run_dir: Path, first: str, then: str) -> None:
    """The 1 Mbit/s session's rows fail with `first`, the 5 Mbit/s one's with `then`."""
    trials = load(run_dir).trials
    assert set(trials["status"]) == {"failed"}, trials[["status", "error"]]
    by_rate = dict(tuple(trials.groupby("bandwidth_mbit")))
    assert by_rate[1.0]["error"].str.contains(first, regex=False).all(), by_rate[1.0]["error"]
    assert by_rate[5.0]["error"].str.startswith(then).all(), by_rate[5.0]["error"]
    assert (run_dir / "sessions" / "p2-1mbit" / "rank0.log").is_file()


@pytest.mark.docker
def test_a_killed_device_fails_its_session_at_once_and_names_it(tmp_path, docker_client):
    process, out = start_run(tmp_path)
    run_dir = wait_for("run directory", lambda: run_dir_of(out), process)
    run_id = run_dir.name
    container = wait_for("worker", lambda: worker_running(docker_client, run_id, 1), process)
    time.sleep(1)  # into the session
    container.kill()
    finish(process, time.monotonic())
    reason = f"device 1 stopped: its container testbed-{run_id}-d1 exited with status 137 (SIGKILL)"
    check_rows(run_dir, f"{reason}, ", f"not run: {reason}")
    error = load(run_dir).trials.query("bandwidth_mbit == 1")["error"].iloc[0]
    assert "into session p2-1mbit (last lines: worker 0: " in error, error
    check_left_nothing(docker_client, run_id)


def emulator_pid(run_id: str) -> int | None:
    """The serial link program of the run (its ports carry the run's tag)."""
    tag = run_tag(run_id)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(command).decode(errors="replace")
        if "testbed.link.serial.program" in text and f"{tag}s0=" in text:
            return int(entry.name)
    return None


@pytest.mark.docker
def test_a_killed_emulator_fails_its_session_at_once_and_names_it(tmp_path, docker_client):
    process, out = start_run(tmp_path)
    run_dir = wait_for("run directory", lambda: run_dir_of(out), process)
    run_id = run_dir.name
    wait_for("worker", lambda: worker_running(docker_client, run_id, 1), process)
    time.sleep(1)
    os.kill(wait_for("emulator", lambda: emulator_pid(run_id), process), signal.SIGKILL)
    finish(process, time.monotonic())
    reason = "the serial link emulator exited with status -9 (SIGKILL)"
    check_rows(run_dir, f"{reason}, ", f"not run: {reason}")
    check_left_nothing(docker_client, run_id)


@pytest.mark.docker
def test_a_device_out_of_memory_is_named(tmp_path, docker_client):
    """ViT-B/16's weights (344 MB) in devices of 256 MB: the kernel kills the workers as
    they build the model. The first to die is named, with the cause, within seconds (the
    other workers get PEER_GRACE_S to end on their own, not the session's timeout)."""
    experiment = yaml.safe_load(long_experiment(tmp_path).read_text())
    experiment.update(
        model={"name": "vit-b16"},
        devices={"count": [2], "cpus": 1, "memory_mb": 256},
        repeats=2,
        link={"profile": "ideal", "emulator": "serial", "bandwidth_mbit": [5]},
    )
    path = tmp_path / "oom.yaml"
    path.write_text(yaml.safe_dump(experiment))
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "testbed.run", str(path), "--out", str(tmp_path / "out")]
        + ["--backend", "docker"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert time.monotonic() - began < TIMEOUT_S, "the run waited out the workers"
    run_dir = run_dir_of(tmp_path / "out")
    assert run_dir is not None
    errors = load(run_dir).trials["error"]
    expected = r"worker \d: exit status 137: the kernel killed it for memory \(the device has "
    assert errors.str.match(expected + r"memory_mb 256\)$").all(), errors
    check_left_nothing(docker_client, run_dir.name)


@pytest.mark.docker
def test_two_runs_at_once_share_nothing(tmp_path, docker_client):
    """Two runs started together on one host: each its own subnets, namespaces, container
    names and serial emulator; both finish, and neither leaves anything behind."""
    experiment = yaml.safe_load(long_experiment(tmp_path).read_text())
    experiment.update(repeats=3, link={"profile": "ideal", "bandwidth_mbit": [10]})
    processes = []
    for name in ("first", "second"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**experiment, "name": name}))
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "testbed.run", str(path), "--out", str(tmp_path / "out")]
                + ["--backend", "docker"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for process in processes:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
    run_dirs = [p for p in (tmp_path / "out").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 2
    for run_dir in run_dirs:
        trials = load(run_dir).trials
        assert set(trials["status"]) == {"ok"} and trials["trial_id"].nunique() == 1
        check_left_nothing(docker_client, run_dir.name)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs at tmp_path/disk, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def test_a_full_disk_stops_the_run_naming_the_file_and_resume_finishes_it(tmp_path, small_disk):
    """The disk holds the run's first files and not much more (a filler takes the rest):
    the run stops with one line naming the file it could not write, exit 1, no temporary
    file left and every parquet whole; with the filler gone, --resume finishes every trial."""
    experiment = yaml.safe_load(long_experiment(tmp_path).read_text())
    experiment.update(
        repeats=2,
        link={"profile": "ideal", "bandwidth_mbit": [10, 20]},
        methods=[{"name": "voltage"}, {"name": "prism", "segment": 4}],
    )
    path = tmp_path / "disk.yaml"
    path.write_text(yaml.safe_dump(experiment))
    filler = small_disk / "filler"
    filler.write_bytes(bytes(max(free_bytes(small_disk) - 48 * 1024, 0)))
    out = small_disk / "out"
    done = subprocess.run(
        [sys.executable, "-m", "testbed.run", str(path), "--out", str(out), "--backend", "local"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("testbed.run: cannot write "), done.stderr[-3000:]
    assert "No space left on device" in last and "--resume" in last, last
    assert "Traceback" not in done.stderr
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    for parquet in out.rglob("*.parquet"):
        pd.read_parquet(parquet)  # whole, or not there
    run_dir = run_dir_of(out)
    assert run_dir is not None
    filler.unlink()
    resumed = subprocess.run(
        [sys.executable, "-m", "testbed.run", "--resume", str(run_dir), "--backend", "local"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    trials = load(run_dir).trials
    assert set(trials["status"]) == {"ok"} and trials["trial_id"].nunique() == 4
