"""The fidelity report of a real run: two devices on the local backend, the serial emulator at
10 Mbit/s with 10 ms of delay and 5% loss; the report is written with the run, the achieved
loss lies in its interval, the delay and the rate are the configured ones, and the run says
so after its answer."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from testbed.results.columns import FIDELITY_NAMES

from .test_run import only_run_dir, run_cli, small_experiment


@pytest.mark.netns
@pytest.mark.slow
def test_a_lossy_delayed_link_is_reported_within_its_intervals(tmp_path):
    path = small_experiment(
        tmp_path,
        link={
            "profile": "ideal",
            "emulator": "serial",
            "bandwidth_mbit": [10],
            "impairments": [{"delay_ms": 10, "loss_pct": 5}],
        },
        methods=[{"name": "astra", "K": 16}, {"name": "trace-b", "K": 16}],
        repeats=8,
    )
    out = tmp_path / "out"
    done = run_cli(str(path), "--out", str(out), "--backend", "local", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = only_run_dir(out)
    summary = json.loads((run_dir / "fidelity.json").read_text())
    rows = summary["links"]
    table = pd.read_csv(run_dir / "fidelity.csv")
    assert list(table.columns) == FIDELITY_NAMES and len(table) == len(rows) == 2
    session = "p2-10mbit-delay10ms-loss5pct"
    assert (run_dir / "sessions" / session / "fidelity.json").is_file()
    for row in rows:
        print(
            f"\ndevice {row['rank']}: rate {row['rate_mbit']:.3f} Mbit/s, delay p50 "
            f"{row['delay_p50_ms']:.3f} ms of {row['delay_messages']} messages, lost "
            f"{row['lost']} of {row['frames']} [{row['lost_low_pct']:.2f}, "
            f"{row['lost_high_pct']:.2f}]%, stalls {row['stalls']}"
        )
        assert (row["session_id"], row["direction"]) == (session, "up")
        assert row["impairments"] == "delay 10ms loss random 5%"
        assert row["configured_lost_pct"] == 5.0
        assert row["frames"] > 50
        assert row["lost_low_pct"] <= 5.0 <= row["lost_high_pct"]
        assert row["lost_flagged"] is False
        assert row["duplicated"] == row["reordered"] == 0
        assert abs(row["rate_mbit"] / 10 - 1) <= 0.05 and row["rate_flagged"] is False
        assert row["delay_messages"] >= 40  # every message of astra and trace-b is one segment
        assert 10.0 <= row["delay_p50_ms"] <= 10.5, row["delay_p50_ms"]
        assert row["configured_delay_p50_ms"] == 10.0 and row["delay_flagged"] is False
    assert sum(row["lost"] for row in rows) > 0  # 5% of 100 frames each: none lost is 1e-5
    assert "fidelity: all 2 links within their intervals (fidelity.json)" in done.stdout
