"""Virtual time, side by side: does a device's time stay its own (docs/devices.md, Virtual time)?

Each study runs real experiments (`python -m testbed.run`, ViT-B/16, the serial emulator, the
local backend: network namespaces and cgroups on this host) and prints ratios measured in the
same invocation, the variants interleaved round by round:

- `invariance`: P = 2, both devices at speed 0.4, every method, 2 and 10 Mbit/s, at d = 1, 2
  and 4: each method's median effective, compute and comm at d over d = 1 (the bar: within
  5%);
- `robustness`: P = 3, device 2 at half its peers' speed, d = auto, run quiet and beside one
  spinning process (auto sees it: a larger d): every device's median block, per method, and
  each method's effective, busy over quiet (the bars: 3% and 5%);
- `peers`: device 0 at speed 0.4 beside peers at 0.4, 0.2 and 0.8 (a fleet variant each),
  d = auto, twice: its median block per method in each, over the first, and its block's
  p95 / median (the bars: 3% and 1.3);
- `loss`: what is not dilated, TCP's timers: Astra and Trace-b over 2% loss, d = 1 and 4,
  their effective's p50 and p99 (not run by default: it is a measurement, not a bar).

Usage: python -m bench.bench_dilation [invariance|robustness|peers|loss ...] [--rounds N]
       [--quick] (10 Mbit/s, Voltage and Trace-b only) [--keep DIR] (the runs' folders)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import yaml

METHODS = [
    {"name": "voltage"},
    {"name": "prism", "segment": 10},
    {"name": "astra", "K": 1024},
    {"name": "trace-nb", "K": 1024},
    {"name": "trace-b", "K": 1024, "level_k": 32},
]
QUICK_METHODS = [METHODS[0], METHODS[4]]


def experiment(name: str, devices: dict, rates: list[float], methods: list, dilation) -> dict:
    return {
        "name": name,
        "model": {"name": "vit-b16"},
        "backend": "local",
        "devices": {"cpus": 1, "memory_mb": 3072, **devices},
        "link": {"profile": "ideal", "emulator": "serial", "bandwidth_mbit": rates},
        "methods": methods,
        "bundle": {"calibration_inputs": 8},
        "repeats": 5,
        "warmup": 1,
        "timeout_s": 900,
        "dilation": dilation,
    }


@contextlib.contextmanager
def spinning(busy: bool) -> Iterator[None]:
    """One process that spins on the host's CPU while the block runs (busy), or none."""
    spinner = None
    if busy:
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def run(config: dict, folder: Path, busy: bool = False) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The experiment's trials and layers."""
    path = folder / f"{config['name']}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    out = folder / "out"
    with spinning(busy):
        done = subprocess.run(
            [sys.executable, "-m", "testbed.run", str(path), "--out", str(out), "-q"],
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        raise SystemExit(f"{config['name']}: {done.stderr.strip() or done.stdout[-500:]}")
    run_dir = max((out / config["name"]).iterdir())
    return pd.read_parquet(run_dir / "trials.parquet"), pd.read_parquet(run_dir / "layers.parquet")


def per_method(trials: pd.DataFrame) -> pd.DataFrame:
    """Per (rate, method): the median over repetitions of the slowest device's effective, and
    the medians of the devices' compute and comm."""
    ok = trials[trials["status"] == "ok"]
    keys = ["bandwidth_mbit", "method", "repeat"]
    slowest = ok.groupby(keys).agg(
        effective_ms=("effective_ms", "max"),
        compute_ms=("compute_ms", "mean"),
        comm_ms=("comm_ms", "mean"),
        wire_comm_ms=("wire_comm_ms", "mean"),
    )
    return slowest.groupby(["bandwidth_mbit", "method"]).median()


def ratio_table(frames: dict[str, pd.DataFrame], base: str) -> str:
    lines = []
    columns = ["effective_ms", "compute_ms", "comm_ms"]
    head = f"{'rate':>5} {'method':10}" + "".join(f"{base + ' ' + c:>24}" for c in columns)
    lines.append(head + "".join(f"{name + '/' + base:>19}" for name in frames if name != base))
    reference = frames[base]
    worst = 0.0
    for (rate, method), row in reference.iterrows():
        cells = "".join(f"{row[c]:>24.1f}" for c in columns)
        for name, frame in frames.items():
            if name == base:
                continue
            ratios = [frame.loc[(rate, method), c] / row[c] for c in columns]
            worst = max(worst, *(abs(r - 1) for r in ratios))
            cells += f"{'/'.join(f'{r:.3f}' for r in ratios):>19}"
        lines.append(f"{rate:>5g} {method:10}{cells}")
    lines.append(f"worst ratio off 1: {100 * worst:.1f}% (effective/compute/comm in each cell)")
    return "\n".join(lines)


def invariance(folder: Path, rounds: int, quick: bool) -> None:
    rates, methods = ([10], QUICK_METHODS) if quick else ([2, 10], METHODS)
    runs: dict[str, list[pd.DataFrame]] = {}
    for _ in range(rounds):
        for d in (1, 2, 4):
            config = experiment(f"invariance-d{d}", {"count": [2], "speed": 0.4}, rates, methods, d)
            runs.setdefault(f"d={d}", []).append(run(config, folder)[0])
    frames = {name: per_method(pd.concat(parts)) for name, parts in runs.items()}
    print("invariance: P=2, speeds 0.4, 0.4; medians, and each d over d = 1")
    print(ratio_table(frames, "d=1"))
    print(beyond_the_wire(frames))


def beyond_the_wire(frames: dict[str, pd.DataFrame]) -> str:
    """Each method's comm beyond its wire time (comm - wire_comm), per d, and that times d: the
    host's own per-message work (system calls, the emulator's frames, wake-ups) is not dilated,
    so where it is constant in host time, residual x d stays put while the residual shrinks."""
    lines = ["comm beyond the wire (ms), per d; x d over d = 1's in brackets (1: the host's time)"]
    residuals = {name: frame["comm_ms"] - frame["wire_comm_ms"] for name, frame in frames.items()}
    base = next(iter(residuals.values()))
    for key in base.index:
        cells = []
        for name, residual_of in residuals.items():
            d = float(name.removeprefix("d="))
            residual = residual_of[key]
            cells.append(f"{name} {residual:8.2f} ({residual * d / base[key]:5.2f})")
        lines.append(f"{key[0]:>5g} {key[1]:10} " + "  ".join(cells))
    return "\n".join(lines)


def blocks(layers: pd.DataFrame) -> pd.Series:
    """Per method and device: its measured blocks' compute (ms). A method's blocks differ from
    another's (Trace-b's attend to buffers, Voltage's to every token), so a median over both
    falls between them and jumps with how many of each it holds."""
    return layers[layers["repeat"] >= 0].groupby(["method", "rank"])["compute_ms"].apply(list)


def robustness(folder: Path, rounds: int, quick: bool) -> None:
    methods = QUICK_METHODS if quick else METHODS
    fleet = {"count": [3], "speed": {0: 0.5, 1: 0.5, 2: 0.25}}
    trials, layers = {}, {}
    for _ in range(rounds):
        for busy in (False, True):
            name = "busy" if busy else "quiet"
            t, lay = run(experiment(f"robust-{name}", fleet, [10], methods, "auto"), folder, busy)
            trials.setdefault(name, []).append(t)
            layers.setdefault(name, []).append(lay)
    frames = {name: per_method(pd.concat(parts)) for name, parts in trials.items()}
    picked = {name: pd.concat(parts)["dilation"].iloc[0] for name, parts in trials.items()}
    print(
        f"robustness: P=3, speeds 0.5, 0.5, 0.25, d = auto (quiet {picked['quiet']:g}, busy "
        f"{picked['busy']:g}); busy over quiet"
    )
    print(ratio_table(frames, "quiet"))
    quiet, busy = (blocks(pd.concat(layers[n])) for n in ("quiet", "busy"))
    for (method, rank), values in quiet.items():
        q, b = statistics.median(values), statistics.median(busy[(method, rank)])
        print(
            f"  {method:9} device {rank}: median block {q:.2f} ms quiet, {b:.2f} busy ({b / q:.3f})"
        )


def peers(folder: Path, rounds: int, quick: bool) -> None:
    methods = QUICK_METHODS if quick else [METHODS[4]]
    speeds = (0.4, 0.2, 0.8)
    samples: dict[tuple[str, float, int], list[float]] = {}
    for attempt in range(2 * rounds):
        for peer in speeds:
            fleet = {"count": [3], "speed": {0: 0.4, 1: peer, 2: peer}}
            config = experiment(f"peers-{peer:g}", fleet, [10], methods, "auto")
            for (method, rank), values in blocks(run(config, folder)[1]).items():
                if rank == 0:
                    samples[(method, peer, attempt)] = values
    print("peers: device 0 at speed 0.4, P=3, d = auto; its median block, over the first run's")
    for (method, peer, attempt), values in sorted(samples.items()):
        median = statistics.median(values)
        base = statistics.median(samples[(method, speeds[0], 0)])
        p95 = sorted(values)[int(0.95 * (len(values) - 1))]
        print(
            f"  {method:9} peers at {peer:g}, run {attempt}: median {median:.2f} ms "
            f"({median / base:.3f}), p95/median {p95 / median:.3f}"
        )


def loss(folder: Path, rounds: int, quick: bool) -> None:
    """What virtual time does not dilate: TCP's timers. 2% loss at 10 Mbit/s (5 ms delay),
    d = 1 against d = 4: a retransmission's wait is the host's, so at d = 4 it reads 4 times
    shorter, and the tail with it."""
    methods = [METHODS[2], METHODS[4]]
    link = {"delay_ms": 5, "loss_pct": 2}
    trials: dict[str, list[pd.DataFrame]] = {}
    for _ in range(rounds):
        for d in (1, 4):
            config = experiment(f"loss-d{d}", {"count": [2], "speed": 0.4}, [10], methods, d)
            config["link"]["impairments"] = [link]
            config["repeats"] = 8 if quick else 30
            trials.setdefault(f"d={d}", []).append(run(config, folder)[0])
    print("loss: P=2, speeds 0.4, 0.4, 10 Mbit/s, 5 ms, 2% loss; the slowest device's effective")
    print(f"{'d':>5} {'method':10} {'p50 ms':>9} {'p99 ms':>9} {'p99/p50':>8} {'resent':>7}")
    for name, parts in trials.items():
        ok = pd.concat(parts)
        ok = ok[ok["status"] == "ok"]
        for method, rows in ok.groupby("method"):
            slowest = rows.groupby(["repeat", "trial_id"])["effective_ms"].max()
            p50, p99 = slowest.quantile(0.5), slowest.quantile(0.99)
            resent = rows["tcp_retransmits"].sum()
            print(f"{name:>5} {method:10} {p50:>9.1f} {p99:>9.1f} {p99 / p50:>8.2f} {resent:>7g}")


STUDIES = {"invariance": invariance, "robustness": robustness, "peers": peers, "loss": loss}
BARS = ["invariance", "robustness", "peers"]  # the default: the studies with a bar


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_dilation", description=__doc__)
    parser.add_argument("studies", nargs="*", default=BARS, choices=list(STUDIES))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep", type=Path, help="keep the runs' folders here (default: none)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        folder = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        folder.mkdir(parents=True, exist_ok=True)
        for study in args.studies:
            STUDIES[study](folder, args.rounds, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
