"""Result rows and what is made of them.

- `columns`: every result column, its type, unit and meaning (results/README.md is made
  from it); `facts`: what is known of a row before the workers measure it; `rows`: the one
  assembler of rows (facts and the devices' records in, typed DataFrames out).
- `store`: a run directory and its tables (`testbed.results.load(run_dir)`).
- `stats`: medians with distribution-free intervals, paired ratios; a proportion's and a
  quantile's intervals.
- `fidelity`: the fidelity report, each link's configured rate, delay and impairments against
  what it achieved (`fidelity.json`, `fidelity.csv`).
- `variants`: the names and order of method variants that every table and figure shares.
- `answer`: the table a run prints.

The accuracy study's top-1 of the levels a run used is an input the experiment names, read and
checked in `testbed.experiment.level_accuracy`.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """`load` and `Results` from `store`, imported on first use (pandas is not light)."""
    if name in ("load", "Results"):
        from testbed.results import store

        return getattr(store, name)
    raise AttributeError(f"module 'testbed.results' has no attribute {name!r}")
