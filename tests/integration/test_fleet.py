"""Fleets for real on the local backend (namespaces, cgroups, the serial link, real workers):
devices of different speeds, partitions by speed, and one run per kind of timeline event, each
read back from the rows it leaves (docs/devices.md).

vit-tiny with a batch of 8 keeps each run to seconds; its compute is small, so ratios are
checked against generous bounds (the ideal is in each test's words), never absolute times.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from testbed.experiment.dilation import needed_factor
from testbed.kernel.names import run_tag
from testbed.results import load
from tracevq.partition import sizes_by_rates

from .test_run import only_run_dir, run_cli, small_experiment

pytestmark = [pytest.mark.netns, pytest.mark.slow]

ALL_METHODS = [
    {"name": "voltage"},
    {"name": "prism", "segment": 2},
    {"name": "astra", "K": 16},
    {"name": "trace-nb", "K": 16},
    {"name": "trace-b", "K": 16},
]
TIMELINE_TOLERANCE_MS = 50  # an event at a time is applied within this of it


def fleet_run(tmp_path: Path, says: str = "", **changes) -> tuple[Path, pd.DataFrame]:
    """Runs a vit-tiny experiment with `changes` on the local backend; its folder and trials."""
    changes.setdefault("methods", [{"name": "voltage"}])
    changes.setdefault("batch", 8)
    path = small_experiment(tmp_path, **changes)
    out = tmp_path / "out"
    done = run_cli(str(path), "--out", str(out), "--backend", "local")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert says in done.stdout
    run_dir = only_run_dir(out)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert run_tag(run_dir.name) not in names  # nothing of the run is left
    return run_dir, load(run_dir).trials


def timeline_of(run_dir: Path) -> list[dict]:
    (path,) = (run_dir / "sessions").glob("*/timeline.json")
    return json.loads(path.read_text())


def test_a_p3_fleet_by_speed_is_exact_and_finishes_every_row(tmp_path):
    """Three devices, device 1 at half speed, tokens by the measured rates: every method's
    every row ok, each device's tokens as sizes_by_rates makes them, and the speed and rate in
    force on every row."""
    devices = {"count": [3], "cpus": 0.6, "speed": {1: 0.5}, "partition": "by_speed"}
    run_dir, trials = fleet_run(tmp_path, devices=devices, methods=ALL_METHODS, repeats=2)
    assert set(trials["status"]) == {"ok"} and trials["method"].nunique() == 5
    environment = json.loads((run_dir / "environment.json").read_text())
    rates = environment["by_devices"]["3"]["gflops"]
    expected = sizes_by_rates(17, [rates["0"], rates["1"] * 0.5, rates["2"]])
    assert set(trials["partition"]) == {"-".join(map(str, expected))}
    by_rank = trials.groupby("rank")
    assert by_rank["tokens"].first().tolist() == expected
    assert by_rank["device_speed"].unique().tolist() == [[1.0], [0.5], [1.0]]
    gflops = by_rank["device_gflops"].first()
    assert gflops[1] == pytest.approx(rates["1"] * 0.5 * 0.6, rel=1e-3)  # its quota: 0.6 CPU


def test_a_speed_event_doubles_the_devices_compute_from_its_inference_on(tmp_path):
    """Device 1 drops to half speed before measured inference 3: its speed column says so from
    there, the event is named on those rows, and its compute doubles (ideal 2x). In virtual
    time (auto: both devices at full speed need d = 2.75 here) full speed is paced too, to
    the same references as half speed, so the host's noise at full speed is not in the ratio
    (in real time, 1 run in 5 fell below 1.6)."""
    timeline = [{"at_inference": 3, "device": 1, "speed": 0.5}]
    _, trials = fleet_run(tmp_path, timeline=timeline, repeats=6, dilation="auto")
    assert (trials["dilation"] > 1).all()
    device = trials[trials["rank"] == 1].sort_values("repeat")
    assert device["device_speed"].tolist() == [1.0] * 3 + [0.5] * 3
    assert (device["events"].iloc[3:] == "speed d1=0.5 at inference 3").all()
    assert (device["events"].iloc[:3] == "").all()
    before, after = device["compute_ms"].iloc[1:3].median(), device["compute_ms"].iloc[3:].median()
    assert 1.6 <= after / before <= 2.6, device[["repeat", "compute_ms"]]


def test_devices_of_two_cores_in_virtual_time_are_one_thread_each_at_their_speed(tmp_path):
    """Two 2-core devices faster than a host core: auto dilates, each worker runs one torch
    thread paced at twice the speed per core (folded), and the rows read the speed per core,
    one thread, and the rate of both cores (the probe's one thread times two)."""
    devices = {"count": [2], "cpus": 2, "speed": 1.5, "oversubscribe": True}
    run_dir, trials = fleet_run(tmp_path, devices=devices, repeats=2, dilation="auto")
    facts = json.loads((run_dir / "environment.json").read_text())["by_devices"]["2"]
    # 6 host cores asked; on a quiet host 0.5 x 2 - 0.25 = 0.75 are safe: d = 8; auto takes
    # off what others kept busy when it planned
    picked = facts["dilation"]
    budget = 0.5 * (2 - picked["busy_cores"]) - 0.25
    assert picked["demand_cores"] == 6.0 and picked["budget_cores"] == pytest.approx(budget)
    d = needed_factor(6.0, 1.5, budget, 3.0)
    assert picked["factor"] == d and (d == 8.0 or picked["busy_cores"] > 0)
    assert set(trials["status"]) == {"ok"} and (trials["dilation"] == d).all()
    assert (trials["threads"] == 1).all() and (trials["device_speed"] == 1.5).all()
    (spec,) = (run_dir / "sessions").glob("*/rank1/spec.json")
    worker = json.loads(spec.read_text())
    assert (worker["threads"], worker["speed"]) == (1, pytest.approx(1.5 * 2 / d))
    rates = facts["gflops"]
    gflops = trials.groupby("rank")["device_gflops"].first()
    assert gflops[1] == pytest.approx(rates["1"] * 1.5, rel=1e-3)


def test_a_pause_shows_in_its_peers_waiting_time(tmp_path):
    """Device 1 frozen for 1 s, 0.3 s into the session: applied within 50 ms of its time,
    thawed a second later, and device 0 waits for it about that second in the inferences the
    pause overlaps."""
    timeline = [{"at_s": 0.3, "device": 1, "pause_s": 1.0}]
    link = {"profile": "ideal", "bandwidth_mbit": [2]}  # about 0.25 s per inference
    run_dir, trials = fleet_run(tmp_path, timeline=timeline, repeats=8, link=link)
    (pause,) = timeline_of(run_dir)
    assert pause["kind"] == "pause" and pause["applied_ns"] is not None
    assert 0 <= (pause["applied_ns"] - pause["asked_ns"]) / 1e6 <= TIMELINE_TOLERANCE_MS
    assert (pause["ended_ns"] - pause["applied_ns"]) / 1e9 == pytest.approx(1.0, abs=0.05)
    peer = trials[trials["rank"] == 0]
    paused = peer["events"].str.contains("pause d1 1 s at 0.3 s")
    assert paused.any() and not paused.all()
    waited = peer.loc[paused, "wait_peer_ms"].sum() - peer.loc[~paused, "wait_peer_ms"].median()
    assert 850 <= waited <= 1300, peer[["repeat", "wait_peer_ms", "events"]]


def test_a_leave_ends_the_session_in_failed_rows_naming_it(tmp_path):
    """Device 1 leaves before measured inference 2 of every session: inferences 0 and 1 are
    ok rows, 2 and 3 failed rows naming the event; the next session (the other rate) starts
    again with both devices, and nothing of the run is left running. A departure is what the
    experiment asked for, not a fault: the run ends with status 0 and says it ended early."""
    timeline = [{"at_inference": 2, "device": 1, "leave": True}]
    link = {"profile": "ideal", "bandwidth_mbit": [5, 10]}
    says = "2 trials ok (2 ended early by a leave), 0 failed"
    run_dir, trials = fleet_run(tmp_path, says, timeline=timeline, repeats=4, link=link)
    for _, session in trials.groupby("bandwidth_mbit"):
        ok = session[session["status"] == "ok"]
        failed = session[session["status"] == "failed"]
        assert sorted(set(ok["repeat"])) == [0, 1] and sorted(set(failed["repeat"])) == [2, 3]
        words = r"device 1 left the session \(timeline\[0\]: leave d1 at inference 2, "
        assert failed["error"].str.contains(words).all(), failed["error"]
        assert (failed["events"] == "leave d1 at inference 2").all(), failed["events"]
    workers = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert workers.stdout == ""


def test_a_link_event_changes_the_devices_rate_from_its_inference_on(tmp_path):
    """Device 0's uplink drops from 8 to 2 Mbit/s before measured inference 3: its first
    message after takes its wire time at 2 Mbit/s, and its messages at least 3.5 times what
    they took before (the wire's ratio is 4); device 1's keep their time."""
    timeline = [{"at_inference": 3, "device": 0, "link": {"rate_mbit": 2}}]
    link = {"profile": "ideal", "bandwidth_mbit": [8]}
    run_dir, trials = fleet_run(tmp_path, timeline=timeline, repeats=6, link=link)
    (event,) = timeline_of(run_dir)
    assert event["kind"] == "link" and event["applied_ns"] is not None
    device = trials[trials["rank"] == 0].sort_values("repeat")
    assert (device["events"].iloc[3:] == "link d0 rate_mbit=2 at inference 3").all()
    blocks = load(run_dir).layers
    sent = blocks[blocks["rank"] == 0].sort_values(["repeat", "block"])
    before, after = sent[sent["repeat"] < 3], sent[sent["repeat"] >= 3]
    first = after.iloc[0]
    assert first["comm_ms"] == pytest.approx(first["frame_bytes"] * 8 / 2e3, rel=0.1), first
    assert after["comm_ms"].median() >= 3.5 * before["comm_ms"].median(), sent
    other = trials[trials["rank"] == 1]["comm_ms"]
    assert other.max() / other.min() < 1.2  # device 1's uplink kept its rate
