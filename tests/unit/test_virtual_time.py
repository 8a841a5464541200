"""Virtual time's arithmetic: the dilation auto picks, what a link becomes on the host's clock,
the records brought back by d, and a pace that keeps to its references."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from devices import pace as pace_module
from devices.pace import LEAST_SAMPLES, Control, Pace, knows_run, low_percentile, run_kind
from devices.records import ArrivalRecord, BlockRecord, DeviceRecords, InferenceRecord, SessionFacts
from testbed.backends.base import Device
from testbed.backends.local import LocalBackend
from testbed.errors import ConfigError
from testbed.experiment.dilation import host_busy_cores, needed_factor, resolve_dilation
from testbed.experiment.profiles import LinkProfile
from testbed.experiment.schema import parse_experiment
from testbed.link.links import LinkState
from testbed.link.paths import PathImpairments
from testbed.results.facts import AppliedEvent, HostSessionFacts
from testbed.sweep.bundles import RunFiles
from testbed.sweep.fleets import session_fleet
from testbed.sweep.plan import plan_trials
from testbed.sweep.sessions import Session, SessionOutcome, device_spec, session_warmup
from testbed.sweep.virtual_time import virtual
from tracevq.spec import method_spec


def experiment(**fields):
    return parse_experiment({"name": "vt", "methods": [{"name": "voltage"}], **fields})


def test_auto_picks_the_least_step_that_fits_the_fleet_in_the_safe_load():
    # 2 cores: 0.5 x 2 - 0.25 (the serial emulator) = 0.75 safe; two full cores ask for 2
    picked = resolve_dilation(experiment(dilation="auto"), 2, None, "serial", cores=2)
    assert (picked.factor, picked.demand_cores, picked.budget_cores) == (2.75, 2.0, 0.75)
    assert picked.describe().startswith("d = 2.75 (auto): the fleet asks 2.00 host cores")
    # a timeline that speeds a device up later counts at its fastest
    fast = experiment(
        dilation="auto",
        devices={"speed": 0.25},
        timeline=[{"at_s": 1, "device": 1, "speed": 3}],
    )
    assert resolve_dilation(fast, 2, None, "tbf", cores=2).factor == 3.75  # 3 / 0.8 per thread
    assert needed_factor(0.1, 0.1, 0.95) == 1.0


def test_auto_leaves_out_the_cores_others_keep_busy():
    # the robustness fleet (0.5, 0.5, 0.25 of a core) beside one spinning process on 2 cores:
    # 0.5 x (2 - 1) - 0.25 = 0.25 safe for 1.25 asked, d = 5 (1.75 on a quiet host)
    fleet = experiment(dilation="auto", devices={"count": [3], "speed": [0.5, 0.5, 0.25]})
    assert resolve_dilation(fleet, 3, None, "serial", cores=2).factor == 1.75
    busy = resolve_dilation(fleet, 3, None, "serial", cores=2, busy_cores=1.0)
    assert (busy.factor, busy.budget_cores) == (5.0, pytest.approx(0.25))
    assert "(1 of the host's cores busy with other work)" in busy.describe()
    # a host busy to its last core still gives the fleet MIN_BUDGET: a large d, not a crash
    assert resolve_dilation(fleet, 3, None, "serial", cores=2, busy_cores=1.75).factor == 12.5


def test_the_hosts_busy_cores_count_a_spinning_process_and_not_this_one():
    quiet = host_busy_cores()
    spinner = multiprocessing.Process(target=_spin, args=(30.0,))
    spinner.start()
    try:
        time.sleep(0.3)
        busy = host_busy_cores()
    finally:
        spinner.kill()
        spinner.join()
    # a spinner takes an idle core; on a host already saturated (a training beside the tests)
    # it can only share the busy ones, and the count stays at the host's cores
    idle = (os.cpu_count() or 1) - quiet
    assert busy - quiet == pytest.approx(min(1.0, idle), abs=0.25), (quiet, busy)


def _spin(seconds: float) -> None:
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        pass


def test_a_fixed_dilation_too_low_for_a_fast_device_is_refused_naming_the_one_needed():
    with pytest.raises(
        ConfigError, match=r"dilation: 2 is too low for P=2: device 1 computes at 3.00"
    ):
        resolve_dilation(experiment(dilation=2, devices={"speed": [1, 3]}), 2, None, "serial")
    fits = resolve_dilation(experiment(dilation=3, devices={"speed": [1, 3]}), 2, None, "serial", 2)
    assert fits.factor == 3 and "auto would pick 5.5" in fits.describe()


def test_a_link_on_the_hosts_clock_has_every_time_d_times_and_nothing_else():
    profile = LinkProfile(
        name="x",
        delay_ms=20,
        jitter_ms=5,
        loss_pct=1,
        medium="shared",
        airtime_us=100,
        queue_latency_ms=50,
    )
    wall = profile.dilated(4)
    assert (wall.delay_ms, wall.jitter_ms, wall.airtime_us, wall.queue_latency_ms) == (
        80,
        20,
        400,
        200,
    )
    assert wall.loss_pct == 1 and profile.dilated(1) is profile
    paths = PathImpairments({1: {"delay_ms": 3, "loss_pct": 2}}, {(0, 1): {"jitter_ms": 1}})
    assert paths.dilated(2) == PathImpairments(
        {1: {"delay_ms": 6, "loss_pct": 2}}, {(0, 1): {"jitter_ms": 2}}
    )


def _records(start: int) -> DeviceRecords:
    session = SessionFacts(status="done", rank=0, devices=2, spec={})
    inference = InferenceRecord("r", 0, start, start + 400_000_000, 300.0, 100.0, 400.0)
    inference.est_rate_mbit, inference.speed = 2.5, 0.1
    block = BlockRecord(
        "r", 0, 0, 40.0, 8.0, 10, 20, 30, start, start + 4, start + 8, None, None, start, start + 8
    )
    arrival = ArrivalRecord("r", 0, 0, 1, 30, start + 200_000_000, start + 200_000_400, None, 4000)
    return DeviceRecords(session, [inference], [block], [arrival])


def test_a_dilated_sessions_records_come_back_divided_by_d_around_its_first_inference():
    start = 1_000_000_000_000
    facts = HostSessionFacts(
        "s",
        session_s=12.0,
        stalls=[(start + 100_000_000, 8_000_000)],
        timeline=[AppliedEvent(0, "pause", 1, "p", start + 40_000_000, start + 80_000_000)],
    )
    outcome = SessionOutcome(facts, runs={"r": {0: _records(start)}})
    back = virtual(outcome, 4)
    device = back.runs["r"][0]
    inference, block, arrival = device.inferences[0], device.blocks[0], device.arrivals[0]
    assert (inference.effective_ms, inference.compute_ms, inference.wait_ms) == (100, 75, 25)
    assert (inference.start_ns, inference.end_ns) == (start, start + 100_000_000)
    assert inference.est_rate_mbit == 10 and inference.speed == pytest.approx(0.4)
    assert (block.compute_ms, block.wait_ms, block.ffn_end_ns) == (10, 2, start + 2)
    assert (arrival.kernel_ns, arrival.echo_ps_per_byte) == (start + 50_000_000, 1000)
    assert back.facts.stalls == [(start + 25_000_000, 2_000_000)]
    assert back.facts.timeline[0].asked_ns == start + 10_000_000
    assert back.facts.session_s == 12.0  # what it cost here stays the host's
    assert virtual(outcome, 1) is outcome


def test_a_pace_keeps_to_its_reference_not_to_what_a_stretch_took():
    assert low_percentile([5.0, 1.0, 3.0, 2.0, 4.0] * 2) == 1.0
    pace = Pace(speed=0.5)
    pace.give({"run|work|": 0.004})  # 4 ms per unit on a warm core
    pace.learned()
    began = time.perf_counter()
    with pace.stretch(("run", "work", ""), lambda: 2):  # 2 units: 8 ms, at half speed 16
        pass
    took = time.perf_counter() - began
    assert 0.0155 < took < 0.03 and pace.overruns == 0
    with pace.stretch(("run", "work", "")):  # 1 unit at half speed: 8 ms, but it takes 20
        time.sleep(0.02)
    assert pace.overruns == 1
    assert pace.new_references() == {}  # given, not learned


def test_warm_ups_run_at_full_speed_and_give_every_kind_sampled_enough_its_reference():
    pace = Pace(speed=0.25)
    pace.kinds = {"run": "vit|voltage"}
    began = time.perf_counter()
    for _ in range(4):
        with pace.stretch(("run", "ffn", "")):
            sum(range(20_000))
    assert time.perf_counter() - began < 0.05  # no pacing while learning
    pace.learned()
    assert set(pace.new_references()) == {"vit|voltage|ffn|"}
    assert pace.new_references()["vit|voltage|ffn|"]["samples"] == 4


def _warm_up_in_turns(turn: str, started, out) -> None:
    """A device's warm-ups (a process of its own): five sampled stretches of 20 ms of spinning,
    each one's start and end (perf_counter, one clock for both processes) put on `out`."""
    pace = Pace(turn=Path(turn))
    started.wait()  # both devices ready: they start at once
    for _ in range(5):
        with pace.stretch(("run", "ffn", "")):
            begin = time.perf_counter()
            while time.perf_counter() - begin < 0.02:
                pass
            out.put((begin, time.perf_counter()))


def test_devices_sampling_their_warm_ups_take_turns_on_the_hosts_cores(tmp_path):
    """Two devices warming up at once: with the session's turn file, no sampled stretch of one
    overlaps one of the other (each sample a core's alone)."""
    turn = tmp_path / "turn"
    turn.touch()
    context = multiprocessing.get_context("spawn")
    started, out = context.Barrier(2), context.Queue()
    devices = [
        context.Process(target=_warm_up_in_turns, args=(str(turn), started, out)) for _ in range(2)
    ]
    for device in devices:
        device.start()
    spans = sorted(out.get(timeout=60) for _ in range(10))
    for device in devices:
        device.join(timeout=30)
        assert device.exitcode == 0
    assert all(end <= begin for (_, end), (begin, _) in zip(spans, spans[1:], strict=False))


def test_a_turn_not_had_in_time_still_samples_the_stretch(tmp_path, monkeypatch):
    """A peer that holds the turn past TURN_WAIT_S does not hang the warm-ups: the stretch runs
    and is sampled without it."""
    monkeypatch.setattr(pace_module, "TURN_WAIT_S", 0.05)
    turn = tmp_path / "turn"
    turn.touch()
    with turn.open() as peer:
        fcntl.flock(peer, fcntl.LOCK_EX)
        pace = Pace(turn=turn)
        begin = time.perf_counter()
        with pace.stretch(("run", "ffn", "")):
            pass
        assert 0.05 <= time.perf_counter() - begin < 1.0
    assert len(pace.samples["run|ffn|"]) == 1


def test_after_a_link_event_the_rate_derived_columns_follow_the_rate_in_force():
    from testbed.results.rows import _link_in_force

    context = {
        "bandwidth_mbit": 8.0,
        "uplink_mbit": 8.0,
        "analytic_comm_ms": 10.0,
        "analytic_comm_ms_paper": 10.5,
    }
    drop = AppliedEvent(0, "link", 1, "link d1 2 Mbit/s", 100, 200, rate_mbit=2.0)
    assert _link_in_force(context, [drop], 1, 150) is context  # before it was in force
    assert _link_in_force(context, [drop], 0, 250) is context  # another device's uplink
    after = _link_in_force(context, [drop], 1, 250)
    assert (after["uplink_mbit"], after["analytic_comm_ms"], after["analytic_comm_ms_paper"]) == (
        2.0,
        40.0,
        42.0,
    )


def test_the_host_keeps_the_first_well_sampled_cost_of_each_kind(tmp_path):
    import json

    from testbed.sweep import stretch_costs

    cache = tmp_path / "costs.json"
    for name, cost, samples in (("a", 1.0, 12), ("b", 2.0, 12)):
        out = tmp_path / name
        out.mkdir()
        learned = {
            "vit-b16|voltage|ffn|": {"per_unit_s": cost, "samples": samples},
            f"vit-b16|voltage|head|{name}": {"per_unit_s": cost, "samples": 1},  # too few
            "vit-tiny|voltage|ffn|": {"per_unit_s": cost, "samples": samples},
        }
        (out / "references.json").write_text(json.dumps(learned))
    assert stretch_costs.keep([tmp_path / "a", tmp_path / "missing"], cache) == 2
    assert stretch_costs.keep([tmp_path / "b"], cache) == 0  # the first learned stays
    assert stretch_costs.known("vit-b16", cache) == {"vit-b16|voltage|ffn|": 1.0}


def test_a_dilated_device_of_two_cores_is_one_host_thread_at_twice_its_speed(tmp_path):
    """In virtual time a device's c cores are folded into its worker's one thread (c x P
    threads on two cores preempt one another inside a GEMM): the spec, the control file the
    timeline writes and the speed read back all say so; at d = 1 nothing is folded."""
    exp = experiment(
        dilation=4,
        devices={"count": [2], "cpus": 2, "speed": 1.5, "oversubscribe": True},
        timeline=[{"at_s": 1, "device": 1, "speed": 1.0}],
    )
    trials = plan_trials(exp)
    backend = LocalBackend("vt", tmp_path / "run")
    live = {0: None, 1: None}
    _, fleet = session_fleet(exp, trials, tmp_path / "s", None, {}, live, 4.0)
    assert fleet.folded == [2, 2] and fleet.worker_speed(1) == 0.75  # 1.5 x 2 / 4
    device = Device(1, "d1", "127.0.0.1", "lo", cpus=2, threads=2)
    devices = [Device(0, "d0", "127.0.0.2", "lo", cpus=2, threads=2), device]
    session = Session(trials, tmp_path / "s", 7000, LinkState(10), RunFiles(), fleet)
    spec = device_spec(backend, exp, session, device, devices, tmp_path / "out")
    assert (spec.threads, spec.speed, spec.rate_mbit) == (1, 0.75, 2.5)
    assert spec.peers == ["127.0.0.2:7000", "127.0.0.1:7000"]
    timeline = fleet.timeline
    assert timeline is not None
    timeline.write_controls()
    assert Control(timeline.controls[1]).speed == 0.75
    records = _records(1_000_000_000_000)
    records.inferences[0].speed = 0.75
    outcome = SessionOutcome(HostSessionFacts("s"), runs={"r": {1: records}})
    assert virtual(outcome, 4, fleet.folded).runs["r"][1].inferences[0].speed == 1.5
    _, unfolded = session_fleet(exp, trials, tmp_path / "t", None, {}, live, 1.0)
    assert unfolded.folded == [1, 1] and unfolded.threads(device) == 2


def test_a_paced_run_without_kept_references_warms_up_enough_to_keep_them(tmp_path):
    """A warm-up samples a run's embedding and first block once: a paced session whose runs
    this host has no references for warms up LEAST_SAMPLES times, every device alike, and
    the experiment's warm-ups once every device's run is known (by the worker's own kind)."""
    exp = experiment(devices={"count": [2], "speed": 0.5}, warmup=1)
    trials = plan_trials(exp)
    _, fleet = session_fleet(exp, trials, tmp_path / "s", None, {}, {0: None, 1: None}, 1.0)
    session = Session(trials, tmp_path / "s", 7000, LinkState(10), RunFiles(), fleet)
    devices = [Device(rank, f"d{rank}", "127.0.0.1", "lo", cpus=1, threads=1) for rank in (0, 1)]
    assert session_warmup(exp, session, devices, {}) == LEAST_SAMPLES
    params = method_spec("voltage").params()
    kinds = [run_kind("vit-b16", "voltage", params, tokens, 1, 1) for tokens in fleet.sizes]
    assert session_warmup(exp, session, devices, {f"{kinds[0]}|embed|": 1e-3}) == LEAST_SAMPLES
    known = {f"{kind}|embed|": 1e-3 for kind in kinds}
    assert session_warmup(exp, session, devices, known) == 1
    assert knows_run(known, kinds[1]) and not knows_run(known, kinds[1].replace("b1", "b2"))
    unpaced = Session(trials, tmp_path / "s", 7000, LinkState(10), RunFiles(), None)
    assert session_warmup(exp, unpaced, devices, {}) == 1


def test_a_fixed_dilation_too_low_for_a_folded_device_is_refused():
    exp = experiment(dilation=2, devices={"cpus": 2, "speed": 1.5, "oversubscribe": True})
    with pytest.raises(
        ConfigError, match=r"dilation: 2 is too low for P=2: device 0 computes at 3.00 host cores"
    ):
        resolve_dilation(exp, 2, None, "serial", cores=2)
    auto = resolve_dilation(exp.model_copy(update={"dilation": "auto"}), 2, None, "serial", 2)
    assert auto.factor == 8.0 and auto.heaviest == 3.0  # the demand, 6 cores / 0.75
    # a device's thread alone: 1 core on a big host, d = 3.75 for 3 host cores on one thread
    one = experiment(dilation="auto", devices={"count": [1], "cpus": 2, "speed": 1.5})
    assert resolve_dilation(one, 1, None, "tbf", cores=64).factor == 3.75
