import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from testbed.errors import TestbedError
from testbed.report import paper_devices_table
from testbed.report.paper import (
    MEASURED,
    fig_7_8,
    label,
    paper_bits,
    table_ii,
    table_iv_paper_devices,
    table_v_paper_devices,
)
from testbed.results.store import Results


def test_paper_arithmetic_reproduces_its_printed_numbers():
    voltage = paper_bits("voltage", 197, 2, 768)
    assert voltage == 2_420_736
    assert 12 * voltage / (10 * 2**20) * 1000 == pytest.approx(2770.31, abs=0.01)  # Table IV
    assert 12 * paper_bits("prism", 197, 2, 768) / (10 * 2**20) * 1000 == pytest.approx(
        140.63, abs=0.01
    )
    assert 12 * paper_bits("astra", 197, 2, 768) / (10 * 2**20) * 1000 == pytest.approx(
        1.81, abs=0.01
    )
    assert round(voltage / paper_bits("trace-b", 197, 2, 768)) == 2426  # Fig. 7
    assert round(voltage / paper_bits("astra", 197, 2, 768)) == 1528
    assert round(voltage / paper_bits("trace-b", 197, 2, 768, level_k=2)) == 22624


def test_payload_table_rows_and_ratios():
    lines = table_ii()
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ")}
    assert rows["trace-b K=1024"] == "| trace-b K=1024 | 998 | 998 | 1.00 |"
    assert "| 2,420,736 | 2,433,024 | 1.01 |" in rows["voltage"]


def test_compression_table_has_every_model_and_device_count():
    text = "\n".join(fig_7_8())
    for model, devices in (("vit-b16", 2), ("vit-b16", 3), ("vivit-b", 10)):
        assert f"| {model} | {devices} |" in text
    assert "| vit-b16 | 2 | 1,536 | 2,438 | 4,837 | 22,739 |" in text


def test_trace_b_rows_are_labelled_by_their_level():
    assert label("trace-b", "K=1024,level_k=32") == "trace-b K=32"
    assert label("trace-b", "K=1024") == "trace-b K=1024"
    assert label("astra", "K=1024") == "astra"


def _paper_device_run(voltage_compute: float) -> Results:
    """A sweep-paper run's rows: Voltage and Trace-b K=32 at P = 2 and 3, three repetitions."""
    rows = []
    for devices, d in ((2, 5.0), (3, 7.5)):
        for method, params, compute, comm, effective in (
            ("voltage", "", voltage_compute, 3000.0, voltage_compute + 3000.0),
            ("trace-b", "K=1024,level_k=32", 240.0 * 2 / devices, 1.5, 250.0 * 2 / devices),
        ):
            for repeat in range(3):
                for rank in range(devices):
                    rows.append(
                        {
                            "status": "ok",
                            "method": method,
                            "params": params,
                            "devices": devices,
                            "bandwidth_mbit": 10.0,
                            "repeat": repeat,
                            "rank": rank,
                            "dilation": d,
                            "compute_ms": compute,
                            "comm_ms": comm,
                            "effective_ms": effective,
                            **dict.fromkeys(MEASURED[3:], 1.0),
                        }
                    )
    config = {"devices": {"profile": "paper-device"}, "model": {"name": "vit-b16"}}
    trials = pd.DataFrame(rows)
    return Results(Path("run"), trials, pd.DataFrame(), pd.DataFrame(), config, {})


def test_table_iv_on_paper_devices_is_calibrated_by_voltage_and_predicts_the_rest():
    """Voltage's compute at P = 2 sets the factor (92.5 / 250 = 0.37); Trace-b's compute is
    ours times it, its effective that plus what ours spent beyond its compute, beside Fig. 5's
    floors."""
    lines = table_iv_paper_devices(_paper_device_run(250.0))
    rows = {tuple(line.split(" | ")[:3]): line for line in lines if line.startswith("| ")}
    assert (
        "| 2 | 5 | voltage | calibrates | 250.00 | 3,000 | 3,250 | 92.50 |"
        in rows[("| 2", "5", "voltage")]
    )
    assert rows[("| 2", "5", "trace-b K=32")].endswith(
        "| predicted | 240.00 | 1.50 | 250.00 | 88.80 | 98.80 | 92.00 | 0.58 | 92.00 | 1.07 |"
    )
    assert rows[("| 3", "7.5", "trace-b K=32")].endswith(
        "| predicted | 160.00 | 1.50 | 166.67 | 59.20 | 65.87 | 63.00 | - | 63.00 | 1.05 |"
    )
    assert rows[("| 3", "7.5", "voltage")].split(" | ")[3] == "predicted"


def test_table_iv_on_paper_devices_without_voltage_at_p2_says_what_it_needs():
    run = _paper_device_run(250.0)
    run = dataclasses.replace(run, trials=run.trials[run.trials["method"] != "voltage"])
    with pytest.raises(TestbedError, match="needs Voltage at P = 2 and 10 Mbit/s"):
        table_iv_paper_devices(run)


def _buffers_run() -> Results:
    """A sweep-paper-buffers run's rows: Trace-b with and without buffers at P = 2 and 10."""
    rows = []
    for devices, d, off, on, late in ((2, 4.25, 5000.0, 3000.0, 0), (10, 20.5, 1000.0, 800.0, 2)):
        for params, compute in (("K=1024", on), ("K=1024,buffers=off,dedup=off", off)):
            for repeat in range(2):
                for rank in range(devices):
                    rows.append(
                        {
                            "status": "ok",
                            "method": "trace-b",
                            "params": params,
                            "devices": devices,
                            "repeat": repeat,
                            "rank": rank,
                            "dilation": d,
                            "overruns": late,
                            "compute_ms": compute,
                            "effective_ms": compute + 10.0,
                        }
                    )
    config = {"devices": {"profile": "paper-device"}, "model": {"name": "vivit-b"}}
    return Results(Path("run"), pd.DataFrame(rows), pd.DataFrame(), pd.DataFrame(), config, {})


def test_table_v_on_paper_devices_is_calibrated_at_p2_with_buffers_and_predicts_the_rest():
    """2,329 / 3,000 = 0.776: P = 2 without buffers predicts 3,882 ms (the paper's 3,441),
    P = 10 with them 621 ms (627); the gains are ours, beside the paper's."""
    run = _buffers_run()
    lines = paper_devices_table(run)
    assert lines[0] == (
        "## Table V on the paper's devices: compute (ms) without / with K/V buffers (vivit-b)"
    )
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| ")}
    assert rows["| 2"] == (
        "| 2 | 4.25 | 5,000 | 3,882 | 3,441 | 1.13 | 3,000 | 2,329 | 2,329 | 1.00 | 40.00 | "
        "32.32 | 2,339 | 0.00 |"
    )
    assert rows["| 10"] == (
        "| 10 | 20.5 | 1,000 | 776.33 | 742 | 1.05 | 800.00 | 621.07 | 627 | 0.99 | "
        "20.00 | 15.50 | 631.07 | 2.00 |"
    )
    without_on = dataclasses.replace(run, trials=run.trials[run.trials["params"] != "K=1024"])
    with pytest.raises(TestbedError, match="needs Trace-b with and without buffers at P = 2"):
        table_v_paper_devices(without_on)
