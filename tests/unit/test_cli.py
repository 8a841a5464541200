"""`python -m testbed.run` without devices: dry runs and bad input (exit status 2)."""

import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "testbed.run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dry_run_prints_and_writes_the_plan_and_starts_nothing(tmp_path):
    done = run("experiments/smoke.yaml", "--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "smoke").iterdir()
    plan = pd.read_csv(run_dir / "plan.csv")
    assert len(plan) == 2 * 2 * 6  # bandwidths x ranks x method variants
    assert {"trial_id", "rank", "payload_bits_per_layer", "analytic_comm_ms"} <= set(plan.columns)
    row = plan[(plan.trial_id == "p2-trace-b-K64-levelk4-10mbit") & (plan["rank"] == 0)].iloc[0]
    assert row.payload_bits_per_layer == 9 * 2 + 8  # 9 tokens x 2 bits + header
    assert "p2-voltage-2mbit" in done.stdout
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "plan.csv"]


def test_bad_experiment_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmethods: [{name: trace-b, K: 1024, levle_k: 32}]\n")
    done = run(str(bad), "--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"testbed.run: {bad}: methods[0].levle_k: method 'trace-b': unknown parameter "
        "'levle_k' (did you mean 'level_k'?); accepts K, level_k, level_min_k, buffers, dedup, "
        "placement, search_beam"
    )
    assert not (tmp_path / "x").exists()


def test_missing_file_and_usage_errors():
    done = run("experiments/nope.yaml")
    assert done.returncode == 2 and "experiment file not found" in done.stderr
    done = run()
    assert done.returncode == 2 and "give an experiment file, or --resume" in done.stderr
