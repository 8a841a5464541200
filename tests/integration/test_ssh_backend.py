"""The ssh backend against real OpenSSH servers: two "boards" (`checks.boards`),
each a network namespace on this machine running Debian's sshd on its own address."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from checks.boards import (
    BOARD_INTERFACE,
    Lab,
    board_qdiscs,
    netns_pids,
    remote_run_dirs,
    sh,
    ssh_lab,
)
from testbed.backends.base import DeviceSpec
from testbed.backends.ssh.backend import SshBackend
from testbed.backends.ssh.inventory import Inventory
from testbed.backends.ssh.scripts import LAUNCHER
from testbed.errors import DeviceError
from tests.integration.board_sweeps import RATE_MBIT, small_experiment
from tests.integration.unshaped import UnshapedLinks

pytestmark = pytest.mark.netns

BOARDS = 2
CLOCK_SKEW_S = 3.25  # board 1's clock reads this much more than board 0's


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with ssh_lab(tmp_path_factory.mktemp("ssh-lab"), BOARDS) as built:
        yield built


@pytest.fixture
def backends(lab: Lab, tmp_path: Path) -> Iterator[Any]:
    """Makes ssh backends; stops them all when the test ends."""
    made: list[SshBackend] = []

    def make(inventory: dict[str, Any], run_id: str | None = None) -> SshBackend:
        run_id = run_id or uuid.uuid4().hex[:12]
        backend = SshBackend(run_id, tmp_path / run_id, Inventory.model_validate(inventory))
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.stop()


def known_hosts_with(lab: Lab, path: Path, ranks: list[int], swap: bool = False) -> str:
    """A known_hosts file with the scanned lines of `ranks` (with `swap`: board 1's address
    given board 0's key, as when another machine answers at a recorded address)."""
    lines = lab.known_hosts.read_text().splitlines()
    chosen = [line for line in lines if line.split()[0] in [lab.addresses[r] for r in ranks]]
    if swap:
        key = next(line for line in lines if line.split()[0] == lab.addresses[0]).split()[1:]
        chosen.append(" ".join([lab.addresses[1], *key]))
    path.write_text("\n".join(chosen) + "\n")
    return str(path)


# start, deploy, run, stop ---------------------------------------------------------------


@pytest.mark.slow
def test_start_deploys_once_runs_commands_and_leaves_nothing(lab: Lab, backends, tmp_path):
    # first use: board 1's host key is not known yet, and the inventory opts in to adding it
    known = known_hosts_with(lab, tmp_path / "known_hosts", [0])
    inventory = lab.inventory(known_hosts=known, accept_new_host_keys=True)
    run_id = uuid.uuid4().hex[:12]
    first = backends(inventory, run_id)
    bundle = first.run_dir / "bundles" / "bundle-K4.pt"
    bundle.parent.mkdir(parents=True)
    bundle.write_bytes(os.urandom(300_000))
    d0, d1 = first.start(DeviceSpec(count=2, cpus=1))
    assert lab.addresses[1] in Path(known).read_text()
    assert (d0.name, d0.address, d1.address) == ("b0", *lab.addresses)
    for rank, session in enumerate(first.sessions):
        code = f"code/{Path(session.code_dir).name}"
        assert sorted(session.uploaded) == ["bundles/bundle-K4.pt", code]
        copy = lab.workdir(rank) / "runs" / run_id / "bundles" / "bundle-K4.pt"
        assert copy.read_bytes() == bundle.read_bytes()  # a copy, in the board's own directory
        imported = Path(session.facts["imports"]["tracevq"][1])
        assert imported.is_relative_to(lab.workdir(rank) / "code")  # workers use the copy
        # one kernel clock: the estimate is 0 within its uncertainty (plus scheduling noise)
        assert abs(session.facts["clock_offset_s"]) <= session.facts["clock_uncertainty_s"] + 2e-3
    facts = json.loads((first.run_dir / "ssh-boards.json").read_text())
    assert [b["name"] for b in facts["boards"]] == ["b0", "b1"] and "clock_offsets_s" in facts

    result = first.run(d1, ["sh", "-c", "echo $OMP_NUM_THREADS; pwd; echo oops >&2; exit 3"])
    assert (result.returncode, result.stderr) == (3, "oops\n")
    assert result.stdout.split() == ["1", str(lab.workdir(1) / "runs" / run_id)]
    assert first.run(d0, [first.python, "-c", "import sys; print(sys.executable)"]).stdout == (
        sys.executable + "\n"
    )
    sleeper = first.spawn(d1, ["sleep", "300"])
    time.sleep(1.0)
    assert any("sleep 300" in c for c in lab.leftovers().get("b1", []))
    began = time.monotonic()
    sleeper.kill()
    assert sleeper.wait(5).returncode != 0 and time.monotonic() - began < 3
    # unchanged content with a new mtime: the board's copy is checked by hash, not re-sent
    os.utime(bundle)
    assert first.device_path(bundle) == "bundles/bundle-K4.pt"
    assert all(len(s.uploaded) == 2 for s in first.sessions)
    first.stop()
    assert lab.wait_until_clean() == {} and remote_run_dirs(lab) == []

    again = backends(inventory, run_id)  # same code: not uploaded a second time
    again.start(DeviceSpec(count=2, cpus=1))
    assert [s.uploaded for s in again.sessions] == [["bundles/bundle-K4.pt"]] * 2
    again.stop()
    assert lab.wait_until_clean() == {} and remote_run_dirs(lab) == []


@pytest.mark.slow
def test_shaped_rate_between_boards_is_on_target(lab: Lab, backends):
    from testbed.errors import ShapingError
    from testbed.experiment.profiles import load_profile
    from testbed.kernel.shaping import Hops
    from testbed.link.probe import WIRE_PER_PAYLOAD, probe, probe_bytes
    from testbed.link.token_bucket import profile_plan

    backend = backends(lab.inventory())
    devices = backend.start(DeviceSpec(count=2, cpus=1))
    control = backend.traffic_control
    support = control.support()
    assert support["tbf"] is True
    # an uplink's netem is a board's own to have or not: these kernels have none
    with pytest.raises(ShapingError, match="'wifi' needs netem's impairments"):
        control.apply(devices[0], profile_plan(load_profile("wifi"), RATE_MBIT))
    with pytest.raises(ShapingError, match="downlinks and pairs are not shaped on boards"):
        control.apply(
            devices[0], profile_plan(load_profile("ideal"), RATE_MBIT, hops=Hops(downlink_mbit=2))
        )
    plan = profile_plan(load_profile("ideal"), RATE_MBIT, support=support)
    for device in devices:
        control.apply(device, plan)
        text = control.stats(device)
        assert "qdisc tbf 1: root" in text and "rate 5Mbit" in text, text
    for sender, receiver in ((devices[0], devices[1]), (devices[1], devices[0])):
        wire_mbit = probe(backend, sender, receiver, probe_bytes(RATE_MBIT, 1.0)) * WIRE_PER_PAYLOAD
        assert wire_mbit == pytest.approx(RATE_MBIT, rel=0.05), (sender.name, wire_mbit)
    backend.stop()
    for name in lab.namespaces[1:]:
        qdiscs = sh("ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", BOARD_INTERFACE)
        assert "tbf" not in qdiscs.stdout, qdiscs.stdout
        link = json.loads(sh("ip", "-n", name, "-d", "-j", "link", "show", BOARD_INTERFACE).stdout)
        assert link[0]["gso_max_segs"] == 65535  # put back as it was
    assert lab.wait_until_clean() == {}


# workers -----------------------------------------------------------------------------------


def simulated_logits(experiment, trial, bundle_path: Path | None) -> np.ndarray:
    """tracevq.simulate on the inputs the workers generate, with their thread count."""
    import torch

    import tracevq
    from devices.inputs import generated_batch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tracevq.build_model(experiment.model.name, seed=experiment.model.seed).eval()
        bundle = tracevq.Bundle.load(bundle_path) if bundle_path is not None else None
        logits = [
            tracevq.simulate(
                model,
                generated_batch(model.config, experiment.batch, 0, index),
                trial.method,
                trial.devices,
                bundle=bundle,
                **trial.method_params,
            )
            .logits.detach()
            .numpy()
            for index in range(experiment.repeats)
        ]
    finally:
        torch.set_num_threads(threads)
    return np.stack(logits)  # (inferences, B, classes)


@pytest.mark.slow
def test_workers_on_boards_give_the_simulated_logits_on_aligned_clocks(lab: Lab, backends):
    """One session of both trials on the boards, board 1's clock reading CLOCK_SKEW_S more
    than board 0's (as an unsynchronised board's may): the logits are the simulation's, the
    handshake measures the skew, and comm, measured across the two clocks, stays what the
    link gives (the skew would otherwise add or remove seconds per message)."""
    from testbed.experiment.schema import parse_experiment
    from testbed.link.links import LinkState
    from testbed.results.facts import RunFacts
    from testbed.results.rows import RowFacts, assemble
    from testbed.sweep.bundles import prepare_run_files
    from testbed.sweep.plan import plan_rows, plan_trials
    from testbed.sweep.sessions import WORKER_PORT, Session, run_session

    experiment = parse_experiment(small_experiment())
    trials = plan_trials(experiment)
    backend = backends(lab.inventory())
    backend.clock_skews_s = {1: CLOCK_SKEW_S}
    files = prepare_run_files(experiment, trials, backend.run_dir)
    backend.start(DeviceSpec(count=2, cpus=1))
    directory = backend.run_dir / "sessions" / "s"
    link = LinkState(RATE_MBIT)
    session = Session(trials, directory, WORKER_PORT, link, files)
    outcome = run_session(backend, experiment, session, UnshapedLinks(backend.devices))
    assert outcome.ok, outcome.error
    assert {"session.json", "records.jsonl", "spec.json"} <= {
        p.name for p in (directory / "rank1").iterdir()
    }
    # the workers proved the run secret to each other; it came back in no file of the run
    for rank in range(2):
        session = json.loads((directory / f"rank{rank}" / "session.json").read_text())
        assert [h["hello"]["authenticated"] for h in session["handshakes"].values()] == [True]
    secret = backend.secret.hex().encode()
    assert [p for p in backend.run_dir.rglob("*") if p.is_file() and secret in p.read_bytes()] == []
    for trial in trials:
        logits = np.load(directory / "rank0" / "logits" / f"{trial.trial_id}.npy")
        expected = simulated_logits(experiment, trial, files.bundle_for(trial))
        np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
        ranks = {row.rank: row for row in plan_rows(experiment, [trial])}
        run = RunFacts("r", backend.name, "tbf", experiment.batch, {0: 1, 1: 1}, False)
        facts = RowFacts(ranks, run, link, outcome.facts)
        rows, layers = assemble(facts, *outcome.records(trial.trial_id))
        board1 = rows[rows["rank"] == 1]
        uncertainty_ms = board1["clock_uncertainty_ms"].max()
        assert (board1["clock_offset_ms"] + 1000 * CLOCK_SKEW_S).abs().max() <= uncertainty_ms + 1
        # per message: after its departure, and no later than a loaded host could deliver it
        assert (layers["comm_ms"] >= -(uncertainty_ms + 0.05)).all(), layers["comm_ms"].min()
        assert (layers["comm_ms"] <= layers["wire_comm_ms"] + 100).all(), layers["comm_ms"].max()
        # both directions alike: the skew is not in one device's comm
        by_rank = layers.groupby("rank")["comm_ms"].median()
        assert abs(by_rank[0] - by_rank[1]) <= max(5.0, 0.5 * by_rank.max()), by_rank
    backend.stop()
    assert lab.wait_until_clean() == {} and remote_run_dirs(lab) == []


# refusals -----------------------------------------------------------------------------------

REFUSALS = {
    "unknown host key": ("is not in", "add it with `ssh-keyscan -p 22 {address} >> "),
    "changed host key": ("host key has CHANGED", "run `ssh-keygen -R '{address}' -f "),
    "wrong user key": ("refused user root with key", "ssh-copy-id"),
    "no answer": ("does not answer on port 22", "(No route to host)"),
    "no such python": ("python '/nonexistent/python3' does not run there", "boards[1].python"),
    "python without torch": ("lacks torch", "pip install torch=="),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refusing_board_is_named_and_nothing_is_left(lab: Lab, backends, tmp_path, case):
    inventory = lab.inventory()
    board = inventory["boards"][1]
    if case == "unknown host key":
        inventory["known_hosts"] = known_hosts_with(lab, tmp_path / "kh", [0])
    elif case == "changed host key":
        inventory["known_hosts"] = known_hosts_with(lab, tmp_path / "kh", [0], swap=True)
    elif case == "wrong user key":
        board["key_file"] = str(lab.other_key)
    elif case == "no answer":
        board["address"] = lab.silent_address
    elif case == "no such python":
        board["python"] = "/nonexistent/python3"
    else:
        probe = sh("/usr/bin/python3", "-c", "import torch", check=False)
        if probe.returncode == 0:
            pytest.skip("this machine's /usr/bin/python3 has torch")
        board["python"] = "/usr/bin/python3"
    backend = backends(inventory)
    with pytest.raises(DeviceError) as caught:
        backend.start(DeviceSpec(count=2, cpus=1))
    message = str(caught.value)
    words, advice = REFUSALS[case]
    assert message.startswith(f"board 'b1' (root@{board['address']}:22): "), message
    assert words in message and advice.format(address=board["address"]) in message, message
    assert "board 'b0'" not in message
    assert lab.wait_until_clean() == {}  # nothing runs on either board
    assert remote_run_dirs(lab) == []


# the whole experiment through testbed.run ---------------------------------------------------


@pytest.mark.slow
def test_the_experiment_runs_on_the_boards_through_testbed_run(lab: Lab, tmp_path):
    from testbed.experiment.schema import load_experiment
    from testbed.results.store import load
    from testbed.sweep.plan import plan_trials

    path = tmp_path / "ssh-small.yaml"
    path.write_text(yaml.safe_dump(small_experiment(lab)))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "testbed.run", str(path), "--out", str(out)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = out.glob("*/*")
    results = load(run_dir)
    trials = results.trials
    assert (trials["status"] == "ok").all(), trials[["trial_id", "error"]]
    assert set(trials["backend"]) == {"ssh"} and trials["trial_id"].nunique() == 2
    # the boards' shaped links deliver the rate (frames on the wire) within 5%
    wire = trials.drop_duplicates("rank")["measured_wire_mbit"]
    assert ((wire / RATE_MBIT - 1).abs() <= 0.05).all(), list(wire)
    assert not trials["rate_flagged"].any()
    link = (run_dir / "links" / "p2-5mbit.json").read_text()
    assert "tbf" in link and "rate 5Mbit" in link
    assert results.environment["qdisc_support"]["tbf"] is True
    experiment = load_experiment(run_dir / "config.yaml")
    for trial in plan_trials(experiment):
        uses = trial.spec.uses_codebooks
        bundle = run_dir / "bundles" / f"bundle-K{trial.spec.K}.pt" if uses else None
        session = run_dir / "sessions" / "p2-5mbit" / "rank0"
        logits = np.load(session / "logits" / f"{trial.trial_id}.npy")
        expected = simulated_logits(experiment, trial, bundle)
        np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=0)
    assert lab.wait_until_clean() == {} and remote_run_dirs(lab) == []
    for name in lab.namespaces[1:]:
        qdiscs = sh("ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", BOARD_INTERFACE)
        assert "tbf" not in qdiscs.stdout


# interrupted controllers ----------------------------------------------------------------------

CONTROLLER = """
import json, sys, time
from pathlib import Path
from testbed.backends.base import DeviceSpec
from testbed.backends.ssh.backend import SshBackend
from testbed.backends.ssh.inventory import Inventory
from testbed.link.token_bucket import profile_plan
from testbed.experiment.profiles import load_profile

inventory = Inventory.model_validate(json.loads(sys.argv[1]))
with SshBackend("interrupted", Path(sys.argv[2]), inventory) as backend:
    plan = profile_plan(load_profile("ideal"), 5.0)
    for device in backend.start(DeviceSpec(count=2)):
        backend.traffic_control.apply(device, plan)
        backend.spawn(device, ["sleep", "300"])
    print("ready", flush=True)
    time.sleep(300)
"""


def argv_of(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def sleeping_on_every_board(lab: Lab) -> bool:
    """Whether the worker itself (`sleep 300`, a child of the ssh backend's launcher) runs on
    every board. Not just a command line that says `sleep 300`: the launcher's own, and the
    shell's before it, say it too, long before the worker starts."""
    for name in lab.namespaces[1:]:
        workers = [pid for pid in netns_pids(name) if argv_of(pid) == ["sleep", "300"]]
        if not any(LAUNCHER in argv_of(parent_of(pid)) for pid in workers):
            return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_an_interrupted_controller_leaves_no_worker_on_the_boards(lab: Lab, tmp_path, signum):
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, json.dumps(lab.inventory()), str(tmp_path / "run")],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal: pytest started in the background of a shell without job control
        # passes SIGINT on ignored, and the controller would then sleep through the Ctrl-C
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert controller.stdout.readline() == "ready\n", controller.stderr.read()[-2000:]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not sleeping_on_every_board(lab):
            time.sleep(0.1)
        assert sleeping_on_every_board(lab), lab.leftovers()
        assert all("tbf" in text for text in board_qdiscs(lab))
        controller.send_signal(signum)
        controller.wait(60)
        assert lab.wait_until_clean() == {}  # Ctrl-C: stop(); SIGKILL: the launchers' watch
        if signum == signal.SIGINT:
            assert not any("tbf" in text for text in board_qdiscs(lab))
            assert remote_run_dirs(lab) == []
    finally:
        controller.kill()
        controller.wait(10)
        for name in lab.namespaces[1:]:  # what only a teardown could have undone
            sh(
                "ip",
                "netns",
                "exec",
                name,
                "tc",
                "qdisc",
                "del",
                "dev",
                BOARD_INTERFACE,
                "root",
                check=False,
            )
            sh("ip", "-n", name, "link", "set", BOARD_INTERFACE, "gso_max_segs", "65535")
            sh(
                "ip",
                "netns",
                "exec",
                name,
                "ethtool",
                "-K",
                BOARD_INTERFACE,
                "gso",
                "on",
                "tso",
                "on",
                check=False,
            )
        for path in remote_run_dirs(lab):
            shutil.rmtree(path)
