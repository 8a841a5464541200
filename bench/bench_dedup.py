"""dedup's own gain: Trace-b with buffers, with and without attention over distinct codewords.

In process, one thread, device 0 of P = 2 (bench.compute: all devices in lockstep, only device
0 timed), the variants alternating round by round so that background load falls on all alike.
Prints, per level, device-0 compute with buffers only and with buffers + dedup (median and
95% interval), their paired ratio, and the unique-key fraction: distinct remote codewords
attended / remote tokens, over the blocks of one inference.

Usage: python -m bench.bench_dedup [--quick] [--rounds N] [--levels 1024 32]
`--quick` uses ViViT-tiny and K = 64 (a check that the script runs).
"""

from __future__ import annotations

import argparse

import torch

from bench.compute import bundle_for, compare, device0_compute_ms, measured_input
from testbed.results.stats import median_interval, paired_ratio_interval
from tracevq.methods import make_method
from tracevq.models import build_model
from tracevq.partition import partition_sizes

DEVICES = 2


def unique_fraction(model, bundle, K: int, level_k: int) -> float:
    """Distinct remote keys / remote tokens on device 0, over every block of one inference."""
    method = make_method("trace-b", model, bundle, K=K, level_k=level_k)
    inputs = measured_input(model)
    counts: list[int] = []
    device0_compute_ms(method, inputs, DEVICES, unique_keys=counts)
    remote_tokens = sum(partition_sizes(model.config.tokens, DEVICES)[1:])
    return sum(counts) / (len(counts) * remote_tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--levels", type=int, nargs="+", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = build_model("vivit-tiny" if args.quick else "vivit-b")
    K = 64 if args.quick else 1024
    levels = args.levels or ([K, 8] if args.quick else [K, 32])
    bundle = bundle_for(model, K, 4 if args.quick else 1)
    variants = {}
    for level_k in levels:
        base = {"name": "trace-b", "K": K, "level_k": level_k}
        variants[f"level {level_k} buffers"] = {**base, "dedup": False}
        variants[f"level {level_k} buffers+dedup"] = base
    times = compare(model, bundle, variants, DEVICES, rounds=args.rounds)
    print(
        f"{model.config.name}, P = {DEVICES}, trace-b K = {K}, device-0 compute ms, "
        f"{args.rounds} rounds interleaved"
    )
    for level_k in levels:
        plain = times[f"level {level_k} buffers"]
        dedup = times[f"level {level_k} buffers+dedup"]
        a, b = median_interval(plain), median_interval(dedup)
        gain = paired_ratio_interval(plain, dedup)
        fraction = unique_fraction(model, bundle, K, level_k)
        print(
            f"  level {level_k:5}: buffers {a.median:8.1f} [{a.low:.1f}, {a.high:.1f}]"
            f"  buffers+dedup {b.median:8.1f} [{b.low:.1f}, {b.high:.1f}]"
            f"  ratio {gain.median:.3f} [{gain.low:.3f}, {gain.high:.3f}]"
            f"  unique-key fraction {fraction:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
