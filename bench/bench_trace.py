"""`make bench`: the project's speed targets, measured side by side in one run on this machine.

1. In process (one thread, device 0 of P = 2, methods alternating, medians):
   Trace-b compute / Voltage compute (goal <= 1.0) on ViT-B/16; buffers off / on compute
   (goal >= 1.5) on ViT-B/16 and ViViT-B.
2. On the testbed (real devices, shaped links), per repetition the slowest device's times,
   medians over 5 repetitions:
   Trace-b effective / compute at 10 Mbit/s (goal <= 1.02: communication hidden); Trace-b's
   effective speedup over Astra (goal >= 1.15, the paper 1.10) and over Voltage (the paper
   27x) at 10 Mbit/s; achieved / target rate at 1, 2, 5, 10 and 20 Mbit/s (goal within 5%);
   sweep wall time / sum of trial times (goal <= 1.2).

Usage: python -m bench.bench_trace [--quick] [--backend auto|docker|local] [--out DIR]
`--quick` swaps in tiny models (a check that the bench runs, not a measurement).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.compute import bundle_for, compare
from testbed.results import load
from testbed.runner import Runner, new_run_id
from testbed.schema import parse_experiment
from tracevq.models import build_model

RESULTS = []


def report(name: str, value: float, goal: str, ok: bool | None) -> None:
    verdict = "" if ok is None else ("  ok" if ok else "  MISSED")
    line = f"{name:58} {value:10.3f}   goal {goal}{verdict}"
    RESULTS.append(line)
    print(line, flush=True)


def in_process(quick: bool) -> None:
    torch.set_num_threads(1)
    vit = build_model("vit-tiny" if quick else "vit-b16")
    K = 64 if quick else 1024
    bundle = bundle_for(vit, K, 16 if quick else 8)
    times = compare(vit, bundle, {
        "voltage": {"name": "voltage"},
        "trace-b": {"name": "trace-b", "K": K},
        "trace-b buffers off": {"name": "trace-b", "K": K, "buffers": False},
    })  # fmt: skip
    print(
        f"  device-0 compute ms ({vit.config.name}): "
        + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
    )
    ratio = times["trace-b"] / times["voltage"]
    report(f"trace-b compute / voltage compute ({vit.config.name})", ratio, "<= 1.0", ratio <= 1.0)
    gain = times["trace-b buffers off"] / times["trace-b"]
    report(f"buffers off / on compute ({vit.config.name})", gain, ">= 1.5", gain >= 1.5)
    vivit = build_model("vivit-tiny" if quick else "vivit-b")
    bundle = bundle_for(vivit, K, 4 if quick else 1)
    times = compare(vivit, bundle, {
        "trace-b": {"name": "trace-b", "K": K},
        "trace-b buffers off": {"name": "trace-b", "K": K, "buffers": False},
    }, rounds=2 if not quick else 5)  # fmt: skip
    print(
        f"  device-0 compute ms ({vivit.config.name}): "
        + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
    )
    gain = times["trace-b buffers off"] / times["trace-b"]
    report(f"buffers off / on compute ({vivit.config.name})", gain, ">= 1.5", gain >= 1.5)


def on_testbed(quick: bool, backend: str, out: Path) -> None:
    model, K = ("vit-tiny", 64) if quick else ("vit-b16", 1024)
    latency = parse_experiment({
        "name": "bench-latency", "model": {"name": model},
        "devices": {"count": [2], "cpus": 1, "memory_mb": 3072},
        "link": {"profile": "ideal", "bandwidth_mbit": [10]},
        "methods": [{"name": "voltage"}, {"name": "astra", "K": K}, {"name": "trace-b", "K": K}],
        "repeats": 5, "warmup": 1,
    })  # fmt: skip
    run_dir = run(latency, backend, out)
    trials = load(run_dir).trials
    ok = trials[trials["status"] == "ok"]
    # an inference ends when its slowest device does: per repetition, the largest effective
    # time against the largest compute time (a device that waits for a slower peer's
    # computing is not waiting for the link); the median over repetitions, so that one
    # hiccup of this shared machine does not decide a ratio
    slowest = ok.groupby(["method", "repeat"])[["effective_ms", "compute_ms"]].max()
    effective = slowest["effective_ms"].groupby("method").median()
    compute = slowest["compute_ms"].groupby("method").median()
    print(
        "  at 10 Mbit/s, effective ms: " + ", ".join(f"{k} {v:.1f}" for k, v in effective.items())
    )
    hidden = effective["trace-b"] / compute["trace-b"]
    report("trace-b effective / compute at 10 Mbit/s", hidden, "<= 1.02", hidden <= 1.02)
    speedup = effective["astra"] / effective["trace-b"]
    report(
        "trace-b speedup over astra (effective) at 10 Mbit/s",
        speedup,
        ">= 1.15 (paper 1.10)",
        speedup >= 1.15,
    )
    speedup = effective["voltage"] / effective["trace-b"]
    report("trace-b speedup over voltage (effective) at 10 Mbit/s", speedup, "(paper 27x)", None)

    links = parse_experiment({
        "name": "bench-links", "model": {"name": model},
        "devices": {"count": [2], "cpus": 1, "memory_mb": 3072},
        "link": {"profile": "ideal", "bandwidth_mbit": [1, 2, 5, 10, 20]},
        "methods": [{"name": "trace-b", "K": K, "level_k": 2}],
        "repeats": 3, "warmup": 1,
    })  # fmt: skip
    started = time.monotonic()
    run_dir = run(links, backend, out)
    wall_s = time.monotonic() - started
    trials = load(run_dir).trials
    for rate, group in trials.groupby("bandwidth_mbit"):
        achieved = (group["measured_wire_mbit"] / rate).mean()
        report(
            f"achieved / target rate at {rate:g} Mbit/s (on the wire)",
            achieved,
            "within 0.95..1.05",
            abs(achieved - 1) <= 0.05,
        )
    trial_s = trials.drop_duplicates("trial_id")["trial_s"].sum()
    overhead = wall_s / trial_s
    report("sweep wall time / sum of trial times", overhead, "<= 1.2", overhead <= 1.2)


def run(experiment, backend: str, out: Path) -> Path:
    run_id = new_run_id()
    run_dir = (out / experiment.name / run_id).resolve()
    outcome = Runner(experiment, run_dir, backend, run_id).run()
    if outcome.failed:
        raise SystemExit(f"bench: {outcome.failed} trials failed: {outcome.failures}")
    return run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", default="auto", choices=("auto", "docker", "local"))
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    args = parser.parse_args(argv)
    in_process(args.quick)
    on_testbed(args.quick, args.backend, args.out)
    print("\nsummary\n" + "\n".join(RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
