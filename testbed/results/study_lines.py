"""A study's table as the run's answer prints it (`testbed.results.cell_study`, `fleet_study`):
a caption, then a block per device count and rate, a line per row of the table.

    P=2 10 Mbit/s   relative  partition  effective ms  slowdown  by speed
    voltage             1.00       even         3,015     1.00x
                        0.50   by speed         3,618     1.20x      1.16
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd


def study_lines(
    table: pd.DataFrame, caption: str, header: str, cells: Callable[[pd.Series], str]
) -> list[str]:
    """`table` (with `devices`, `bandwidth_mbit` and `variant`, in the order to print) after
    `caption`: per device count and rate a title ('P=2 10 Mbit/s') beside `header`, then a
    line per row, its variant (written once for the rows that follow it) and `cells(row)`."""
    width = max(len(v) for v in table["variant"]) + 2
    lines = ["", caption]
    for (devices, rate), part in table.groupby(["devices", "bandwidth_mbit"], sort=False):
        title = f"P={devices} {rate:g} Mbit/s"
        lines += ["", f"{title:<{width}}{header}"]
        previous = None
        for _, row in part.iterrows():
            name = row["variant"] if row["variant"] != previous else ""
            previous = row["variant"]
            lines.append(f"{name:<{width}}{cells(row)}")
    return lines
