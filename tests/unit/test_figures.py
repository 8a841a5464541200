import numpy as np
import pandas as pd
import pytest

from testbed.figures import make_figures
from testbed.figures.common import interval_caption, styles
from testbed.figures.latency import MARGIN, panel_limit
from testbed.results.store import Results
from testbed.results.variants import link_labels, variant_order

VARIANTS = [  # method, params, K, level_k, payload bits per layer (deliberately shuffled)
    ("trace-b", "K=64,level_k=4", 64, 4, 26),
    ("astra", "K=64", 64, pd.NA, 144),
    ("trace-b", "K=64,level_k=64", 64, 64, 62),
    ("voltage", "", pd.NA, pd.NA, 18432),
    ("trace-nb", "K=64", 64, 64, 62),
    ("prism", "segment=4", pd.NA, pd.NA, 6144),
]
ORDER = [
    "voltage",
    "prism segment=4",
    "astra K=64",
    "trace-nb K=64",
    "trace-b K=64 level_k=64",
    "trace-b K=64 level_k=4",
]


def toy_results(tmp_path, repeats: int = 3) -> Results:
    """2 devices x `repeats` repetitions of every variant at three rates."""
    generator = np.random.default_rng(0)
    rows = []
    for method, params, k, level_k, bits in VARIANTS:
        for rate in (1.0, 5.0, 20.0):
            for repeat in range(repeats):
                for rank in range(2):
                    wire = 12 * (bits + 528) / (rate * 1e3)
                    parts = generator.uniform(0.5, 1.5, 3) * [0.5, wire * 0.8, 0.1]
                    compute = 5.0 + generator.uniform()
                    rows.append(
                        dict(
                            method=method,
                            params=params,
                            K=k,
                            level_k=level_k,
                            devices=2,
                            rank=rank,
                            repeat=repeat,
                            bandwidth_mbit=rate,
                            status="ok",
                            compute_ms=compute,
                            wait_peer_ms=parts[0],
                            wait_link_ms=parts[1],
                            wait_wakeup_ms=parts[2],
                            wait_ms=parts.sum(),
                            effective_ms=compute + parts.sum(),
                            comm_ms=wire * 0.9,
                            wire_comm_ms=wire,
                            analytic_comm_ms=12 * bits / (rate * 1e3),
                            payload_bits_per_layer=bits,
                            measured_mbit=rate * 0.956,
                        )
                    )
    trials = pd.DataFrame(rows)
    plan = trials[trials["repeat"] == 0].drop(columns=["repeat"])
    plan = plan.assign(params=plan["params"].replace("", np.nan))  # as plan.csv reads back
    return Results(tmp_path, trials, pd.DataFrame(), plan, {"name": "toy"}, {})


def test_every_figure_orders_variants_by_method_then_decreasing_level(tmp_path):
    results = toy_results(tmp_path)
    assert variant_order(results.trials) == ORDER
    assert variant_order(results.plan) == ORDER
    look = styles(results.trials)
    assert len({s.marker for s in look.values()}) == len(ORDER)
    assert len({s.colour for s in look.values()}) == len(ORDER)
    offsets = [look[name].offset for name in ORDER]
    assert offsets == sorted(offsets) and offsets[0] < 1 < offsets[-1]


def test_make_figures_writes_every_figure(tmp_path):
    paths = make_figures(toy_results(tmp_path))
    assert [p.name for p in paths] == [
        "latency.png",
        "effective_vs_bandwidth.png",
        "comm_vs_bandwidth.png",
        "measured_vs_analytic.png",
        "compression.png",
    ]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_caption_states_n_and_what_the_bars_are():
    few = pd.DataFrame({"n": [3, 3], "level": [0.75, 0.75]})
    assert interval_caption(few) == (
        "median of n = 3 repetitions; bars: their range (a 75% interval: too few repetitions "
        "for 95%)"
    )
    mixed = pd.DataFrame({"n": [10, 12], "level": [0.9785, 0.9614]})
    assert interval_caption(mixed) == "median of n = 10-12 repetitions; bars: 95% CI of the median"
    eight = pd.DataFrame({"n": [8], "level": [1 - 2 / 2**8]})
    assert interval_caption(eight).endswith("95% CI of the median (= the range, 99.2%)")


def trace_results(tmp_path, accuracy: dict[int, float] | None = None) -> Results:
    """Two devices over a 20-1-20 Mbit/s trace: fixed K=64, fixed K=2 and auto, whose level
    drops to 4 codewords while 1 Mbit/s is in force; with `accuracy` (level_k -> top-1 %), the
    rows carry it as a run with `report.level_accuracy` would."""
    rows = []
    for params, level in (("K=64,level_k=64", 64), ("K=64,level_k=2", 2), ("K=64,level_k=auto", 0)):
        for repeat in range(30):
            t = 0.5 * repeat
            rate = 1.0 if 5 <= t % 15 < 10 else 20.0
            used = level or (4 if rate == 1.0 else 64)
            slow = used == 64 and rate == 1.0
            for rank in range(2):
                rows.append(
                    dict(
                        method="trace-b",
                        params=params,
                        K=64,
                        level_k=used,
                        devices=2,
                        rank=rank,
                        repeat=repeat,
                        bandwidth_mbit=13.667,
                        status="ok",
                        trace="step-20-1-20",
                        trace_s=t + 0.01 * rank,
                        link_rate_mbit=rate,
                        effective_ms=150.0 if slow else 100.0 + rank,
                        comm_ms=50.0 if slow else 3.0,
                        compute_ms=95.0,
                        wait_ms=5.0,
                        wait_peer_ms=1.0,
                        wait_link_ms=3.0,
                        wait_wakeup_ms=1.0,
                        wire_comm_ms=3.0,
                        analytic_comm_ms=2.0,
                        payload_bits_per_layer=1000,
                        measured_mbit=19.1,
                    )
                )
                if accuracy is not None:
                    rows[-1]["level_accuracy_pct"] = accuracy[used]
    trials = pd.DataFrame(rows)
    plan = trials[trials["repeat"] == 0].drop(columns=["repeat"])
    config = {"name": "toy", "model": {"name": "vit-tiny"}, "link": {"trace": "step-20-1-20.csv"}}
    if accuracy is not None:
        config["report"] = {"level_accuracy": "study/results.csv", "variant": "ema"}
    return Results(tmp_path, trials, pd.DataFrame(), plan, config, {})


def test_a_trace_run_answers_per_rate_in_force_and_draws_its_timeline(tmp_path):
    from testbed.results.answer import answer_lines

    results = trace_results(tmp_path)
    lines = answer_lines(results)
    assert "mean K used" in lines[1]
    one = next(i for i, line in enumerate(lines) if line.startswith("1 Mbit/s"))
    twenty = next(i for i, line in enumerate(lines) if line.startswith("20 Mbit/s"))
    assert lines[one].split()[-1] == "64.0" and "150" in lines[one]  # K=64 at 1 Mbit/s
    assert lines[one + 1].split()[-1] == "4.0" and "101" in lines[one + 1]  # auto: K=4
    assert lines[twenty + 1].split()[-1] == "64.0"  # auto at 20 Mbit/s: the finest
    assert not any("top-1" in line for line in lines)  # no table, no accuracy
    paths = make_figures(results)
    assert "trace.png" in [p.name for p in paths]


def test_a_trace_run_with_a_level_table_answers_the_accuracy_of_the_levels_used(tmp_path):
    from PIL import Image

    from testbed.figures.trace import traced
    from testbed.results.answer import answer_lines

    plain = Image.open(make_figures(trace_results(tmp_path / "plain"))[-1]).size
    results = trace_results(tmp_path, accuracy={64: 90.0, 4: 70.0, 2: 60.0})
    lines = answer_lines(results)
    assert lines[1].endswith("mean K used top-1 % used")
    one = next(i for i, line in enumerate(lines) if line.startswith("1 Mbit/s"))
    twenty = next(i for i, line in enumerate(lines) if line.startswith("20 Mbit/s"))
    cells = [lines[i].split()[-2:] for i in (one, one + 1, one + 2, twenty + 1)]
    assert cells == [["64.0", "90.0"], ["4.0", "70.0"], ["2.0", "60.0"], ["64.0", "90.0"]]
    assert "study/results.csv" in lines[-1] and lines[-1].startswith("top-1 % used: ")
    table = traced(results)
    accuracy_by_level = table.groupby("level_k")["level_accuracy_pct"].unique().to_dict()
    assert accuracy_by_level == {2: [60.0], 4: [70.0], 64: [90.0]}
    figure = make_figures(results)[-1]
    assert figure.name == "trace.png"
    assert Image.open(figure).size[1] > plain[1] * 1.15  # a fourth panel: accuracy over time


def test_the_answer_counts_the_inferences_the_emulator_stalled_in(tmp_path):
    from testbed.results.answer import answer_lines

    results = trace_results(tmp_path)
    trials = results.trials
    trials["trial_id"] = trials["params"]
    trials["link_stalled_ms"] = 0.0
    assert not any(line.startswith("link stalls") for line in answer_lines(results))
    # per trial, one inference seen by both devices (one stall, counted once), one by one
    trials.loc[trials["repeat"] == 3, "link_stalled_ms"] = 5.0
    trials.loc[(trials["repeat"] == 7) & (trials["rank"] == 1), "link_stalled_ms"] = 12.5
    stalls = [line for line in answer_lines(results) if line.startswith("link stalls")]
    assert stalls == [
        "link stalls: the machine held the serial emulator up during 6 of 90 inferences "
        "(52.5 ms in all, at most 12.5 ms in one; link_stalled_ms): their communication may "
        "read longer than the link's"
    ]


def test_a_latency_panel_cuts_only_bars_far_beyond_its_median():
    """Table IV at 10 Mbit/s: Voltage is 13x the others. The panel's scale follows the others
    (their longest with its interval, plus a margin); Voltage is cut at the edge."""
    effective = np.array([3262.0, 342.0, 244.0, 287.0, 238.0, 222.0])
    high = effective * 1.05
    limit = panel_limit(effective, high)
    assert limit == pytest.approx(MARGIN * 342.0 * 1.05)
    assert (effective > limit).tolist() == [True, False, False, False, False, False]
    # methods of one size (a tiny model at a fast rate): nothing is cut
    alike = np.array([9.8, 4.9, 3.0, 2.5, 3.3, 3.3])
    assert panel_limit(alike, alike) == pytest.approx(MARGIN * 9.8)
    assert panel_limit(np.array([np.nan, 5.0]), np.array([np.nan, 6.0])) == pytest.approx(6.9)


def delay_results(tmp_path, delays=(0.0, 5.0, 20.0), counts=(2,)) -> Results:
    """The toy run at 5 Mbit/s over links that differ in their one-way delay: Voltage's
    messages wait for it (24 a device), Trace-b's hide. Each device count beyond 2 has its
    devices' last one again and is 10 ms a device slower."""
    toy = toy_results(tmp_path)
    base = toy.trials[toy.trials["bandwidth_mbit"] == 5.0]
    parts = []
    for devices in counts:
        extra = [base[base["rank"] == 1].assign(rank=rank) for rank in range(2, devices)]
        fleet = pd.concat([base, *extra], ignore_index=True).assign(devices=devices)
        fleet["effective_ms"] += 10.0 * (devices - 2)
        for delay in delays:
            part = fleet.copy()
            waits = part["method"] == "voltage"
            part["impairments"] = f"delay {delay:g}ms" if delay else ""
            part["link_delay_ms"] = delay
            part["analytic_delay_ms"] = 24 * delay
            part.loc[waits, "effective_ms"] += 24 * delay
            names = part["method"] + part["params"].str.replace("=", "").str.replace(",", "-")
            part["trial_id"] = f"p{devices}-" + names + f"-5mbit-delay{delay:g}ms"
            parts.append(part)
    trials = pd.concat(parts, ignore_index=True).assign(
        correct=None,  # unlabelled inputs
        link_lost_frames=0,
        link_duplicated_frames=0,
        link_reordered_frames=0,
        tcp_retransmits=0,
    )
    plan = trials[trials["repeat"] == 0].drop(columns=["repeat"])
    config = {"name": "toy", "model": {"name": "vit-tiny"}}
    return Results(tmp_path, trials, pd.DataFrame(), plan, config, {})


def test_a_delay_sweep_draws_the_impairment_figures_instead_of_the_rate_ones(tmp_path):
    paths = make_figures(delay_results(tmp_path))
    assert [p.name for p in paths] == [
        "latency.png",
        "compression.png",
        "effective_vs_delay.png",
        "tail_by_link.png",
    ]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_an_impairment_sweep_over_two_device_counts_answers_and_draws_a_panel_per_count(
    tmp_path,
):
    """The sweep of issue 35: two device counts, the same two links at each. Every figure is
    drawn (tail_by_link once crashed on the links' labels, one per count), tail_by_link with
    a panel per count, and the answer has a table per count with both links in it."""
    from PIL import Image

    from testbed.results.answer import answer_lines

    one = make_figures(delay_results(tmp_path / "one", delays=(0.0, 20.0)))
    two = make_figures(delay_results(tmp_path / "two", delays=(0.0, 20.0), counts=(2, 3)))
    assert (
        [p.name for p in two]
        == [p.name for p in one]
        == [
            "latency.png",
            "compression.png",
            "effective_vs_delay.png",
            "tail_by_link.png",
        ]
    )
    widths = [Image.open(paths[-1]).size[0] for paths in (one, two)]
    assert widths[1] > 1.8 * widths[0], widths
    lines = answer_lines(delay_results(tmp_path / "two", delays=(0.0, 20.0), counts=(2, 3)))
    titles = [index for index, line in enumerate(lines) if line.startswith("P=")]
    assert [lines[i].split()[0] for i in titles] == ["P=2", "P=3"]
    for start, stop in zip(titles, [*titles[1:], len(lines)], strict=True):
        block = lines[start:stop]
        assert "5 Mbit/s, no impairment" in block and "5 Mbit/s, delay 20ms" in block


def test_summary_has_a_row_per_trial_of_an_impairment_sweep_over_two_device_counts(tmp_path):
    """Results.summary(): one row per method variant, device count and impairment variant,
    each the median over its own repetitions (of a repetition's slowest device, as the
    answer), never two variants' rows pooled."""
    run = delay_results(tmp_path, delays=(0.0, 20.0), counts=(2, 3))
    summary = run.summary()
    assert len(summary) == len(VARIANTS) * 2 * 2 == summary["trial_id"].nunique()
    assert set(summary["impairments"]) == {"", "delay 20ms"}
    trials = run.trials
    for row in summary.itertuples():
        own = trials[trials["trial_id"] == row.trial_id]
        assert set(own["devices"]) == {row.devices}
        assert set(own["impairments"]) == {row.impairments}
        expected = own.groupby("repeat")["effective_ms"].max().median()
        assert row.effective_ms == pytest.approx(expected)
    voltage = summary[summary["method"] == "voltage"].set_index(["devices", "impairments"])
    assert (
        voltage.loc[(3, "delay 20ms"), "effective_ms"]
        > voltage.loc[(2, "delay 20ms"), "effective_ms"]
    )
    assert (
        voltage.loc[(2, "delay 20ms"), "effective_ms"] > voltage.loc[(2, ""), "effective_ms"] + 400
    )


def test_links_are_named_with_their_impairments_in_order_of_delay(tmp_path):
    ok = delay_results(tmp_path, delays=(20.0, 0.0, 5.0)).trials
    labels, order = link_labels(ok, "bandwidth_mbit")
    assert order == [
        "5 Mbit/s, no impairment",
        "5 Mbit/s, delay 5ms",
        "5 Mbit/s, delay 20ms",
    ]
    assert set(labels) == set(order)
    plain = toy_results(tmp_path).trials
    assert link_labels(plain, "bandwidth_mbit")[1] == ["1 Mbit/s", "5 Mbit/s", "20 Mbit/s"]
