"""The run secret on the testbed side, on the local backend (workers as processes in network
namespaces): the backend makes it and hands it to every worker as a private file, the workers
prove it to each other in their handshake, a worker without it (or with another) is refused,
and it never reaches the results folder.
"""

from __future__ import annotations

import json
import stat
import uuid
from pathlib import Path
from typing import Any

import pytest

from testbed.backends.base import DeviceSpec, write_secret
from testbed.backends.local import LocalBackend
from testbed.experiment.schema import parse_experiment
from testbed.kernel.netns import remove_leftovers
from testbed.link.links import LinkState
from testbed.sweep.bundles import prepare_run_files
from testbed.sweep.plan import plan_trials
from testbed.sweep.runner import Runner
from testbed.sweep.sessions import WORKER_PORT, Session, run_session
from tests.integration.unshaped import UnshapedLinks

pytestmark = [pytest.mark.netns, pytest.mark.slow]

RATE_MBIT = 5.0


def experiment_of(**changes: Any) -> Any:
    return parse_experiment(
        {
            "name": "secret",
            "model": {"name": "vit-tiny"},
            "devices": {"count": [2], "cpus": 1, "memory_mb": 1024},
            "link": {"profile": "ideal", "bandwidth_mbit": [RATE_MBIT], "emulator": "tbf"},
            "methods": [{"name": "voltage"}],
            "repeats": 1,
            "warmup": 0,
            "timeout_s": 120,
            **changes,
        }
    )


def test_a_run_authenticates_its_workers_and_keeps_the_secret_out_of_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backends: list[LocalBackend] = []
    start, seen = LocalBackend.start, {}

    def start_and_look(self: LocalBackend, spec: DeviceSpec) -> Any:
        backends.append(self)
        devices = start(self, spec)
        path = Path(self.secret_files[0])
        seen.update(mode=stat.S_IMODE(path.stat().st_mode), folder=path.parent)
        return devices

    monkeypatch.setattr(LocalBackend, "start", start_and_look)
    run_id = f"secret-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "out" / "secret" / run_id
    try:
        outcome = Runner(experiment_of(), run_dir, "local", run_id).run()
    finally:
        remove_leftovers(run_id)
    assert (outcome.ok, outcome.failed) == (1, 0), outcome.failures
    (backend,) = backends
    secret = backend.secret
    # handed over privately, outside the results folder, and gone with the devices
    assert seen["mode"] == 0o600 and run_dir not in seen["folder"].parents
    assert not seen["folder"].exists()
    specs = sorted(run_dir.glob("sessions/*/rank*/spec.json"))
    assert len(specs) == 2
    for path in specs:
        assert Path(json.loads(path.read_text())["secret_file"]).parent == seen["folder"]
    # both workers proved it to each other
    for path in run_dir.glob("sessions/*/rank*/session.json"):
        handshakes = json.loads(path.read_text())["handshakes"]
        assert [h["hello"]["authenticated"] for h in handshakes.values()] == [True]
    # not a byte of it in any file of the run, in hex (either case) or raw
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) > 10
    forms = (secret, secret.hex().encode(), secret.hex().upper().encode())
    assert [p for p in files if any(form in p.read_bytes() for form in forms)] == []


@pytest.mark.parametrize("held", ["no secret", "another secret"])
def test_a_worker_without_the_run_secret_is_refused_in_the_handshake(
    tmp_path: Path, held: str
) -> None:
    """Device 1's spec names no secret file, or one of another run: both workers refuse the
    handshake, each naming the other device, and the session fails without a record."""
    experiment = experiment_of()
    trials = plan_trials(experiment)
    backend = LocalBackend(uuid.uuid4().hex, tmp_path / "run")
    try:
        files = prepare_run_files(experiment, trials, backend.run_dir)
        backend.start(DeviceSpec(count=2, cpus=1, memory_mb=1024))
        if held == "no secret":
            del backend.secret_files[1]
        else:
            other = write_secret(tmp_path / "other.key", bytes(range(32)))
            backend.secret_files[1] = str(other)
        directory = backend.run_dir / "sessions" / "s"
        session = Session(trials, directory, WORKER_PORT, LinkState(RATE_MBIT), files)
        outcome = run_session(backend, experiment, session, UnshapedLinks(backend.devices))
    finally:
        backend.stop()
        remove_leftovers(backend.run_id)
    assert not outcome.ok
    logs = [(directory / f"rank{rank}.log").read_text() for rank in (0, 1)]
    if held == "no secret":
        assert "device 1 has run secret False, device 0 has True" in logs[0], logs[0]
        assert "device 0 has run secret True, device 1 has False" in logs[1], logs[1]
    else:
        assert "handshake with device 1" in logs[0] and "proof of the run secret is" in logs[0]
        assert "handshake with device 0" in logs[1] and "proof of the run secret is" in logs[1]
    assert "run secret" in outcome.error
    assert not list(directory.glob("rank*/records.jsonl"))
