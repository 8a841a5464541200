"""The enoslib backend with EnOSlib's static provider against four SSH boards
(`checks.boards`): a sweep through `testbed.run --backend enoslib` on two and
four boards, each board's shaped rate measured by the probe, a trace's rate changes in force
within 250 ms, an unknown host key refused, and what an interrupted or killed controller
left removed by `testbed.clean`. Only the static provider runs here; the others reserve
machines on shared testbeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from checks.boards import BOARD_INTERFACE, Lab, board_qdiscs, netns_pids, ssh_lab
from testbed.backends.base import DeviceSpec
from testbed.backends.enoslib.backend import EnoslibBackend
from testbed.backends.enoslib.provider_section import Provider
from testbed.errors import DeviceError
from testbed.experiment.profiles import load_profile
from testbed.link.emulators import EMULATORS
from testbed.link.links import Links
from testbed.link.probe import WIRE_PER_PAYLOAD, probe, probe_bytes
from testbed.link.replay import TraceReplay
from testbed.link.traces import RateTrace
from tests.integration.board_sweeps import RATE_MBIT, small_experiment
from tests.integration.stalls import rate_in_force

pytestmark = [pytest.mark.netns, pytest.mark.slow]

BOARDS = 4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with ssh_lab(tmp_path_factory.mktemp("enoslib-lab"), BOARDS) as built:
        yield built


def provider(lab: Lab, known_hosts: str | None = None) -> dict[str, Any]:
    """The static provider's section listing the lab's boards (EnOSlib's dictionary)."""
    machines = [
        {"roles": ["devices"], "address": address, "alias": f"b{rank}", "user": "root"}
        for rank, address in enumerate(lab.addresses)
    ]
    return {
        "kind": "static",
        "known_hosts": known_hosts or str(lab.known_hosts),
        "connect_timeout_s": 4,
        "boards": {
            "key_file": str(lab.user_key),
            "python": sys.executable,
            "workdir": str(lab.directory / "board-{name}"),
        },
        "conf": {
            "resources": {
                "machines": machines,
                "networks": [
                    {
                        "roles": ["lan"],
                        "cidr": "10.0.0.0/8",
                        "gateway": "10.0.0.1",
                        "dns": "10.0.0.1",
                    }
                ],
            }
        },
    }


def run_dirs(lab: Lab) -> list[Path]:
    """The run directories on the boards (their workdirs: `board-b<rank>`)."""
    return sorted(lab.directory.glob("board-b*/runs/*"))


def nothing_left(lab: Lab) -> None:
    assert lab.wait_until_clean() == {}
    assert run_dirs(lab) == []
    assert not any("tbf" in text for text in board_qdiscs(lab))


@pytest.fixture
def backend(lab: Lab, tmp_path: Path) -> Iterator[Any]:
    made: list[EnoslibBackend] = []

    def make(section: dict[str, Any]) -> EnoslibBackend:
        made.append(
            EnoslibBackend(uuid.uuid4().hex[:12], tmp_path, Provider.model_validate(section))
        )
        return made[-1]

    yield make
    for each in made:
        each.stop()


def test_a_sweep_runs_on_two_and_four_boards_through_testbed_run(lab: Lab, tmp_path):
    from testbed.results.store import load

    experiment = small_experiment(
        name="enoslib-small",
        devices={"count": [2, 4], "cpus": 1, "memory_mb": 1024},
        backend="enoslib",
        provider=provider(lab),
        timeout_s=300,
    )
    path = tmp_path / "enoslib-small.yaml"
    path.write_text(yaml.safe_dump(experiment))
    done = subprocess.run(
        [sys.executable, "-m", "testbed.run", str(path), "--backend", "enoslib", "-q"]
        + ["--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "out").glob("*/*")
    trials = load(run_dir).trials
    assert (trials["status"] == "ok").all(), trials[["trial_id", "error"]]
    assert set(trials["backend"]) == {"enoslib"}
    assert sorted(trials["devices"].unique()) == [2, 4]
    assert trials.groupby("devices")["rank"].nunique().to_dict() == {2: 2, 4: 4}
    # every board's shaped uplink, probed, delivers the rate (frames on the wire) within 5%
    for devices, rows in trials.groupby("devices"):
        wire = rows.drop_duplicates("rank")["measured_wire_mbit"]
        assert ((wire / RATE_MBIT - 1).abs() <= 0.05).all(), (devices, list(wire))
    facts = json.loads((run_dir / "ssh-boards.json").read_text())
    assert [b["name"] for b in facts["boards"]] == ["b0", "b1", "b2", "b3"]
    assert not (run_dir / "board-leftovers.json").exists()
    nothing_left(lab)


def test_a_trace_changes_each_boards_rate_within_250_ms(lab: Lab, backend):
    phase_s = 3.0
    trace = RateTrace((0.0, phase_s, 2 * phase_s), (10.0, 2.0, 10.0), 3 * phase_s, "steps")
    devices = backend(provider(lab))
    devices.start(DeviceSpec(count=2, cpus=1, memory_mb=512))
    assert [d.interface for d in devices.devices] == [BOARD_INTERFACE] * 2  # auto: found
    with Links(devices, load_profile("ideal"), EMULATORS["tbf"], devices.run_id) as links:
        links.shape(10.0, 0.2)
        sender, receiver = devices.devices
        measured = []
        with TraceReplay(links.set_rate, trace) as replay:
            for phase, rate in enumerate(trace.rates_mbit):
                settle = replay.start_ns / 1e9 + phase * phase_s + 0.3 - time.time()
                time.sleep(max(settle, 0))
                size = probe_bytes(rate, 1.0)  # two reads take 2.3 s of the phase's 3 at most

                def read(size: int = size) -> float:
                    return probe(devices, sender, receiver, size) * WIRE_PER_PAYLOAD

                measured.append(rate_in_force(read, rate))
    for rate, wire in zip(trace.rates_mbit, measured, strict=True):
        assert wire == pytest.approx(rate, rel=0.05), measured
    assert replay.applied_mbit[:3] == [10.0, 2.0, 10.0]
    for step in range(3):
        due_ns = replay.start_ns + step * phase_s * 1e9
        assert 0 <= replay.applied_ns[step] - due_ns < 250e6, (step, replay.applied_ns)
    devices.stop()
    nothing_left(lab)


def test_an_unknown_host_key_is_refused(lab: Lab, backend, tmp_path):
    lines = lab.known_hosts.read_text().splitlines()
    known = tmp_path / "known_hosts"
    known.write_text("\n".join(line for line in lines if line.split()[0] != lab.addresses[1]))
    devices = backend(provider(lab, str(known)))
    with pytest.raises(DeviceError) as refused:
        devices.start(DeviceSpec(count=2))
    assert f"board 'b1' (root@{lab.addresses[1]}:22): its host key" in str(refused.value)
    assert f"is not in {known}" in str(refused.value)
    nothing_left(lab)


CONTROLLER = """
import json, sys, time
from pathlib import Path
from testbed.backends.base import DeviceSpec
from testbed.backends.enoslib.backend import EnoslibBackend
from testbed.experiment.profiles import load_profile
from testbed.backends.enoslib.provider_section import Provider
from testbed.link.token_bucket import profile_plan
from testbed.sweep.lock import RunLock

run_id, run_dir = sys.argv[2], Path(sys.argv[3])
provider = Provider.model_validate(json.loads(sys.argv[1]))
with RunLock(run_id, run_dir), EnoslibBackend(run_id, run_dir, provider) as backend:
    plan = profile_plan(load_profile("ideal"), 5.0)
    for device in backend.start(DeviceSpec(count=2)):
        backend.traffic_control.apply(device, plan)
        backend.spawn(device, ["sleep", "300"])
    print("ready", flush=True)
    time.sleep(300)
"""


def sleeping_on(lab: Lab, boards: int) -> bool:
    def argv(pid: int) -> list[str]:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
        except OSError:
            return []

    return all(
        any(argv(pid) == ["sleep", "300"] for pid in netns_pids(name))
        for name in lab.namespaces[1 : 1 + boards]
    )


@pytest.mark.parametrize(
    ("signum", "how"),
    [(signal.SIGINT, []), (signal.SIGKILL, []), (signal.SIGKILL, ["--boards"])],
    ids=["ctrl-c", "killed", "killed-boards"],
)
def test_testbed_clean_leaves_nothing_on_the_boards_after_a_dead_controller(
    lab: Lab, tmp_path, monkeypatch, signum, how
):
    monkeypatch.setenv("TESTBED_STATE_DIR", str(tmp_path / "state"))
    run_id, run_dir = f"enos-{uuid.uuid4().hex[:8]}", tmp_path / "run"
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, json.dumps(provider(lab)), run_id, str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert controller.stdout.readline() == "ready\n", controller.stderr.read()[-2000:]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not sleeping_on(lab, 2):
            time.sleep(0.1)
        assert sleeping_on(lab, 2) and (run_dir / "board-leftovers.json").exists()
        controller.send_signal(signum)
        controller.wait(60)
        assert lab.wait_until_clean() == {}  # workers: stop(), or the launchers' watch
        if signum == signal.SIGKILL:
            assert all("tbf" in text for text in board_qdiscs(lab)[:2])  # left for clean
            assert len(run_dirs(lab)) == 2
        cleaned = subprocess.run(
            [sys.executable, "-m", "testbed.clean", *how, *([str(run_dir)] if how else [])],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=os.environ.copy(),
        )
        assert cleaned.returncode == 0, cleaned.stderr
        nothing_left(lab)
        assert not (run_dir / "board-leftovers.json").exists()
        if signum == signal.SIGKILL:
            assert f"qdiscs of {BOARD_INTERFACE}" in cleaned.stdout, cleaned.stdout
    finally:
        controller.kill()
        controller.wait(10)
