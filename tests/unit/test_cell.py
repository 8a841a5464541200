"""The shared medium's parts that need no namespace: the program's `medium` command and its
refusal on the Python loop, the profile's fields, the sweep over media (link.medium), the
analytic communication on a cell, and the cell study's table and answer from rows made here
(the cell itself: tests/integration/test_cell_netns.py)."""

from __future__ import annotations

import pandas as pd
import pytest

from testbed.errors import ShapingError
from testbed.experiment.profiles import load_profile
from testbed.experiment.schema import parse_experiment
from testbed.link.links import with_airtime
from testbed.link.serial.program import Switch
from testbed.link.serial.protocol import Command, parse_command
from testbed.results.answer import answer_lines
from testbed.results.cell_study import cell_lines, cell_table
from testbed.results.store import Results
from testbed.sweep.plan import impairment_variants, plan_rows, plan_trials


def test_the_medium_command_is_parsed_and_checked() -> None:
    assert parse_command("medium shared 180", ["p0"]) == Command(
        "medium", medium="shared", airtime_us=180.0
    )
    assert parse_command("medium dedicated 0", ["p0"]).medium == "dedicated"
    for line, why in [
        ("medium shared -1", "the airtime must be >= 0 us"),
        ("medium shared nan", "the airtime must be >= 0 us"),
        ("medium dedicated 5", "a frame's airtime is for a shared medium"),
        ("medium air 0", "expected 'medium shared|dedicated AIRTIME_US'"),
        ("medium shared", "expected 'medium shared|dedicated AIRTIME_US'"),
    ]:
        with pytest.raises(ShapingError, match=why):
            parse_command(line, ["p0"])


def test_the_python_loop_refuses_a_shared_medium_naming_the_c_core() -> None:
    answer = Switch([], core=None).execute("medium shared 0")
    assert answer.startswith("error medium shared: the shared medium is scheduled by the C core")


def test_the_wifi_cell_profile_and_a_dedicated_variant_over_it() -> None:
    cell = load_profile("wifi-cell")
    assert (cell.medium, cell.rate_mbit, cell.airtime_us) == ("shared", 26.0, 180.0)
    lines = cell.with_impairments({"medium": "dedicated"})
    assert (lines.medium, lines.airtime_us, lines.rate_mbit) == ("dedicated", 0.0, 26.0)
    # a 1514-byte frame: 465.8 us at 26 Mbit/s and 180 us more
    assert with_airtime(26.0, 180.0) == pytest.approx(1514 * 8 / (1514 * 8 / 26 + 180))
    assert with_airtime(20.0, 0.0) == 20.0


def experiment(link: str):
    return parse_experiment(
        {
            "name": "cell",
            "model": {"name": "vit-tiny"},
            "devices": {"count": [3]},
            "link": link,
            "methods": [{"name": "voltage"}],
        }
    )


def test_media_are_swept_as_link_variants_and_the_cell_carries_every_device() -> None:
    swept = experiment({"bandwidth_mbit": 20, "medium": ["dedicated", "shared"]})
    assert impairment_variants(swept.link) == ['{"medium": "dedicated"}', '{"medium": "shared"}']
    both = experiment({"impairments": [{"delay_ms": 5}], "medium": ["shared"]})
    assert impairment_variants(both.link) == ['{"delay_ms": 5, "medium": "shared"}']
    assert impairment_variants(experiment({}).link) == [""]

    trials = plan_trials(swept)
    assert [t.trial_id for t in trials] == [
        "p3-voltage-20mbit-mediumdedicated",
        "p3-voltage-20mbit-mediumshared",
    ]
    rows = plan_rows(swept, trials)
    lines = [r.analytic_comm_ms for r in rows if r.trial_id.endswith("dedicated")]
    cell = [r.analytic_comm_ms for r in rows if r.trial_id.endswith("shared")]
    # on the cell, every device waits for all devices' messages on the one line
    assert cell == pytest.approx([sum(lines)] * 3)


def cell_results(tmp_path) -> Results:
    # (medium, method) -> (communication, effective latency) in ms
    measured = {
        ("dedicated", "voltage"): (100.0, 150.0),
        ("shared", "voltage"): (300.0, 350.0),
        ("dedicated", "trace-b"): (2.0, 40.0),
        ("shared", "trace-b"): (3.0, 42.0),
    }
    rows = []
    for (medium, method), (comm, effective) in measured.items():
        for repeat in range(3):
            for rank in range(3):
                rows.append(
                    dict(
                        trial_id=f"p3-{method}-20mbit-medium{medium}",
                        method=method,
                        params="K=1024" if method == "trace-b" else "",
                        devices=3,
                        rank=rank,
                        repeat=repeat,
                        bandwidth_mbit=20.0,
                        status="ok",
                        medium=medium,
                        comm_ms=comm + rank - 1,  # the mean over devices is `comm`
                        effective_ms=effective - rank,  # the slowest is `effective`
                    )
                )
    trials = pd.DataFrame(rows)
    plan = trials[trials["repeat"] == 0].drop(columns=["repeat"])
    return Results(tmp_path, trials, pd.DataFrame(), plan, {"model": {"name": "toy"}}, {})


def test_the_cell_table_gives_each_medium_and_the_ratio(tmp_path) -> None:
    table = cell_table(cell_results(tmp_path)).set_index("variant")
    assert list(table.index) == ["voltage", "trace-b K=1024"]
    assert table.loc["voltage", "comm_ms_dedicated"] == pytest.approx(100.0)
    assert table.loc["voltage", "comm_ratio"] == pytest.approx(3.0)
    assert table.loc["voltage", "effective_ratio"] == pytest.approx(350 / 150)
    assert table.loc["trace-b K=1024", "comm_ratio"] == pytest.approx(1.5)
    assert (table["n"] == 3).all()


def test_the_answer_names_each_medium_and_ends_with_the_cell_table(tmp_path) -> None:
    results = cell_results(tmp_path)
    lines = answer_lines(results)
    assert "20 Mbit/s, a line each" in lines
    assert "20 Mbit/s, one shared cell" in lines
    table = cell_lines(results)
    assert table[-2].split() == ["voltage", "100.0", "300.0", "3.00x", "150.0", "350.0", "2.33x"]
    assert all(line in lines for line in table)


def test_a_run_of_one_medium_has_no_cell_table(tmp_path) -> None:
    results = cell_results(tmp_path)
    results.trials = results.trials[results.trials["medium"] == "shared"]
    assert cell_table(results).empty
