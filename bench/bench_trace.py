"""`make bench`: the project's speed and measurement targets, measured side by side in one run.

Every figure is a median over repetitions with its distribution-free 95% interval
(testbed.results.stats); ratios between methods pair repetitions that ran next to each other in time
(methods are interleaved: in process round by round, on the testbed inference by inference).

1. In process (one thread, device 0 of P = 2, methods alternating): Trace-b compute /
   Voltage compute (goal <= 0.9; beside it the same at tree level 32, where the codeword
   search is nearly free, and with the beam search `search_beam` (goal <= 0.85) and how often
   it finds the exact codeword) and Astra compute / Trace-b compute (both with dedup: the
   compute part of Trace-b's speedup over Astra, the rest being Astra's communication, which
   waits) on ViT-B/16; buffers off (no dedup, the paper's full chain) / buffers + dedup (the
   default) compute (goal >= 1.5) on ViT-B/16 and ViViT-B, and on ViViT-B
   at tree level 32 too (goal >= 1.8), with the fraction of remote keys left after dedup;
   Trace-nb (its default placement, 1 A.i) / Trace-b compute beside the paper's 1.12.
   `python -m bench.bench_dedup` isolates dedup's own gain, `bench.bench_placements` every
   Table VI case.
   The beam search's accuracy cost (part `search`, bench.bench_search): Trace-b at K = 1024 on
   Fashion-MNIST's test split, beam against exact search, mean difference over the study's
   seeds and P = 2, 3 (goal >= -0.3 points; needs `make accuracy-fashion`'s results).
   The paper's Table V (part `buffers`, bench.bench_buffers): ViViT-B's device-0 compute,
   Trace-b K = 1024, without buffers (no dedup, the paper's full chain) and with (the
   default), at P = 2, 3, 4, 6, 8 and 10 in process, one thread, and the buffers' gain
   1 - with / without beside the paper's (no goal: the paper's figures are the reference).
2. On the testbed at 10 Mbit/s (per repetition the slowest device's times: an inference
   ends when its slowest device does): Trace-b effective / compute (goal <= 1.02:
   communication hidden); Trace-b's effective speedup over Astra (goal >= 1.2, the paper
   1.10) and over Voltage (the paper 27x).
3. On the testbed at 1, 2, 5, 10 and 20 Mbit/s, every method (the link emulator of the
   experiment's default, serial): measured comm / wire time (goal: between 0.8 and 1.5 once a
   fixed path cost of at most 0.3 ms per message is allowed), the bandwidth-dependent part
   [comm(1) - comm(20)] / [wire(1) - wire(20)] (goal 0.8..1.2), achieved / target rate
   (goal within 5%) and sweep wall time / sum of session times (goal <= 1.2); the path cost
   per message beyond its wire time, per method and rate (goal <= 0.08 ms, the serial
   emulator's own cost, for messages of one frame; a longer message's line also carries the
   ACKs of its peer's message, which its wire time leaves out).
4. The serial emulator under load: 8 devices each sending bulk at 20 Mbit/s to the next at
   once (bench.serial_link_check.many_ports): every port's rate within 1% (root needed).
5. A device's speed (part `speed`, bench.bench_speed): a CPU quota at several periods,
   dilation in the worker, and both, block by block at speeds 0.5 and 0.25 (docs/devices.md;
   root needed).
6. Virtual time (part `dilation`, bench.bench_dilation): the same experiment at d = 1, 2, 4;
   a fleet quiet and beside a spinning process; one device beside peers of other speeds
   (docs/devices.md, Virtual time; root needed; --quick: 10 Mbit/s, Voltage and Trace-b).

Usage: python -m bench.bench_trace [--quick] [--backend auto|docker|local] [--out DIR]
    [--only in-process buffers search latency links ports speed dilation]
`--quick` swaps in tiny models and few repetitions (a check that the bench runs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bench import bench_buffers, bench_dilation, bench_speed
from bench.bench_dedup import unique_fraction
from bench.bench_search import BEAM, sender_match_rate
from bench.bench_search import accuracy as search_accuracy_of
from bench.compute import bundle_for, compare
from testbed.backends.table import AUTO, BACKENDS, backend_names
from testbed.experiment.schema import parse_experiment
from testbed.link.wire import FULL_FRAME_BYTES
from testbed.results.stats import Interval, by_repetition, median_interval, paired_ratio_interval
from testbed.results.store import load
from testbed.sweep.runner import Runner, new_run_id
from tracevq.models import build_model

PATH_COST_MS = 0.3  # per message: what a real path adds to the wire time at most
EMULATOR_COST_MS = 0.08  # per message: the goal for the serial emulator's own cost
PORTS, PORT_RATE_MBIT = 8, 20.0  # the ports that send bulk at once, each at this rate
PORT_DELAY = {"delay_ms": 5.0}  # and once more through a delay (jitter would idle the line)
PARTS = ("in-process", "buffers", "search", "latency", "links", "ports", "speed", "dilation")
RESULTS: list[str] = []


def report(name: str, value: Interval, goal: str, ok: bool | None) -> None:
    verdict = "" if ok is None else ("  ok" if ok else "  MISSED")
    spread = f"[{value.low:.3f}, {value.high:.3f}] n={value.n}"
    line = f"{name:62} {value.median:9.3f} {spread:26} goal {goal}{verdict}"
    RESULTS.append(line)
    print(line, flush=True)


def in_process(quick: bool) -> None:
    torch.set_num_threads(1)
    vit = build_model("vit-tiny" if quick else "vit-b16")
    K = 64 if quick else 1024
    bundle = bundle_for(vit, K, 16 if quick else 8, ("astra", "trace-b", "trace-nb"))
    times = compare(
        vit,
        bundle,
        {
            "voltage": {"name": "voltage"},
            "trace-b": {"name": "trace-b", "K": K},
            "astra": {"name": "astra", "K": K},
            "trace-b buffers off": {"name": "trace-b", "K": K, "buffers": False, "dedup": False},
            "trace-nb": {"name": "trace-nb", "K": K},
            "trace-b level 32": {"name": "trace-b", "K": K, "level_k": 32},
            "trace-b beam": {"name": "trace-b", "K": K, "search_beam": BEAM},
        },
        rounds=4 if quick else 8,
    )
    show_times(vit.config.name, times)
    ratio = paired_ratio_interval(times["trace-b"], times["voltage"])
    name = f"trace-b compute / voltage compute ({vit.config.name})"
    report(name, ratio, "<= 0.9", ratio.median <= 0.9)
    # the same with a search over 32 codewords, nearly free: how much of the gap is the search
    ratio = paired_ratio_interval(times["trace-b level 32"], times["voltage"])
    name = f"trace-b level 32 compute / voltage compute ({vit.config.name})"
    report(name, ratio, "(the search's share: paper 92/92.5)", None)
    ratio = paired_ratio_interval(times["trace-b beam"], times["voltage"])
    match = sender_match_rate(vit, bundle, K, BEAM)
    name = f"trace-b beam {BEAM} compute / voltage compute ({vit.config.name})"
    report(name, ratio, f"<= 0.85; exact match {match:.3f}", ratio.median <= 0.85)
    ratio = paired_ratio_interval(times["astra"], times["trace-b"])
    name = f"astra compute / trace-b compute, both dedup ({vit.config.name})"
    report(name, ratio, "(part of the speedup over astra)", None)
    gain = paired_ratio_interval(times["trace-b buffers off"], times["trace-b"])
    name = f"buffers off / (buffers + dedup) compute ({vit.config.name})"
    report(name, gain, ">= 1.5", gain.median >= 1.5)
    ratio = paired_ratio_interval(times["trace-nb"], times["trace-b"])
    name = f"trace-nb (1 A.i) compute / trace-b compute ({vit.config.name})"
    report(name, ratio, "paper 119/106 = 1.12", None)
    vivit = build_model("vivit-tiny" if quick else "vivit-b")
    bundle = bundle_for(vivit, K, 4 if quick else 1)
    coarse = 8 if quick else 32
    times = compare(
        vivit,
        bundle,
        {
            "trace-b": {"name": "trace-b", "K": K},
            "trace-b buffers off": {"name": "trace-b", "K": K, "buffers": False, "dedup": False},
            f"level {coarse}": {"name": "trace-b", "K": K, "level_k": coarse},
            f"level {coarse} buffers off": {
                "name": "trace-b",
                "K": K,
                "level_k": coarse,
                "buffers": False,
                "dedup": False,
            },
        },
        rounds=4 if quick else 6,
    )
    show_times(vivit.config.name, times)
    for level_k, key, goal in ((K, "trace-b", 1.5), (coarse, f"level {coarse}", 1.8)):
        gain = paired_ratio_interval(times[f"{key} buffers off"], times[key])
        fraction = unique_fraction(vivit, bundle, K, level_k)
        name = f"buffers off / (buffers + dedup), level {level_k} ({vivit.config.name})"
        report(name, gain, f">= {goal}; unique-key fraction {fraction:.4f}", gain.median >= goal)


def buffers(quick: bool) -> None:
    """Table V at every device count of the paper (bench.bench_buffers); each gain a line."""
    setup, rows = bench_buffers.run(quick)
    for row in rows:
        paper_gain = bench_buffers.paper_row(row.devices)[2]
        name = f"buffers' gain 1 - with / without, P = {row.devices} ({setup.model})"
        report(name, row.gain, f"(paper {paper_gain / 100:.3f})", None)


def search_accuracy() -> None:
    """The beam search's accuracy cost on Fashion-MNIST (bench.bench_search.accuracy)."""
    difference = search_accuracy_of((BEAM,)).get(BEAM)
    if difference is None:
        return
    name = f"trace-b beam {BEAM} - exact top-1 points (fashion, K 1024, P 2 3)"
    report(name, difference, ">= -0.3", difference.median >= -0.3)


def show_times(model: str, times: dict[str, pd.Series]) -> None:
    cells = [f"{k} {median_interval(v).median:.1f}" for k, v in times.items()]
    print(f"  device-0 compute ms ({model}): " + ", ".join(cells), flush=True)


def experiment(name: str, model: str, rates: list[float], methods: list[dict], repeats: int):
    return parse_experiment(
        {
            "name": name,
            "model": {"name": model},
            "devices": {"count": [2], "cpus": 1, "memory_mb": 3072},
            "link": {"profile": "ideal", "bandwidth_mbit": rates},
            "methods": methods,
            "repeats": repeats,
            "warmup": 1,
        }
    )


def variant(frame: pd.DataFrame) -> pd.Series:
    params = frame["params"].fillna("").str.replace(",", " ")
    return (frame["method"] + " " + params).str.strip()


def latency_at_10(quick: bool, backend: str, out: Path) -> None:
    model, K = ("vit-tiny", 64) if quick else ("vit-b16", 1024)
    methods = [{"name": "voltage"}, {"name": "astra", "K": K}, {"name": "trace-b", "K": K}]
    trials = load(
        run(experiment("bench-latency", model, [10], methods, 4 if quick else 12), backend, out)
    ).trials
    slowest = by_repetition(trials, ["method"], ["effective_ms", "compute_ms"], how="max")
    per = {m: part.set_index("repeat") for m, part in slowest.groupby("method")}
    cells = [f"{m} {median_interval(p['effective_ms']).median:.1f}" for m, p in per.items()]
    print("  at 10 Mbit/s, effective ms (slowest device): " + ", ".join(cells), flush=True)
    trace, astra, voltage = per["trace-b"], per["astra"], per["voltage"]
    hidden = paired_ratio_interval(trace["effective_ms"], trace["compute_ms"])
    report("trace-b effective / compute at 10 Mbit/s", hidden, "<= 1.02", hidden.median <= 1.02)
    speedup = paired_ratio_interval(astra["effective_ms"], trace["effective_ms"])
    report(
        "trace-b speedup over astra (effective) at 10 Mbit/s",
        speedup,
        ">= 1.2 (paper 1.10)",
        speedup.median >= 1.2,
    )
    speedup = paired_ratio_interval(voltage["effective_ms"], trace["effective_ms"])
    report("trace-b speedup over voltage (effective) at 10 Mbit/s", speedup, "(paper 27x)", None)


def links(quick: bool, backend: str, out: Path) -> None:
    model, K = ("vit-tiny", 64) if quick else ("vit-b16", 1024)
    rates = [1.0, 2.0, 5.0, 10.0, 20.0]
    methods = [
        {"name": "voltage"},
        {"name": "prism", "segment": 10, "mean_bits": 16},
        {"name": "astra", "K": K},
        {"name": "trace-nb", "K": K},
        {"name": "trace-b", "K": K, "level_k": [K, 32, 2]},
    ]
    started = time.monotonic()
    run_dir = run(experiment("bench-links", model, rates, methods, 2 if quick else 6), backend, out)
    wall_s = time.monotonic() - started
    trials = load(run_dir).trials
    trials["variant"] = variant(trials)
    depth = int(trials["payload_bits"].iloc[0] / trials["payload_bits_per_layer"].iloc[0])
    values = ["comm_ms", "wire_comm_ms", "frame_bytes"]
    per = by_repetition(trials, ["variant", "bandwidth_mbit"], values)
    per = per.sort_values("bandwidth_mbit", kind="stable")
    for name, by_variant in per.groupby("variant", sort=False):
        for rate, part in by_variant.groupby("bandwidth_mbit"):
            comm_to_wire(name, rate, part.set_index("repeat"), depth)
    for name, part in per.groupby("variant", sort=False):
        slope(name, part, rates[0], rates[-1])
    for rate, group in trials.groupby("bandwidth_mbit"):
        achieved = median_interval(group.drop_duplicates("rank")["measured_wire_mbit"] / rate)
        report(
            f"achieved / target rate at {rate:g} Mbit/s (on the wire)",
            achieved,
            "within 0.95..1.05",
            abs(achieved.median - 1) <= 0.05,
        )
    sessions_s = trials.drop_duplicates("session_id")["session_s"].sum()
    overhead = Interval(1, wall_s / sessions_s, wall_s / sessions_s, wall_s / sessions_s, 0.0)
    report("sweep wall time / sum of session times", overhead, "<= 1.2", overhead.median <= 1.2)


def comm_to_wire(name: str, rate: float, part: pd.DataFrame, messages: int) -> None:
    """comm / wire, and what comm exceeds the wire time by per message: for a message of one
    frame the path's fixed cost (the emulator's own, goal EMULATOR_COST_MS); a message of
    many frames also shares its line with the ACKs of its peer's message, sent at the same
    time, which its wire time leaves out (printed, not judged)."""
    ratio = median_interval(part["comm_ms"] / part["wire_comm_ms"])
    path = median_interval((part["comm_ms"] - part["wire_comm_ms"]) / messages)
    allowed = min(max(path.median, 0.0), PATH_COST_MS)
    net = median_interval((part["comm_ms"] - messages * allowed) / part["wire_comm_ms"])
    ok = ratio.median >= 0.8 and net.median <= 1.5
    goal = f"0.8..1.5 less <= {PATH_COST_MS} ms/msg (excess {path.median:.3f} ms/msg)"
    report(f"comm / wire, {name} at {rate:g} Mbit/s", ratio, goal, ok)
    one_frame = part["frame_bytes"].median() / messages <= FULL_FRAME_BYTES
    report(
        f"path cost per message beyond the wire time (ms), {name} at {rate:g} Mbit/s",
        path,
        f"<= {EMULATOR_COST_MS}" if one_frame else "none: its line carries the peer's ACKs too",
        path.median <= EMULATOR_COST_MS if one_frame else None,
    )


def ports(quick: bool) -> None:
    """PORTS devices on one serial switch, each sending bulk at PORT_RATE_MBIT to the next at
    once: every port's TCP payload rate within 1% of its target, with the emulator's stalls;
    its C core (the default), its Python loop (where gcc is missing) and the C core with
    every uplink delayed, one after the other, twice, interleaved."""
    from bench.serial_link_check import many_ports

    count = 2 if quick else PORTS
    variants = [("c", None, "c core"), ("python", None, "python core")]
    variants.append(("c", PORT_DELAY, f"c core, {PORT_DELAY['delay_ms']:g} ms delay"))
    for repeat in range(1 if quick else 2):
        for core, impairments, label in variants:
            rows = many_ports(count, PORT_RATE_MBIT, 2.0 if quick else 6.0, core, impairments)
            ratios = [row["ratio"] for row in rows]
            worst = max(ratios, key=lambda ratio: abs(ratio - 1))
            spread = Interval(len(ratios), float(np.median(ratios)), min(ratios), max(ratios), 1.0)
            stalls = sum(row["stalls"] for row in rows)
            stalled_ms = sum(row["stalled_ms"] for row in rows)
            report(
                f"{count} ports at {PORT_RATE_MBIT:g} Mbit/s at once, {label} (run "
                f"{repeat + 1}): bulk / target per port (range; {stalls} stalls, "
                f"{stalled_ms:.1f} ms)",
                spread,
                "every port within 0.99..1.01",
                abs(worst - 1) <= 0.01,
            )


def slope(name: str, part: pd.DataFrame, low: float, high: float) -> None:
    """[comm(low) - comm(high)] / [wire(low) - wire(high)] with a bootstrap interval."""
    slow = part[part["bandwidth_mbit"] == low]
    fast = part[part["bandwidth_mbit"] == high]
    if slow.empty or fast.empty:
        return
    wire = slow["wire_comm_ms"].median() - fast["wire_comm_ms"].median()
    value = (slow["comm_ms"].median() - fast["comm_ms"].median()) / wire
    draws = bootstrap_difference(slow["comm_ms"].to_numpy(), fast["comm_ms"].to_numpy()) / wire
    low_q, high_q = np.quantile(draws, [0.025, 0.975])
    interval = Interval(min(len(slow), len(fast)), value, float(low_q), float(high_q), 0.95)
    report(f"bandwidth-dependent comm / wire, {name}", interval, "0.8..1.2", 0.8 <= value <= 1.2)


def bootstrap_difference(a: np.ndarray, b: np.ndarray, draws: int = 4000) -> np.ndarray:
    """Medians of resampled `a` minus medians of resampled `b` (independent runs)."""
    generator = np.random.default_rng(0)
    pick_a = generator.choice(a, size=(draws, len(a)))
    pick_b = generator.choice(b, size=(draws, len(b)))
    return np.median(pick_a, axis=1) - np.median(pick_b, axis=1)


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
    on_this_host = [n for n in backend_names() if n == AUTO or BACKENDS[n].on_this_host]
    parser.add_argument("--backend", default=AUTO, choices=on_this_host)
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--only", choices=PARTS, nargs="+", default=PARTS, help="these parts")
    args = parser.parse_args(argv)
    if "in-process" in args.only:
        in_process(args.quick)
    if "buffers" in args.only:
        buffers(args.quick)
    if "search" in args.only and not args.quick:
        search_accuracy()
    if "latency" in args.only:
        latency_at_10(args.quick, args.backend, args.out)
    if "links" in args.only:
        links(args.quick, args.backend, args.out)
    if "ports" in args.only:
        ports(args.quick)
    if "speed" in args.only:  # its own table: a quota, dilation or both, block by block
        bench_speed.main(["--quick"] if args.quick else [])
    if "dilation" in args.only:  # virtual time: invariance in d, quiet against busy, peers
        bench_dilation.main(["--quick"] if args.quick else [])
    print("\nsummary (median [95% interval] n)\n" + "\n".join(RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
