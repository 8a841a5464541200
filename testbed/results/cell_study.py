"""The cell study's answer (experiments/sweep-cell.yaml, docs/cell.md): per device count, rate
and method variant, communication and effective latency on a line per device (`dedicated`)
and on one shared cell (`shared`), and the cell's over the lines'.

Communication is the mean over a repetition's devices of each device's time waiting for its
peers' messages (`comm_ms`), effective latency the slowest device's (`effective_ms`); both
are medians over repetitions, as in the run's answer.
"""

from __future__ import annotations

import math

import pandas as pd

from testbed.results import stats
from testbed.results.store import Results
from testbed.results.study_lines import study_lines
from testbed.results.variants import variant_order

KEYS = ["devices", "bandwidth_mbit", "variant"]
MEDIA = ("dedicated", "shared")


def cell_table(results: Results) -> pd.DataFrame:
    """One row per device count, rate and method variant: `comm_ms` and `effective_ms` on
    each medium (`comm_ms_dedicated`, `comm_ms_shared`, ...), `n` (the fewer repetitions of
    the two) and the ratios shared over dedicated (`comm_ratio`, `effective_ratio`). Empty
    where the run did not sweep both media (link.medium)."""
    ok = results.ok_trials()
    if ok.empty or "medium" not in ok or set(ok["medium"].dropna()) != set(MEDIA):
        return pd.DataFrame()
    keys = [*KEYS, "medium"]
    comm = stats.summarize(ok, keys, ["comm_ms"], "mean")[[*keys, "n", "comm_ms"]]
    effective = stats.summarize(ok, keys, ["effective_ms"], "max")[[*keys, "effective_ms"]]
    long = comm.merge(effective, on=keys)
    table = long.pivot_table(
        index=KEYS, columns="medium", values=["n", "comm_ms", "effective_ms"], aggfunc="first"
    )
    table.columns = [f"{value}_{medium}" for value, medium in table.columns]
    table = table.reset_index()
    table["n"] = table[[f"n_{medium}" for medium in MEDIA]].min(axis=1)
    for value in ("comm", "effective"):
        table[f"{value}_ratio"] = table[f"{value}_ms_shared"] / table[f"{value}_ms_dedicated"]
    order = {name: at for at, name in enumerate(variant_order(ok))}
    table["order"] = table["variant"].map(order)
    table = table.sort_values(["devices", "bandwidth_mbit", "order"])
    columns = [*KEYS, "n"] + [f"{v}_{m}" for v in ("comm_ms", "effective_ms") for m in MEDIA]
    return table[[*columns, "comm_ratio", "effective_ratio"]].reset_index(drop=True)


def cell_lines(results: Results) -> list[str]:
    """The table as the run's answer prints it, one block per device count and rate."""
    table = cell_table(results)
    if table.empty:
        return []
    caption = (
        "one shared cell against a line per device: communication (mean of the devices) and "
        "effective latency (the slowest device), medians in ms, and the cell's over the lines'"
    )
    header = (
        f"{'comm lines':>12}{'comm cell':>11}{'ratio':>8}"
        f"{'eff. lines':>12}{'eff. cell':>11}{'ratio':>8}"
    )
    return study_lines(table, caption, header, _row_cells)


def _row_cells(row: pd.Series) -> str:
    return (
        f"{_ms(row['comm_ms_dedicated']):>12}"
        f"{_ms(row['comm_ms_shared']):>11}{_ratio(row['comm_ratio']):>8}"
        f"{_ms(row['effective_ms_dedicated']):>12}{_ms(row['effective_ms_shared']):>11}"
        f"{_ratio(row['effective_ratio']):>8}"
    )


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:,.1f}"


def _ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"
