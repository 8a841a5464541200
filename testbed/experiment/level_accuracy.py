"""The accuracy of the Trace levels a run used, from the accuracy study's per-level table.

A run's latency says what a level costs; what it loses is measured by the accuracy study
(`python -m accuracy`), which evaluates Trace at every tree level of its codebooks. An
experiment names that table (`report: {level_accuracy: PATH}`), and every Trace row of its
results gets `level_accuracy_pct`: the table's top-1 (%) at the level the inference used.

The table is either the study's `table7_levels.csv` (one row per method, variant, metric,
devices and level: `mean` over seeds, no K column: it holds the study's main K only) or its
`results.csv` (one row per seed, with K: averaged over seeds here). A run's row matches the
table's rows with

- the same `method` (trace-b, trace-nb), `devices` (P) and `level_k` (the level used);
- the same K: the table's `K` column, or where it has none, the largest `level_k` of the
  method, variant, metric and P (the finest level of a tree is its whole codebook);
- `metric` = the run's `bundle.metric` (the study's `bundle.pt` has euclidean trees,
  `bundle-<metric>.pt` the others; `testbed.sweep.preflight` checks a given bundle's own metric);
- `variant` = `report.variant` if given; else, when the run loads its codebooks from a file
  (`bundle.path`), the table's one fine-tuned variant (any but `kmeans` among its rows of the
  run's Trace methods and metric, at any K) if it has exactly one, `kmeans` if it has none
  (more than one: name it); when the testbed fits the codebooks itself, `kmeans`.

The study's figures are means over its seeds for its own checkpoints: the figure is the
study's estimate for that method at that level, not a measurement of this run's model. Where
a study's `settings.yaml` lies beside the table, its model must be the run's. Under
`level_k: auto` each device chooses its own level; each device's row gets its own level's
accuracy, although the study measured every device at one level.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from testbed.errors import ConfigError
from testbed.experiment.method_grid import variant_spec
from testbed.experiment.schema import Experiment
from tracevq.placement import at_default_placement

FIELD = "report.level_accuracy"
KEYS = ["method", "devices", "K", "level_k"]
NEEDED = ("method", "variant", "metric", "devices", "level_k")
VALUES = ("mean", "accuracy")  # table7_levels.csv: mean over seeds; results.csv: per seed
KMEANS = "kmeans"
NOT_FINE_TUNED = (KMEANS, "base")


@dataclass(frozen=True)
class LevelAccuracy:
    """The matched rows of a study's table: top-1 (%) by (method, devices, K, level_k)."""

    path: str
    variant: str
    metric: str
    pct: dict[tuple[str, int, int, int], float]

    def levels(self, method: str, devices: int, K: int) -> list[int]:
        return sorted(level for m, p, k, level in self.pct if (m, p, k) == (method, devices, K))

    def frame(self) -> pd.DataFrame:
        """The matched rows, as saved beside a run's results (`level_accuracy.csv`)."""
        rows = [dict(zip(KEYS, key, strict=True), accuracy_pct=v) for key, v in self.pct.items()]
        table = pd.DataFrame(rows, columns=[*KEYS, "accuracy_pct"])
        return table.assign(variant=self.variant, metric=self.metric, source=self.path)

    def at(self, method: str, devices: int, K: int | None, level_k: int | None) -> float | None:
        """The study's top-1 (%) of `method` on `devices` devices at the level of `level_k`
        codewords of its K-codeword tree; None where the table has no such row."""
        return self.pct.get(_key((method, devices, K, level_k)))


def _key(values: tuple) -> tuple | None:
    method, *numbers = values
    if any(n is None or pd.isna(n) for n in numbers):
        return None
    return (str(method), *(int(n) for n in numbers))


def load_level_accuracy(experiment: Experiment) -> LevelAccuracy | None:
    """The experiment's table, matched to its metric and variant; None when it names none.
    Raises ConfigError naming `report.level_accuracy` (or `report.variant`)."""
    path = experiment.report.level_accuracy
    if path is None:
        return None
    table = _read(path)
    _check_model(path, experiment.model.name)
    metric = experiment.bundle.metric
    table = table[table["metric"] == metric]
    if table.empty:
        raise ConfigError(f"{FIELD}: {path} has no rows for tree metric {metric!r} (bundle.metric)")
    variant = _variant(table, experiment, path)
    chosen = table[table["variant"] == variant]
    pct = chosen.groupby(KEYS)["value"].mean()
    return LevelAccuracy(path, variant, metric, {_key(k): float(v) for k, v in pct.items()})


def _read(path: str) -> pd.DataFrame:
    """The table's rows with a level, as method, variant, metric, devices, K, level_k, value."""
    try:
        table = pd.read_csv(path)
    except (OSError, ValueError, UnicodeDecodeError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{FIELD}: {path} is not a readable CSV table ({first})") from None
    missing = [c for c in NEEDED if c not in table]
    value = next((c for c in VALUES if c in table), None)
    if missing or value is None:
        absent = ", ".join(missing + ([] if value else ["mean (or accuracy)"]))
        raise ConfigError(
            f"{FIELD}: {path} has no column {absent}; expected the accuracy study's "
            "table7_levels.csv or results.csv (results/accuracy/<task>/)"
        )
    table = table.dropna(subset=["level_k"]).rename(columns={value: "value"})
    if "placement" in table:  # a study of Table VI placements: the methods' defaults only
        table = at_default_placement(table)
    numbers = ["devices", "level_k", "value"] + (["K"] if "K" in table else [])
    for column in numbers:
        values = pd.to_numeric(table[column], errors="coerce")
        whole = column != "value"
        if values.isna().any() or (whole and (values % 1 != 0).any()):
            name, kind = (column, "whole number") if whole else (value, "number")
            raise ConfigError(f"{FIELD}: {path}: column {name} holds a value that is not a {kind}")
        table[column] = values.astype(int) if whole else values
    if not table["value"].between(0, 100).all():
        raise ConfigError(
            f"{FIELD}: {path}: column {value} holds a value outside 0..100 "
            "(the study's top-1 in percent)"
        )
    if "K" not in table:  # table7_levels.csv: the finest level is the whole codebook
        trees = table.groupby(["method", "variant", "metric", "devices"])["level_k"]
        table["K"] = trees.transform("max")
    return table[["method", "variant", "metric", "devices", "K", "level_k", "value"]].astype(
        {"method": str, "variant": str, "metric": str}
    )


def _check_model(path: str, model: str) -> None:
    """The study beside the table (its settings.yaml, if there) trained the run's model."""
    settings = Path(path).parent / "settings.yaml"
    if not settings.is_file():
        return
    try:
        studied = (yaml.safe_load(settings.read_text()) or {}).get("model", {}).get("name")
    except (yaml.YAMLError, AttributeError, OSError):
        return  # not a study's settings file: nothing to check against
    if studied is not None and studied != model:
        raise ConfigError(
            f"{FIELD}: {path} is from a study of {studied} ({settings}), this run's model "
            f"is {model}"
        )


def trace_methods(experiment: Experiment) -> list[tuple[str, int]]:
    """(method, K) of every Trace method variant of the experiment, in order, once each."""
    found: list[tuple[str, int]] = []
    for spec in map(variant_spec, experiment.method_variants()):
        if spec.is_trace and (spec.name, spec.K) not in found:
            found.append((spec.name, spec.K))
    return found


def _variant(table: pd.DataFrame, experiment: Experiment, path: str) -> str:
    variants = sorted(table["variant"].unique())
    named = experiment.report.variant
    if named is not None:
        if named not in variants:
            raise ConfigError(
                f"report.variant: {path} has no variant {named!r} (it has: {', '.join(variants)})"
            )
        return named
    if experiment.bundle.path is None:
        return KMEANS  # the testbed fits k-means codebooks itself
    ours = table[table["method"].isin([m for m, _ in trace_methods(experiment)])]
    tuned = sorted(set(ours["variant"]) - set(NOT_FINE_TUNED))
    if len(tuned) > 1:
        raise ConfigError(
            f"report.variant: {path} has several fine-tuned variants ({', '.join(tuned)}); "
            "name the one whose codebooks bundle.path holds"
        )
    return tuned[0] if tuned else KMEANS


def check_covered(
    table: LevelAccuracy, experiment: Experiment, level_sizes: Callable[[str, int], list[int]]
) -> None:
    """Every level a Trace method of the experiment may use has a row at every device count
    above one: its fixed level, or under `level_k: auto` every level of its tree
    (`level_sizes(method, K)`, coarsest first). Raises ConfigError naming `report.*`."""
    if not trace_methods(experiment):
        raise ConfigError(
            f"{FIELD}: no method of this experiment uses tree levels (trace-b, "
            "trace-nb); leave report.level_accuracy out"
        )
    for spec in map(variant_spec, experiment.method_variants()):
        if not spec.is_trace:
            continue
        auto = spec.level_k == "auto"
        needed = level_sizes(spec.name, spec.K) if auto else [spec.resolved_level_k]
        for devices in (p for p in experiment.devices.count if p > 1):
            have = table.levels(spec.name, devices, spec.K)
            missing = [level for level in needed if level not in have]
            if missing:
                raise ConfigError(
                    f"{FIELD}: {table.path} has no row for {spec.name} K={spec.K} at P={devices}"
                    f" level_k {', '.join(map(str, missing))} (variant {table.variant}, metric "
                    f"{table.metric}{', every level under level_k auto' if auto else ''}); "
                    f"it has {_held(table, spec.name)}"
                )


def resolve_accuracy_floor(
    variant: dict[str, Any], devices: int, table: LevelAccuracy | None
) -> dict[str, Any]:
    """A method variant whose `level_min_accuracy` (a top-1 %) is turned into its level for
    `devices` devices: the coarsest level of the table at or above it, as `level_min_k` under
    `level_k: auto` (auto may go finer, never coarser) and as `level_k` without one. A variant
    without the field, or on one device (no messages), is returned as it is. ConfigError when
    no level of the table reaches the floor."""
    floor = variant.get("level_min_accuracy")
    if floor is None or devices < 2:
        return variant
    if table is None:
        raise ConfigError("level_min_accuracy needs report.level_accuracy, the study's table")
    spec = variant_spec(variant)
    held = {
        level: table.at(spec.name, devices, spec.K, level)
        for level in table.levels(spec.name, devices, spec.K)
    }
    reaching = sorted(level for level, pct in held.items() if pct is not None and pct >= floor)
    where = f"methods: {spec.name} K={spec.K} at P={devices}: level_min_accuracy {floor:g}%"
    if not held:
        raise ConfigError(
            f"{where}: {table.path} has no row for it; it has {_held(table, spec.name)}"
        )
    if not reaching:
        best = max(held, key=lambda level: held[level] or 0.0)
        raise ConfigError(
            f"{where} is reached by no level of {table.path} (variant {table.variant}, metric "
            f"{table.metric}): its best is {held[best]:.2f}% at level_k {best}"
        )
    field = "level_min_k" if variant.get("level_k") == "auto" else "level_k"
    return {**variant, field: reaching[0]}


def _held(table: LevelAccuracy, method: str) -> str:
    """'trace-b K=1024 at P=2, 3': what the matched rows hold for `method`."""
    sizes = sorted({k for m, _, k, _ in table.pct if m == method})
    if not sizes:
        return f"no {method} rows"
    held = []
    for K in sizes:
        counts = sorted({p for m, p, k, _ in table.pct if (m, k) == (method, K)})
        held.append(f"{method} K={K} at P={', '.join(map(str, counts))}")
    return "; ".join(held)
