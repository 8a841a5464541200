"""Which rows of an accuracy study's table a run's rows match
(testbed.experiment.level_accuracy), on synthetic tables in the two shapes the study writes:
table7_levels.csv and results.csv."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from testbed.errors import ConfigError
from testbed.experiment.level_accuracy import check_covered, load_level_accuracy
from testbed.experiment.schema import parse_experiment
from testbed.sweep.plan import plan_trials
from tracevq.codec import level_sizes_for

LEVELS_64 = level_sizes_for(64, 2)  # 2, 4, ..., 64


def top1(variant: str, metric: str, devices: int, level_k: int, K: int = 64) -> float:
    """A distinct, recognisable accuracy per row: 50 at the finest level of ema/euclidean/P=2."""
    base = {"kmeans": 40.0, "ema": 50.0, "gradient": 45.0}[variant]
    return base - 10 * (metric != "euclidean") - (devices - 2) - math.log2(K / level_k)


def table7(path: Path, K: int = 64, variants=("kmeans", "ema")) -> Path:
    """table7_levels.csv's shape: no K column, mean over seeds per level."""
    rows = [
        dict(
            method="trace-b",
            variant=v,
            metric=m,
            devices=p,
            level=i,
            level_k=k,
            mean=top1(v, m, p, k, K),
            std=0.5,
            min=0,
            max=100,
            n=3,
        )
        for v in variants
        for m in ("euclidean", "cosine")
        for p in (2, 3)
        for i, k in enumerate(level_sizes_for(K, 2))
    ]
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def results_csv(path: Path) -> Path:
    """results.csv's shape: one row per seed, a K column, baselines without a level, and rules
    other than the first at the finest level only."""
    rows = [dict(method="voltage", devices=2, accuracy=60.0, variant="base", seed=-1)]
    for seed, shift in ((0, -1.0), (1, 1.0)):
        for K in (64, 128):
            for v in ("kmeans", "ema", "gradient"):
                sizes = level_sizes_for(K, 2) if v != "gradient" else [K]
                rows += [
                    dict(
                        method="trace-b",
                        devices=2,
                        accuracy=top1(v, "euclidean", 2, k, K) + shift,
                        variant=v,
                        seed=seed,
                        K=K,
                        level_k=k,
                        metric="euclidean",
                    )
                    for k in sizes
                ]
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def experiment(table: Path, level_k="auto", bundle: str | None = None, **report):
    return parse_experiment(
        {
            "name": "x",
            "model": {"name": "vit-tiny"},
            "devices": {"count": [2]},
            "methods": [{"name": "trace-b", "K": 64, "level_k": level_k}, {"name": "voltage"}],
            "bundle": {"path": bundle} if bundle else {},
            "report": {"level_accuracy": str(table), **report},
        }
    )


def test_a_run_that_loads_a_fine_tuned_bundle_matches_its_fine_tuned_rows(tmp_path):
    table = load_level_accuracy(experiment(table7(tmp_path / "t7.csv"), bundle="b.pt"))
    assert (table.variant, table.metric) == ("ema", "euclidean")
    assert table.levels("trace-b", 2, 64) == LEVELS_64  # K: the largest level_k
    assert table.pct[("trace-b", 2, 64, 64)] == 50.0
    assert table.pct[("trace-b", 3, 64, 4)] == 50.0 - 1 - 4


def test_a_run_that_fits_its_codebooks_matches_k_means_rows(tmp_path):
    table = load_level_accuracy(experiment(table7(tmp_path / "t7.csv")))
    assert table.variant == "kmeans" and table.pct[("trace-b", 2, 64, 64)] == 40.0


def test_the_tree_metric_and_a_named_variant_choose_the_rows(tmp_path):
    path = table7(tmp_path / "t7.csv")
    chosen = experiment(path, bundle="b.pt", variant="kmeans").model_copy(
        update={
            "bundle": parse_experiment(
                {"name": "x", "methods": [{"name": "voltage"}], "bundle": {"metric": "cosine"}}
            ).bundle
        }
    )
    table = load_level_accuracy(chosen)
    assert (table.variant, table.metric) == ("kmeans", "cosine")
    assert table.pct[("trace-b", 2, 64, 64)] == 30.0


def test_per_seed_rows_are_averaged_and_keep_their_K(tmp_path):
    table = load_level_accuracy(
        experiment(results_csv(tmp_path / "results.csv"), bundle="b.pt", variant="ema")
    )
    assert table.levels("trace-b", 2, 64) == LEVELS_64
    assert table.levels("trace-b", 2, 128) == level_sizes_for(128, 2)
    assert table.pct[("trace-b", 2, 64, 64)] == 50.0  # seeds at 49 and 51
    assert table.pct[("trace-b", 2, 128, 64)] == 49.0
    assert not any(key[0] == "voltage" for key in table.pct)


def test_several_fine_tuned_variants_must_be_named(tmp_path):
    with pytest.raises(ConfigError, match=r"report.variant: .* \(ema, gradient\); name the one"):
        load_level_accuracy(experiment(results_csv(tmp_path / "r.csv"), bundle="b.pt"))


def test_rows_get_the_accuracy_of_the_level_they_used(tmp_path):
    table = load_level_accuracy(experiment(table7(tmp_path / "t7.csv"), bundle="b.pt"))
    used = [(2, 64), (2, 4), (3, 8)]  # (P, level_k) of trace-b rows at K = 64
    missing = [("voltage", 2, None, None), ("trace-b", 2, 64, None), ("trace-b", 4, 64, 64)]
    rows = [("trace-b", devices, 64, level) for devices, level in used] + missing
    values = [table.at(*row) for row in rows]
    assert values[:3] == [50.0, 46.0, 46.0]
    assert values[3:] == [None] * 3  # no level (voltage, a missing level), no P=4 row
    saved = table.frame()
    assert len(saved) == 2 * len(LEVELS_64) and set(saved["variant"]) == {"ema"}


@pytest.mark.parametrize(
    ("level_k", "devices", "K", "expected"),
    [
        ("auto", [2], 128, "no row for trace-b K=64 at P=2 level_k 2, 4, 8, 16, 32, 64"),
        (4, [2, 3], 64, None),
        ("auto", [1, 2], 64, None),  # one device sends nothing: no level to look up
        ("auto", [2, 5], 64, "no row for trace-b K=64 at P=5 level_k 2, 4, 8, 16, 32, 64"),
    ],
)
def test_every_level_the_run_may_use_needs_a_row(tmp_path, level_k, devices, K, expected):
    run = experiment(table7(tmp_path / "t7.csv", K), level_k, bundle="b.pt")
    run = run.model_copy(update={"devices": run.devices.model_copy(update={"count": devices})})
    table = load_level_accuracy(run)
    if expected is None:
        check_covered(table, run, lambda method, K: level_sizes_for(K, 2))
        return
    with pytest.raises(ConfigError) as caught:
        check_covered(table, run, lambda method, K: level_sizes_for(K, 2))
    assert expected in str(caught.value)
    assert "(variant ema, metric euclidean, every level under level_k auto)" in str(caught.value)


def test_only_the_levels_a_run_may_use_are_needed(tmp_path):
    path = table7(tmp_path / "t7.csv")
    frame = pd.read_csv(path)
    frame[frame["level_k"] != 2].to_csv(path, index=False)
    fixed = experiment(path, 64, bundle="b.pt")
    check_covered(load_level_accuracy(fixed), fixed, lambda method, K: level_sizes_for(K, 2))
    auto = experiment(path, "auto", bundle="b.pt")
    with pytest.raises(ConfigError, match=r"at P=2 level_k 2 \("):
        check_covered(load_level_accuracy(auto), auto, lambda method, K: level_sizes_for(K, 2))


def test_the_study_beside_the_table_trained_the_run_model(tmp_path):
    path = table7(tmp_path / "t7.csv")
    (tmp_path / "settings.yaml").write_text("name: digits\nmodel: {name: vit-digits}\n")
    with pytest.raises(ConfigError, match="from a study of vit-digits .* model is vit-tiny"):
        load_level_accuracy(experiment(path))
    (tmp_path / "settings.yaml").write_text("name: tiny\nmodel: {name: vit-tiny}\n")
    assert load_level_accuracy(experiment(path)) is not None


def test_no_table_no_lookup():
    run = parse_experiment({"name": "x", "methods": [{"name": "trace-b"}]})
    assert load_level_accuracy(run) is None


def floors(table: Path, *entries: dict):
    return parse_experiment(
        {
            "name": "x",
            "model": {"name": "vit-tiny"},
            "devices": {"count": [2, 3]},
            "methods": list(entries),
            "report": {"level_accuracy": str(table)},
        }
    )


def test_level_min_accuracy_picks_the_coarsest_level_at_or_above_it_per_device_count(tmp_path):
    """k-means rows: 40% at level 64 on two devices, a point less per halving, a point less on
    three devices (`top1`)."""
    table = table7(tmp_path / "t7.csv")
    run = floors(
        table,
        {"name": "trace-b", "K": 64, "level_k": "auto", "level_min_accuracy": 38},
        {"name": "trace-b", "K": 64, "level_min_accuracy": 36.5},
    )
    chosen = {
        (t.devices, t.method_params.get("level_k")): t.method_params for t in plan_trials(run)
    }
    assert chosen == {
        (2, "auto"): {"K": 64, "level_k": "auto", "level_min_k": 16},  # 38.0 at 16
        (2, 8): {"K": 64, "level_k": 8},  # 37.0 at 8, 36.0 at 4
        (3, "auto"): {"K": 64, "level_k": "auto", "level_min_k": 32},  # 38.0 at 32
        (3, 16): {"K": 64, "level_k": 16},  # 37.0 at 16, 36.0 at 8
    }
    trial = plan_trials(run)[0]
    assert trial.spec.level_min_k == 16 and "levelminaccuracy38" in trial.trial_id


def test_level_min_accuracy_no_level_reaches_is_one_line(tmp_path):
    run = floors(
        table7(tmp_path / "t7.csv"), {"name": "trace-nb", "K": 64, "level_min_accuracy": 38}
    )
    with pytest.raises(
        ConfigError,
        match=r"trace-nb K=64 at P=2: level_min_accuracy 38%: .*t7.csv has no row for it; "
        r"it has no trace-nb rows$",
    ):
        plan_trials(run)
    run = floors(
        table7(tmp_path / "t7.csv"), {"name": "trace-b", "K": 64, "level_min_accuracy": 40.5}
    )
    with pytest.raises(
        ConfigError,
        match=r"^methods: trace-b K=64 at P=2: level_min_accuracy 40.5% is reached by no level "
        r"of .*t7.csv \(variant kmeans, metric euclidean\): its best is 40.00% at level_k 64$",
    ):
        plan_trials(run)


@pytest.mark.parametrize(
    ("entry", "report", "expected"),
    [
        ({"level_min_accuracy": 90}, False, r"needs report.level_accuracy"),
        ({"level_min_accuracy": 0}, True, r"a top-1 percentage in \(0, 100\], got 0"),
        ({"level_min_accuracy": 90, "level_k": 8}, True, r"chooses the level itself"),
        ({"level_min_accuracy": 90, "level_k": "auto", "level_min_k": 8}, True, r"chooses.*two"),
        ({"level_min_accuracy": 90, "name": "astra"}, True, r"only Trace methods"),
    ],
)
def test_level_min_accuracy_is_checked_with_the_file(tmp_path, entry, report, expected):
    data = {
        "name": "x",
        "model": {"name": "vit-tiny"},
        "methods": [{"name": "trace-b", "K": 64, **entry}],
    }
    if report:
        data["report"] = {"level_accuracy": str(table7(tmp_path / "t7.csv"))}
    with pytest.raises(ConfigError, match=r"methods\[0\]\.level_min_accuracy: " + expected):
        parse_experiment(data)
