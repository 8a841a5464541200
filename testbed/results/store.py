"""A run directory and its DataFrames.

    results/<experiment>/<run-id>/
        config.yaml          the resolved experiment
        environment.json     versions, kernel, qdisc support, host cores, git commit
        plan.csv             the trial plan with analytic payloads
        trials.parquet/.csv  one row per device per repetition (testbed.results.columns)
        layers.parquet       one row per device per layer per repetition
        fidelity.json/.csv   each link configured against achieved (testbed.results.fidelity)
        level_accuracy.csv   the accuracy study's rows matched (report.level_accuracy)
        trials/<trial-id>/   per trial: its rows (written atomically when its session ends)
        sessions/<id>/       per worker session: each device's spec, records and log
        links/               per shaping: the probe's rates and the link's state
        figures/

`load(run_dir)` returns the DataFrames; the combined tables are rebuilt from the per-trial
files after every trial, so a crash loses at most the trial that was running.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from testbed.atomic import write_atomically
from testbed.errors import StorageError, TestbedError
from testbed.results import stats
from testbed.results.columns import TRIAL_NAMES
from testbed.results.variants import trial_impairments, variant

TRIAL_ROWS = "trial.parquet"
LAYER_ROWS = "layers.parquet"


def write_atomic(path: Path, write: Any) -> Path:
    """`write(tmp_path)`, renamed into place (`testbed.atomic`): readers never see half a file.
    A write that fails (a full disk) raises StorageError naming the file; what was written
    before stays whole, and `--resume` finishes the run."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, write)
    except OSError as error:
        raise StorageError(
            f"cannot write {path}: {error.strerror or error}; what was written before is "
            "whole: free space and finish the run with `python -m testbed.run --resume "
            "RUN_DIR`"
        ) from None
    return path


def write_frame(frame: pd.DataFrame, path: Path) -> Path:
    if path.suffix == ".csv":
        return write_atomic(path, lambda tmp: frame.to_csv(tmp, index=False))
    return write_atomic(path, lambda tmp: frame.to_parquet(tmp, index=False))


def write_text(path: Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def trial_dir(run_dir: Path, trial_id: str) -> Path:
    return Path(run_dir) / "trials" / trial_id


def save_trial(run_dir: Path, trial_id: str, trials: pd.DataFrame, layers: pd.DataFrame) -> None:
    """Write one finished trial's rows (layers first: the trial file marks it finished)."""
    directory = trial_dir(run_dir, trial_id)
    write_frame(layers, directory / LAYER_ROWS)
    write_frame(trials.reindex(columns=TRIAL_NAMES), directory / TRIAL_ROWS)


def finished_trials(run_dir: Path) -> set[str]:
    """Trials whose rows are on disk with status ok (what --resume skips)."""
    done = set()
    for path in Path(run_dir).glob(f"trials/*/{TRIAL_ROWS}"):
        frame = pd.read_parquet(path, columns=["status"])
        if len(frame) and (frame["status"] == "ok").all():
            done.add(path.parent.name)
    return done


def combine(run_dir: Path) -> pd.DataFrame:
    """Rebuild trials.parquet/.csv and layers.parquet from the per-trial files."""
    run_dir = Path(run_dir)
    trials = _concat(sorted(run_dir.glob(f"trials/*/{TRIAL_ROWS}")), TRIAL_NAMES)
    layers = _concat(sorted(run_dir.glob(f"trials/*/{LAYER_ROWS}")), None)
    write_frame(trials, run_dir / "trials.parquet")
    write_frame(trials, run_dir / "trials.csv")
    write_frame(layers, run_dir / "layers.parquet")
    return trials


def _concat(paths: list[Path], columns: list[str] | None) -> pd.DataFrame:
    frames = [pd.read_parquet(p) for p in paths]
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=columns or [])
    frame = pd.concat(frames, ignore_index=True)
    return frame.reindex(columns=columns) if columns else frame


@dataclass
class Results:
    run_dir: Path
    trials: pd.DataFrame
    layers: pd.DataFrame
    plan: pd.DataFrame
    config: dict[str, Any]
    environment: dict[str, Any]

    def ok_trials(self) -> pd.DataFrame:
        """The successful trial rows with a `variant` column and, where the plan is known,
        `planned`: the trial's place in it (device count, rate, impairment variant, method)."""
        ok = self.trials[self.trials["status"] == "ok"].copy()
        ok["variant"] = variant(ok)
        if "trial_id" in ok and "trial_id" in self.plan:
            planned = dict.fromkeys(self.plan["trial_id"])
            ok["planned"] = ok["trial_id"].map({trial: at for at, trial in enumerate(planned)})
        return ok

    def summary(self) -> pd.DataFrame:
        """Per trial the median over repetitions of each latency and rate, a repetition's
        devices averaged first (the effective latency: its slowest device's, as the printed
        answer has it), with 95% intervals (`testbed.results.stats.summarize`: n, v,
        v_low, v_high, level; successful rows only), over impaired links the 95th and 99th
        percentiles of the slowest device's effective latency, and the top-1 accuracy (device
        0's correct predictions) where the inputs had labels. A trial is a method variant
        (method, params) on a device count at a rate, under one impairment variant
        (`impairments`: its devices' netem words) and one fleet variant (`fleet`,
        `partition`): each is a column where the run has it, and no two trials share a row."""
        ok = self.trials[self.trials["status"] == "ok"]
        described = ["method", "params", "devices", "bandwidth_mbit"]
        described += [c for c in ("impairments", "medium", "fleet", "partition") if c in ok]
        keys = ["trial_id"]
        values = [
            "compute_ms",
            "comm_ms",
            "wire_comm_ms",
            "analytic_comm_ms",
            "wait_ms",
            "wait_peer_ms",
            "wait_link_ms",
            "wait_wakeup_ms",
            "effective_ms",
            "measured_mbit",
        ]
        table = stats.summarize(ok, keys, values).set_index(keys)
        slowest = stats.summarize(ok, keys, ["effective_ms"], "max").set_index(keys)
        effective = ["effective_ms", "effective_ms_low", "effective_ms_high"]
        table[effective] = slowest[effective]  # the answer's: the slowest device's
        if "impairments" in ok and ok["impairments"].fillna("").astype(str).str.len().any():
            tail = stats.tails(ok, keys, "effective_ms").set_index(keys)
            table = table.join(tail)  # the slowest device's, per repetition
        labelled = ok[(ok["rank"] == 0) & ok["correct"].notna()]
        if len(labelled):
            sums = labelled.groupby(keys, dropna=False)[["correct", "batch"]].sum()
            table["accuracy"] = sums["correct"] / sums["batch"]
        if "impairments" in ok:  # the trial's, as the answer words them
            ok = ok.assign(impairments=trial_impairments(ok))
        trials = ok.drop_duplicates("trial_id").set_index("trial_id")[described]
        table = trials.join(table).reset_index()
        return table.sort_values([*described[:4], "trial_id"], ignore_index=True)


def load(run_dir: str | Path) -> Results:
    """The DataFrames and metadata of a run directory."""
    run_dir = Path(run_dir)
    if not (run_dir / "trials.parquet").is_file():
        raise TestbedError(f"{run_dir} is not a run directory (no trials.parquet)")
    plan_path = run_dir / "plan.csv"
    return Results(
        run_dir=run_dir,
        trials=pd.read_parquet(run_dir / "trials.parquet"),
        layers=pd.read_parquet(run_dir / "layers.parquet"),
        plan=pd.read_csv(plan_path) if plan_path.is_file() else pd.DataFrame(),
        config=yaml.safe_load((run_dir / "config.yaml").read_text()),
        environment=json.loads((run_dir / "environment.json").read_text()),
    )
