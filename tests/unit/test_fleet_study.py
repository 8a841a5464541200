"""The straggler study's answer from rows made here: slowdowns, by-speed gains, the answer's
lines per fleet, and timeline.png (testbed.results.fleet_study, testbed.figures.timeline)."""

from __future__ import annotations

import pandas as pd
import pytest

from testbed.figures.timeline import _event_marks, timeline_figure
from testbed.results.answer import answer_lines
from testbed.results.fleet_study import fleet_lines, fleet_table
from testbed.results.store import Results

# fleet label -> (device 1's speed, tokens, the slowest device's effective ms by method)
FLEETS = {
    "": (0.6, [99, 98], {"voltage": 3000.0, "trace-b": 400.0}),
    "speed1=0.3": (0.3, [99, 98], {"voltage": 3100.0, "trace-b": 800.0}),
    "speed1=0.3,by_speed": (0.3, [131, 66], {"voltage": 3600.0, "trace-b": 560.0}),
}


def results(tmp_path, repeats: int = 4, events: bool = False) -> Results:
    rows = []
    for fleet, (speed, tokens, effective) in FLEETS.items():
        for method, ms in effective.items():
            trial = f"p2-{method}-{fleet or 'fleet'}"
            for repeat in range(repeats):
                for rank in range(2):
                    late = events and repeat >= 2
                    rows.append(
                        dict(
                            trial_id=trial,
                            session_id=f"s-{fleet}",
                            method=method,
                            params="K=64" if method == "trace-b" else "",
                            devices=2,
                            rank=rank,
                            repeat=repeat,
                            bandwidth_mbit=10.0,
                            status="ok",
                            fleet=fleet,
                            tokens=tokens[rank],
                            device_speed=(speed if rank == 1 else 0.6) / (2 if late else 1),
                            effective_ms=ms * (1 + repeat % 2 * 0.01) - rank,
                            comm_ms=1.0,
                            events="speed d1=0.15 at inference 2" if late and rank else "",
                        )
                    )
    trials = pd.DataFrame(rows)
    plan = trials[trials["repeat"] == 0].drop(columns=["repeat"])
    return Results(tmp_path, trials, pd.DataFrame(), plan, {"model": {"name": "toy"}}, {})


def test_slowdown_and_what_by_speed_wins_back(tmp_path):
    table = fleet_table(results(tmp_path)).set_index(["variant", "relative", "partition_kind"])
    trace = table.loc[("trace-b K=64", 0.5, "even")]
    assert trace["effective_ms"] == pytest.approx(804)  # median of 800, 808, 800, 808
    assert trace["slowdown"] == pytest.approx(804 / 402)
    by_speed = table.loc[("trace-b K=64", 0.5, "by speed")]
    assert by_speed["by_speed_gain"] == pytest.approx(562.8 / 804)
    assert table.loc[("voltage", 0.5, "by speed"), "by_speed_gain"] > 1  # Voltage loses
    assert table.loc[("voltage", 1.0, "even"), "slowdown"] == 1.0
    assert list(table.index.get_level_values("variant")) == ["voltage"] * 3 + ["trace-b K=64"] * 3


def test_the_answer_has_a_line_per_fleet_and_the_fleet_table(tmp_path):
    lines = answer_lines(results(tmp_path))
    assert "10 Mbit/s, equal devices" in lines
    assert "10 Mbit/s, speed1=0.3,by_speed" in lines
    table = fleet_lines(results(tmp_path))
    assert table[1].startswith("fleets: the slowest device's speed over the fastest's")
    row = next(line for line in table if line.startswith("trace-b K=64"))
    assert row.split() == ["trace-b", "K=64", "1.00", "even", "402", "1.00x"]
    assert any(line.split()[-3:] == ["563", "1.40x", "0.70"] for line in table)


def test_a_run_of_one_fleet_has_no_fleet_table(tmp_path):
    one = results(tmp_path)
    one.trials["fleet"] = ""
    assert fleet_table(one).empty and fleet_lines(one) == []


def test_timeline_figure_marks_each_event_at_the_first_inference_that_names_it(tmp_path):
    run = results(tmp_path, events=True)
    part = run.trials[run.trials["session_id"] == "s-"]
    assert _event_marks(part) == [(2, "speed d1=0.15 at inference 2")]
    paused = part.assign(events=part["events"].str.replace("speed d1=0.15", "pause d1 1 s"))
    assert _event_marks(paused) == [(2, "pause d1 1 s at inference 2")]
    # a leave cut inference 4 short: only its failed rows name it
    cut = part[part["repeat"] == 3].assign(
        repeat=4, status="failed", events="speed d1=0.15 at inference 2; leave d1 at 1 s"
    )
    marks = _event_marks(pd.concat([part, cut]))
    assert marks == [(2, "speed d1=0.15 at inference 2"), (4, "leave d1 at 1 s")]
    path = timeline_figure(run, tmp_path / "timeline.png")
    assert path is not None and path.stat().st_size > 10_000
    assert timeline_figure(results(tmp_path), tmp_path / "none.png") is None


def test_summary_keeps_every_fleet_apart(tmp_path):
    """Results.summary(): a row per trial, fleets never merged (each its own latency)."""
    run = results(tmp_path)
    measured = ["compute_ms", "wire_comm_ms", "analytic_comm_ms", "wait_ms", "wait_peer_ms"]
    measured += ["wait_link_ms", "wait_wakeup_ms", "measured_mbit"]
    run.trials[measured] = 1.0
    run.trials["correct"] = None  # unlabelled inputs
    run.trials["partition"] = run.trials["tokens"].map({99: "99-98", 98: "99-98"}).fillna("131-66")
    summary = run.summary()
    assert len(summary) == 6 and summary["trial_id"].is_unique
    row = summary[(summary["method"] == "trace-b") & (summary["fleet"] == "speed1=0.3")]
    assert row["effective_ms"].item() == pytest.approx(804)  # the slowest device's, as the answer
    assert row["partition"].item() == "99-98"
