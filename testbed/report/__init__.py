"""`python -m testbed.report`: the paper's latency tables next to ours, as REPORT.md.

    python -m testbed.report --latency RUN_DIR [--buffers RUN_DIR] [--delay RUN_DIR]
        [--loss RUN_DIR] --out REPORT.md
    python -m testbed.report --paper-devices RUN_DIR --out TABLE-IV.md   (make sweep-paper:
        RUN_DIR results/sweep-paper, its newest run; a run of make sweep-paper-buffers, whose
        Trace-b runs with and without buffers, gives Table V instead)

`paper`: the paper's tables beside ours, with its conventions; `impaired_links`: with runs of
the delay and loss sweeps, a section on each, which the paper does not have.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from testbed.errors import TestbedError
from testbed.report.impaired_links import delay_section, loss_section
from testbed.report.paper import (
    conventions,
    fig_6,
    fig_7_8,
    table_ii,
    table_iv,
    table_iv_paper_devices,
    table_v,
    table_v_paper_devices,
)
from testbed.results.store import Results, load, write_text


def build(
    latency_dir: Path,
    buffers_dir: Path | None,
    delay_dir: Path | None = None,
    loss_dir: Path | None = None,
) -> str:
    latency = load(latency_dir)
    lines = conventions(latency) + table_ii() + table_iv(latency) + fig_6(latency) + fig_7_8()
    if buffers_dir is not None:
        lines += table_v(load(buffers_dir))
    if delay_dir is not None:
        lines += delay_section(load(delay_dir))
    if loss_dir is not None:
        lines += loss_section(load(loss_dir))
    return "\n".join(lines) + "\n"


def paper_devices_table(run: Results) -> list[str]:
    """Table V for a run whose Trace-b runs with and without buffers, else Table IV."""
    if run.trials["params"].fillna("").str.contains("buffers=off").any():
        return table_v_paper_devices(run)
    return table_iv_paper_devices(run)


def newest_run(path: Path) -> Path:
    """`path` if it is a run directory, else the newest run directory in it."""
    if (path / "trials.parquet").is_file() or not path.is_dir():
        return path
    runs = sorted(p for p in path.iterdir() if (p / "trials.parquet").is_file())
    if not runs:
        raise TestbedError(f"{path} holds no run directory (no */trials.parquet)")
    return runs[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    runs = parser.add_mutually_exclusive_group(required=True)
    runs.add_argument("--latency", type=Path, help="run of the latency study")
    runs.add_argument(
        "--paper-devices",
        type=Path,
        help="run of experiments/sweep-paper.yaml or sweep-paper-buffers.yaml (or its folder: "
        "the newest run in it)",
    )
    parser.add_argument("--buffers", type=Path, help="run of the buffers study (Table V)")
    parser.add_argument("--delay", type=Path, help="run of experiments/sweep-delay.yaml")
    parser.add_argument("--loss", type=Path, help="run of experiments/sweep-loss.yaml")
    parser.add_argument("--out", type=Path, default=Path("results/reproduce/REPORT.md"))
    args = parser.parse_args(argv)
    try:
        if args.paper_devices is not None:
            run = load(newest_run(args.paper_devices))
            text = "\n".join(paper_devices_table(run)) + "\n"
            print(text)
        else:
            text = build(args.latency, args.buffers, args.delay, args.loss)
    except TestbedError as error:
        print(f"testbed.report: {error}", file=sys.stderr)
        return 1
    write_text(args.out, text)
    print(f"wrote {args.out}")
    return 0
