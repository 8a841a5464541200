"""Compute of each Trace placement (the paper's Table VI cases), side by side.

In process, one thread, device 0 of P = 2 (bench.compute: all devices in lockstep, only device
0 timed, its block-0 embedding of the peer's patches included where the placement needs it),
the variants alternating round by round so that background load falls on all alike. Prints,
per variant, device-0 compute (median and 95% interval over rounds) and its paired ratio to
Trace-b (2 B) and to Astra, both without dedup as in the paper, with the paper's Table IV
ratios beside them; then the time of
embedding the peer's patches alone (what the exact-embedding cases add).

Usage: python -m bench.bench_placements [--quick] [--rounds N] [--flops]
`--quick` uses ViT-tiny and K = 64 (a check that the script runs). `--flops` counts device 0's
floating-point operations instead of timing them (torch's FlopCounterMode: matmuls and
attention), once per variant: the same ratios without the machine's load.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.compute import bundle_for, compare, device0_flops, measured_input
from testbed.results.stats import median_interval, paired_ratio_interval
from tracevq.methods import make_method
from tracevq.models import build_model
from tracevq.partition import partition_ranges

DEVICES = 2
# Table IV (ViT-B/16, P = 2, K = 1024), compute ms
PAPER = {"voltage": 92.5, "astra": 115.0, "trace-nb": 119.0, "trace-b": 106.0}


def variants(K: int) -> dict[str, dict]:
    """Label -> make_method kwargs; dedup at its default (on wherever it is exact), and off
    for Astra and Trace-b as in the paper, whose methods have none."""
    nb = {"name": "trace-nb", "K": K}
    return {
        "voltage": {"name": "voltage"},
        "astra": {"name": "astra", "K": K},
        "astra nodedup": {"name": "astra", "K": K, "dedup": False},
        "trace-b 2 B": {"name": "trace-b", "K": K},
        "trace-b 2 B nodedup": {"name": "trace-b", "K": K, "dedup": False},
        "trace-b 2 A": {"name": "trace-b", "K": K, "placement": "2 A"},
        "trace-nb 1 A.i": {**nb, "placement": "1 A.i"},
        "trace-nb 1 A.ii": {**nb, "placement": "1 A.ii"},
        "trace-nb 1 A.iii": {**nb, "placement": "1 A.iii"},
        "trace-nb 1 B": {**nb, "placement": "1 B"},
        "trace-nb 1 B +ffn": {**nb, "placement": "1 B", "remote_ffn": True},
    }


def paper_ratio(label: str, base: str) -> str:
    name, other = label.split()[0], base.split()[0]
    default = label in ("voltage", "astra nodedup", "trace-b 2 B nodedup", "trace-nb 1 A.i")
    if not default or name not in PAPER or name == other:
        return ""
    return f" (paper {PAPER[name] / PAPER[other]:.2f})"


@torch.no_grad()
def embedding_ms(model, rounds: int = 50) -> float:
    """Median time to embed the peer's patches of P = 2 (device 0's extra work at block 0)."""
    inputs = measured_input(model)
    start, stop = partition_ranges(model.config.tokens, DEVICES)[1]
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        model.embed(inputs, start, stop)
        times.append(1000 * (time.perf_counter() - began))
    return median_interval(times).median


def count_flops(model, bundle, K: int) -> None:
    """Device-0 GFLOP per variant and their ratios (deterministic: one run each)."""
    inputs = measured_input(model)
    flops = {
        label: device0_flops(make_method(model=model, bundle=bundle, **kw), inputs, DEVICES)
        for label, kw in variants(K).items()
    }
    print(
        f"{model.config.name}, P = {DEVICES}, K = {K}, device-0 GFLOP counted "
        "(matmuls and attention), ratios to trace-b and astra without dedup"
    )
    for label, count in flops.items():
        cells = [f"  {label:20} {count / 1e9:8.3f}"]
        for base in ("trace-b 2 B nodedup", "astra nodedup"):
            ratio = count / flops[base]
            cells.append(f"/ {base.split()[0]} {ratio:.3f}{paper_ratio(label, base)}")
        print("  ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--flops", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = build_model("vit-tiny" if args.quick else "vit-b16")
    K = 64 if args.quick else 1024
    bundle = bundle_for(model, K, 8, families=("astra", "trace-b", "trace-nb"))
    if args.flops:
        count_flops(model, bundle, K)
        return
    times = compare(model, bundle, variants(K), DEVICES, rounds=args.rounds)
    print(
        f"{model.config.name}, P = {DEVICES}, K = {K}, device-0 compute ms, one thread, "
        f"{args.rounds} rounds interleaved; ratios paired by round [95% interval], "
        "to trace-b and astra without dedup"
    )
    for label, series in times.items():
        spread = median_interval(series)
        cells = [f"  {label:20} {spread.median:8.1f} [{spread.low:.1f}, {spread.high:.1f}]"]
        for base in ("trace-b 2 B nodedup", "astra nodedup"):
            ratio = paired_ratio_interval(series, times[base])
            interval = f"{ratio.median:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]"
            cells.append(f"/ {base.split()[0]} {interval}{paper_ratio(label, base)}")
        print("  ".join(cells), flush=True)
    start, stop = partition_ranges(model.config.tokens, DEVICES)[1]
    config = model.config
    flops = 2 * (stop - start) * config.patch_dim * config.dim
    print(
        f"  embedding the peer's {stop - start} patches: {embedding_ms(model):.2f} ms, "
        f"{flops / 1e6:.1f} MFLOP (2 x tokens x patch_dim x D)"
    )


if __name__ == "__main__":
    main()
