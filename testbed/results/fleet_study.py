"""The straggler study's answer (experiments/sweep-straggler.yaml, docs/devices.md): per device
count, rate and method variant, each fleet's effective latency (median over repetitions of the
slowest device), its slowdown against the same method on equal devices, and, where a fleet was
run with both partitions, what partitioning by speed wins back (its latency over the even
partition's at the same speeds).

A fleet is named by how fast its slowest device is relative to its fastest (`relative`: their
speeds at the trial's first inference) and its partition: `even` (the default), `by speed`, or
`given` (a list of token counts).
"""

from __future__ import annotations

import math

import pandas as pd

from testbed.results import stats
from testbed.results.store import Results
from testbed.results.study_lines import study_lines
from testbed.results.variants import variant_order
from tracevq.partition import partition_sizes

KEYS = ["devices", "bandwidth_mbit", "variant"]


def _fleets(ok: pd.DataFrame) -> pd.DataFrame:
    """Per trial: its straggler's relative speed and its partition's kind."""
    rows = []
    for trial, part in ok.groupby("trial_id"):
        first = part[part["repeat"] == part["repeat"].min()]
        speeds = first.groupby("rank")["device_speed"].first()
        devices = int(first["devices"].iloc[0])
        tokens = first.sort_values("rank").drop_duplicates("rank")["tokens"].tolist()
        if "by_speed" in str(first["fleet"].iloc[0]):
            kind = "by speed"
        elif tokens == partition_sizes(sum(tokens), devices):
            kind = "even"
        else:
            kind = "given"
        relative = round(float(speeds.min() / speeds.max()), 2)
        rows.append({"trial_id": trial, "relative": relative, "partition_kind": kind})
    return pd.DataFrame(rows)


def fleet_table(results: Results) -> pd.DataFrame:
    """One row per device count, rate, method variant and fleet: `effective_ms`, `n`,
    `slowdown` (over the equal fleet's, even partition) and `by_speed_gain` (by speed over
    even at the same relative speed; NaN where either is missing). Empty where the run has
    one fleet."""
    ok = results.ok_trials()
    if ok.empty or "fleet" not in ok or ok["fleet"].fillna("").nunique() <= 1:
        return pd.DataFrame()
    ok = ok.merge(_fleets(ok), on="trial_id")
    keys = [*KEYS, "relative", "partition_kind"]
    table = stats.summarize(ok, keys, ["effective_ms"], "max")[[*keys, "n", "effective_ms"]]
    indexed = table.set_index(keys)["effective_ms"]

    def ratio(row: pd.Series, relative: float, kind: str) -> float:
        key = (row["devices"], row["bandwidth_mbit"], row["variant"], relative, kind)
        base = indexed.get(key, math.nan)
        return row["effective_ms"] / base if base else math.nan

    table["slowdown"] = table.apply(lambda row: ratio(row, 1.0, "even"), axis=1)
    table["by_speed_gain"] = [
        ratio(row, row["relative"], "even") if row["partition_kind"] == "by speed" else math.nan
        for _, row in table.iterrows()
    ]
    order = {name: at for at, name in enumerate(variant_order(ok))}
    table["order"] = table["variant"].map(order)
    table = table.sort_values(
        ["devices", "bandwidth_mbit", "order", "relative", "partition_kind"],
        ascending=[True, True, True, False, False],
    )
    return table.drop(columns="order").reset_index(drop=True)


def fleet_lines(results: Results) -> list[str]:
    """The table as the run's answer prints it, one block per device count and rate."""
    table = fleet_table(results)
    if table.empty:
        return []
    caption = (
        "fleets: the slowest device's speed over the fastest's; effective ms (median of the "
        "slowest device), slowdown over equal devices, by speed over even at the same speeds"
    )
    header = (
        f"{'relative':>10}{'partition':>11}{'effective ms':>14}{'slowdown':>10}{'by speed':>10}"
    )
    return study_lines(table, caption, header, _row_cells)


def _row_cells(row: pd.Series) -> str:
    gain = "" if math.isnan(row["by_speed_gain"]) else f"{row['by_speed_gain']:.2f}"
    slowdown = "" if math.isnan(row["slowdown"]) else f"{row['slowdown']:.2f}x"
    return (
        f"{row['relative']:>10.2f}{row['partition_kind']:>11}"
        f"{row['effective_ms']:>14,.0f}{slowdown:>10}{gain:>10}"
    )
