"""The delay and loss study of a run (testbed.results.impairment_study) and its report section
(testbed.report.impaired_links), on a run made for a known link: every message's communication
is wire + path + delay, and a device waits for what exceeds the message's window."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest

from testbed.report.impaired_links import delay_section, loss_section
from testbed.results.impairment_study import delay_table, hidden_delay, late_messages, loss_table
from testbed.results.store import Results

WIRE_MS, PATH_MS, FFN_MS = 0.2, 0.1, 7.0
WINDOWS = {"voltage": 0.5, "trace-b": 10.0}  # departure to need
BLOCKS, REPEATS = 4, 5


def delayed_run(tmp_path, delays=(0.0, 5.0, 20.0), counts=(2,)) -> Results:
    trials, layers = [], []
    for devices, (method, window), delay in itertools.product(counts, WINDOWS.items(), delays):
        params = "K=16" if method == "trace-b" else ""
        trial_id = f"p{devices}-{method}-10mbit-delay{delay:g}ms"
        comm = WIRE_MS + PATH_MS + delay
        wait = max(0.0, comm - window)
        for repeat in range(REPEATS):
            for rank in range(devices):
                common = dict(
                    trial_id=trial_id,
                    method=method,
                    params=params,
                    K=16 if params else pd.NA,
                    level_k=16 if params else pd.NA,
                    devices=devices,
                    rank=rank,
                    repeat=repeat,
                    bandwidth_mbit=10.0,
                )
                trials.append(
                    dict(
                        common,
                        status="ok",
                        impairments=f"delay {delay:g}ms" if delay else "",
                        link_delay_ms=delay,
                        effective_ms=BLOCKS * (20 + wait) + rank,
                        compute_ms=BLOCKS * 20.0 + rank,
                        link_lost_frames=0,
                        tcp_retransmits=0,
                    )
                )
                for block in range(BLOCKS):
                    start = 100.0 * block
                    layers.append(
                        dict(
                            common,
                            block=block,
                            received_bytes=500,
                            message_bytes=500,
                            departed_ms=start,
                            wait_start_ms=start + window,
                            ffn_start_ms=start + 1,
                            ffn_end_ms=start + 1 + FFN_MS,
                            comm_ms=comm,
                            wire_comm_ms=WIRE_MS,
                            wait_ms=wait,
                        )
                    )
    frame = pd.DataFrame(trials)
    plan = frame[frame["repeat"] == 0]
    return Results(tmp_path, frame, pd.DataFrame(layers), plan, {"name": "toy"}, {})


def test_the_model_predicts_every_wait_and_the_delay_each_method_hides(tmp_path):
    table = delay_table(delayed_run(tmp_path))
    assert len(table) == 2 * 3
    assert table["path_ms"].tolist() == pytest.approx([PATH_MS] * 6)
    assert table["predicted_wait_ms"].tolist() == pytest.approx(table["wait_ms"].tolist())
    hidden = hidden_delay(table).set_index("variant")
    assert list(hidden.index) == ["voltage", "trace-b K=16"]
    assert hidden.loc["trace-b K=16", "hides_ms"] == pytest.approx(10.0 - WIRE_MS - PATH_MS)
    assert hidden.loc["voltage", "hides_ms"] == pytest.approx(0.5 - WIRE_MS - PATH_MS)
    assert hidden.loc["trace-b K=16", "ffn_ms"] == pytest.approx(FFN_MS)


def test_the_report_section_states_the_crossover(tmp_path):
    text = "\n".join(delay_section(delayed_run(tmp_path)))
    assert "## Delay (not in the paper)" in text
    assert "trace-b K=16 hides a one-way delay up to 9.7 ms per message" in text
    assert "of which its FFN is 7.0 ms" in text
    # at 20 ms Trace-b waits 20.3 - 10 = 10.3 ms a message, measured and predicted alike
    assert "(10.3 / 10.3)" in text
    assert "Voltage, Prism and Astra hide at most 0.2 ms" in text


def test_a_run_without_a_delay_sweep_has_no_delay_study(tmp_path):
    assert delay_table(delayed_run(tmp_path, delays=(5.0,))).empty
    assert delay_section(delayed_run(tmp_path, delays=(5.0,))) == []


def test_the_loss_table_gives_the_tail_and_the_retransmissions(tmp_path):
    run = delayed_run(tmp_path, delays=(0.0, 5.0))
    trials = run.trials
    lossy = trials["link_delay_ms"] == 5.0
    trials.loc[lossy, "impairments"] = "delay 5ms loss random 1%"
    # one inference of five (repeat 4) loses a frame and waits out a 200 ms timeout
    hit = lossy & (trials["repeat"] == 4)
    trials.loc[hit, "effective_ms"] += 200
    trials.loc[hit, "link_lost_frames"] = 1
    trials.loc[hit & (trials["rank"] == 0), "tcp_retransmits"] = 1
    table = loss_table(run).set_index(["link", "variant"])
    row = table.loc[("10 Mbit/s, delay 5ms loss random 1%", "trace-b K=16")]
    assert row["n"] == REPEATS and row["retransmitted_share"] == pytest.approx(0.2)
    assert row["lost_per_inference"] == pytest.approx(0.2)
    assert row["retransmits_per_inference"] == pytest.approx(0.2)
    assert row["effective_ms_p99"] > row["effective_ms"] + 150
    clean = table.loc[("10 Mbit/s, no impairment", "trace-b K=16")]
    assert clean["retransmitted_share"] == 0
    text = "\n".join(loss_section(run))
    assert "| 10 Mbit/s, delay 5ms loss random 1% | trace-b K=16 | 5 |" in text


def test_the_loss_and_delay_tables_of_two_device_counts_name_the_count(tmp_path):
    """A run over P = 2 and 3: each of the report's tables has a row per count, told apart
    by a first column P (a one-count run's tables have none, above)."""
    run = delayed_run(tmp_path, delays=(0.0, 5.0), counts=(2, 3))
    run.trials.loc[run.trials["link_delay_ms"] == 5.0, "impairments"] = "delay 5ms loss random 1%"
    text = "\n".join(delay_section(run) + loss_section(run))
    for devices in (2, 3):
        assert f"| {devices} | trace-b K=16 | 10 | " in text
        assert f"| {devices} | 10 Mbit/s, delay 5ms loss random 1% | trace-b K=16 | 5 |" in text
        assert f"trace-b K=16 at P = {devices} hides a one-way delay up to 9.7 ms" in text
    assert text.count("| P | link | variant |") == 2  # the loss table and the tail's


def test_the_tail_is_told_apart_into_late_messages_and_compute(tmp_path):
    """Repeat 4 on the lossy link: device 0's block-2 message waits out a timeout (200 ms late);
    repeat 3 on the clean link: device 1 computes 90 ms longer, its messages on time."""
    run = delayed_run(tmp_path, delays=(0.0, 5.0))
    trials, layers = run.trials, run.layers
    lossy = trials["link_delay_ms"] == 5.0
    trials.loc[lossy, "impairments"] = "delay 5ms loss random 1%"
    hit = lossy & (trials["repeat"] == 4) & (trials["method"] == "trace-b")
    trials.loc[hit, "effective_ms"] += 200
    late = (
        layers["trial_id"].str.endswith("delay5ms")
        & (layers["method"] == "trace-b")
        & (layers["repeat"] == 4)
        & (layers["rank"] == 0)
        & (layers["block"] == 2)
    )
    layers.loc[late, "comm_ms"] += 200
    slow = ~lossy & (trials["repeat"] == 3) & (trials["rank"] == 1)
    trials.loc[slow, ["effective_ms", "compute_ms"]] += 90
    table = late_messages(run).set_index(["link", "variant"])
    row = table.loc[("10 Mbit/s, delay 5ms loss random 1%", "trace-b K=16")]
    assert (row["messages"], row["late"], row["timeouts"]) == (BLOCKS * REPEATS * 2, 1, 1)
    assert row["late_max_ms"] == pytest.approx(200 + PATH_MS)
    assert row["worst_effective_above_ms"] == pytest.approx(200)
    assert row["worst_compute_above_ms"] == pytest.approx(0)
    clean = table.loc[("10 Mbit/s, no impairment", "voltage")]
    assert (clean["late"], clean["worst_compute_above_ms"]) == (0, pytest.approx(90))
    assert clean["worst_latest_ms"] == pytest.approx(PATH_MS)
    text = "\n".join(loss_section(run))
    assert "| 10 Mbit/s, delay 5ms loss random 1% | trace-b K=16 | 40 | 1 | 1 |" in text
