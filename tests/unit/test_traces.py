"""Bandwidth traces: the CSV and Mahimahi formats, the shipped traces, looping and errors."""

import itertools
import time

import pytest

from testbed.errors import ConfigError
from testbed.link.replay import TraceReplay
from testbed.link.traces import (
    MODELS,
    RateTrace,
    generate,
    load_trace,
    read_csv,
    read_mahimahi,
    write_csv,
    write_mahimahi,
)


def test_a_csv_trace_is_a_step_function_that_loops(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("# comment\nt_s,mbit\n0,20\n10,2\n20,20\n30,\n")
    trace = read_csv(path)
    assert trace == RateTrace((0.0, 10.0, 20.0), (20.0, 2.0, 20.0), 30.0, "t")
    assert [trace.rate_at(t) for t in (0, 9.99, 10, 19.99, 20, 30, 41)] == [20, 20, 2, 2, 20, 20, 2]
    assert list(itertools.islice(trace.changes(5.0), 4)) == [(5.0, 20), (10, 2), (20, 20), (30, 20)]
    assert trace.mean_mbit() == pytest.approx(14.0)
    assert trace.stretched(0.1).times_s == (0.0, 1.0, 2.0)


def test_a_trace_may_carry_each_steps_delay_and_loss(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("t_s,mbit,delay_ms,loss_pct\n0,20,4,0.1\n10,2,30,0.5\n20,\n")
    trace = read_csv(path)
    assert trace.impairments == (
        {"delay_ms": 4, "loss_pct": 0.1},
        {"delay_ms": 30, "loss_pct": 0.5},
    )
    assert trace.impairments_at(25) == {"delay_ms": 4, "loss_pct": 0.1}  # looped
    assert trace.impairments_at(15)["delay_ms"] == 30 and trace.max_delay_ms == 30
    assert trace.stretched(2).impairments == trace.impairments
    only_delay = tmp_path / "d.csv"
    only_delay.write_text("t_s,mbit,delay_ms\n0,5,1\n1,5,2\n")
    assert read_csv(only_delay).impairments == ({"delay_ms": 1}, {"delay_ms": 2})
    assert read_csv(tmp_path / "t.csv").rate_at(15) == 2
    assert load_trace("step-20-2-20.csv").impairments == ()


def test_a_replay_hands_each_step_its_impairments(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("t_s,mbit,delay_ms\n0,20,0\n0.05,2,30\n0.1,\n")
    calls = []
    with TraceReplay(lambda *step: calls.append(step), read_csv(path)) as replay:
        while len(calls) < 3:
            time.sleep(0.01)
    assert calls[:3] == [
        (20.0, {"delay_ms": 0}, 0),
        (2.0, {"delay_ms": 30}, 1),
        (20.0, {"delay_ms": 0}, 2),
    ]
    assert replay.impairments_at_ns(replay.applied_ns[1]) == {"delay_ms": 30}
    assert replay.impairments_at_ns(replay.start_ns - 1) == {}


def test_without_an_end_row_the_last_step_lasts_the_median_step(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("t_s,mbit\n0,5\n1,6\n2,7\n")
    assert read_csv(path).duration_s == 3.0


def test_a_mahimahi_trace_reads_as_the_rate_of_each_window(tmp_path):
    # 12 Mbit/s = 1000 packets of 1500 bytes per second: one per millisecond for 2 s, then
    # one every 4 ms (3 Mbit/s) for 2 s
    stamps = list(range(1, 2001)) + list(range(2004, 4001, 4))
    path = tmp_path / "cell.mahimahi"
    path.write_text("\n".join(map(str, stamps)) + "\n")
    trace = read_mahimahi(path, bin_ms=1000)
    assert trace.duration_s == 4.0
    assert trace.rates_mbit == pytest.approx((12.0, 12.0, 3.0, 3.0), rel=0.01)


def test_mahimahi_round_trip_keeps_the_rates(tmp_path):
    trace = generate("lte-drops", seed=3)
    again = read_mahimahi(write_mahimahi(trace, tmp_path / "x.mahimahi"), bin_ms=1000)
    assert len(again.rates_mbit) == len(trace.rates_mbit)
    for ours, theirs in zip(trace.rates_mbit, again.rates_mbit, strict=True):
        assert theirs == pytest.approx(ours, abs=0.012 + 0.01 * ours)  # one packet per second


def test_the_shipped_traces_are_what_their_models_generate(tmp_path):
    for name in MODELS:
        shipped = load_trace(f"{name}.csv")
        assert shipped.rates_mbit == generate(name, seed=0).rates_mbit
        assert read_csv(write_csv(shipped, tmp_path / f"{name}.csv")) == shipped
    lte = load_trace("lte-drops.mahimahi")
    assert lte.mean_mbit() == pytest.approx(generate("lte-drops").mean_mbit(), rel=0.01)
    drops = [r for r in load_trace("lte-drops.csv").rates_mbit if r <= 1.0]
    assert len(drops) >= 6  # three drops of 2-4 s


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mbit,t_s\n0,1\n", "starts with the header 't_s,mbit'"),
        ("t_s,mbit\n1,5\n2,6\n", "the first step starts at t = 0"),
        ("t_s,mbit\n0,5\n0,6\n", "step times must increase"),
        ("t_s,mbit\n0,5\n1,0\n", "rates must be finite and positive"),
        ("t_s,mbit\n0,5\n1,nan\n", "rates must be finite and positive"),
        ("t_s,mbit\n0,five\n", "t.csv:2: not a number"),
        ("t_s,mbit\n0,5\n2,\n3,4\n", "a row after the end row"),
        ("t_s,mbit,loss_pct,delay_ms\n0,5,0,1\n", "optionally followed by delay_ms and loss_pct"),
        ("t_s,mbit,delay_ms\n0,5,1\n1,5,-2\n", "step 1 .t = 1 s.: delay_ms: must lie in"),
        ("t_s,mbit,loss_pct\n0,5,101\n", "step 0 .t = 0 s.: loss_pct: must lie in 0..100"),
        ("t_s,mbit,delay_ms\n0,5,x\n", "t.csv:2: not a number"),
    ],
)
def test_bad_csv_traces_are_refused_naming_the_file(tmp_path, text, message):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_csv(path)


def test_bad_mahimahi_traces_are_refused(tmp_path):
    path = tmp_path / "x.mahimahi"
    path.write_text("5\n3\n")
    with pytest.raises(ConfigError, match="non-decreasing"):
        read_mahimahi(path)
    path.write_text("1.5\n")
    with pytest.raises(ConfigError, match="whole milliseconds"):
        read_mahimahi(path)
    with pytest.raises(ConfigError, match="trace file not found"):
        load_trace("nope.csv")
