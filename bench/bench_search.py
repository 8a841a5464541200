"""The sender's codeword search: exact against a beam over grouped codewords (`search_beam`).

1. Compute (`compute`): in process, one thread, device 0 of P = 2 on ViT-B/16 at K = 1024
   (bench.compute, methods alternating round by round): Trace-b / Voltage with the exact search,
   with each beam, and at tree level 32 (a search over 32 codewords, nearly free), and how
   often each beam returns the exact nearest codeword on the rows the sender encodes.
2. Accuracy (`accuracy`): the trained Fashion-MNIST model and Trace-b's fine-tuned K = 1024
   codebooks of `make accuracy-fashion` (results/accuracy/fashion/seed*/K1024/trace-b-ema),
   the 10,000 test images through `tracevq.simulate` at P = 2 and 3, exact search against each
   beam: top-1 of both, their paired difference with its 95% interval (the same images, so
   only the images on which the two disagree count), and the beam's exact-match rate.

Usage: python -m bench.bench_search [--quick] [--beams 1 2 4] [--only compute accuracy]
`--quick` swaps in ViT-tiny at K = 64 and skips the accuracy part.
"""

from __future__ import annotations

import argparse
import math
from functools import partial
from pathlib import Path

import numpy as np
import torch

from bench.compute import bundle_for, compare, device0_compute_ms, measured_input
from testbed.results.stats import Interval, paired_ratio_interval
from tracevq.bundle import Bundle
from tracevq.methods import make_method
from tracevq.models import build_model
from tracevq.simulation import simulate

FASHION = Path("results/accuracy/fashion")
BEAMS = (1, 2, 4)
BEAM = 2  # make bench's beam (docs/method.md, Nearest codeword)


class RecordedTree:
    """A method's codebook tree that keeps the rows it was asked to encode (each call's rows
    and level), so that the exact and the beam search can be compared on the same rows."""

    def __init__(self, tree):
        self.tree, self.calls = tree, []

    def __getattr__(self, name):
        return getattr(self.tree, name)

    def encode(self, x, m, beam=None):
        self.calls.append((x.reshape(-1, x.shape[-1]).clone(), m))
        return self.tree.encode(x, m, beam)


def record_rows(method, run, *args):
    """run(method, *args), and the (tree, rows, level) of every encode it made."""
    trees = method.trees
    method.trees = [RecordedTree(tree) for tree in trees]
    try:
        result = run(method, *args)
    finally:
        recorded, method.trees = method.trees, trees
    return result, [(r.tree, rows, level) for r in recorded for rows, level in r.calls]


def match_rate(calls, beam: int) -> float:
    """Fraction of rows whose beam search returns the exact search's codeword."""
    same = total = 0
    for tree, rows, level in calls:
        same += int((tree.encode(rows, level) == tree.encode(rows, level, beam)).sum())
        total += len(rows)
    return same / total


def sender_match_rate(model, bundle, K: int, beam: int) -> float:
    """How often the beam finds the exact codeword on the rows Trace-b's senders encode for
    bench.compute's measured input."""
    method = make_method("trace-b", model, bundle, K=K)
    _, calls = record_rows(method, device0_compute_ms, measured_input(model), 2)
    return match_rate(calls, beam)


def compute(quick: bool, beams: tuple[int, ...]) -> None:
    torch.set_num_threads(1)
    vit = build_model("vit-tiny" if quick else "vit-b16")
    K = 64 if quick else 1024
    bundle = bundle_for(vit, K, 16 if quick else 8, ("astra", "trace-b", "trace-nb"))
    variants = {"voltage": {"name": "voltage"}, "trace-b": {"name": "trace-b", "K": K}}
    for beam in beams:
        variants[f"trace-b beam {beam}"] = {"name": "trace-b", "K": K, "search_beam": beam}
    coarse = 8 if quick else 32
    variants[f"trace-b level {coarse}"] = {"name": "trace-b", "K": K, "level_k": coarse}
    times = compare(vit, bundle, variants, rounds=4 if quick else 10)
    print(f"{vit.config.name}, P = 2, K = {K}: device-0 compute / voltage's, paired by round")
    for name, params in variants.items():
        if name == "voltage":
            continue
        ratio = paired_ratio_interval(times[name], times["voltage"])
        beam = params.get("search_beam")
        match = f"  exact match {sender_match_rate(vit, bundle, K, beam):.3f}" if beam else ""
        spread = f"[{ratio.low:.3f}, {ratio.high:.3f}] n={ratio.n}"
        print(f"  {name:22} {ratio.median:.3f} {spread}{match}")


def accuracy(beams: tuple[int, ...], devices=(2, 3)) -> dict[int, Interval]:
    """Exact search against each beam on Fashion-MNIST's test split, per seed and P (printed);
    returns per beam the mean difference in points (beam - exact) over seeds and P with its
    95% interval (the evaluations taken as independent). Empty without the study's results."""
    torch.set_num_threads(2)
    jobs = sorted(FASHION.glob("seed*/K1024/trace-b-ema/bundle.pt"))
    if not jobs:
        print(f"no fine-tuned Fashion-MNIST codebooks in {FASHION}: run make accuracy-fashion")
        return {}
    test = torch.load(FASHION / "test-inputs.pt")
    images, labels = test["inputs"], test["labels"]
    print("Fashion-MNIST test split, trace-b K = 1024 fine-tuned (EMA), top-1 %")
    differences: dict[int, list[tuple[float, float]]] = {beam: [] for beam in beams}
    for bundle_path in jobs:
        model = build_model("vit-fashion")
        model.load_state_dict(torch.load(bundle_path.parent / "model.pth"))
        model.eval()
        bundle = Bundle.load(bundle_path)
        for p in devices:
            method = make_method("trace-b", model, bundle, K=1024)
            exact, calls = record_rows(method, partial(simulate, model, images), p)
            right = exact.logits.argmax(1) == labels
            for beam in beams:
                found = simulate(model, images, "trace-b", p, bundle, K=1024, search_beam=beam)
                diff, half = paired_difference(right, found.logits.argmax(1) == labels)
                differences[beam].append((diff, half))
                print(
                    f"  {bundle_path.parts[-4]} P={p} beam {beam}: exact "
                    f"{100 * right.float().mean():.2f}, difference {diff:+.2f} "
                    f"[{diff - half:+.2f}, {diff + half:+.2f}], "
                    f"exact match {match_rate(calls, beam):.3f}",
                    flush=True,
                )
    pooled = {}
    for beam, pairs in differences.items():
        mean = float(np.mean([d for d, _ in pairs]))
        half = math.sqrt(sum(h**2 for _, h in pairs)) / len(pairs)
        pooled[beam] = Interval(len(pairs), mean, mean - half, mean + half, 0.95)
    return pooled


def paired_difference(exact: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """other - exact in points of accuracy over the same images, and the half-width of its
    95% interval (only the images on which the two disagree vary it)."""
    n = len(exact)
    gained = int((other & ~exact).sum())
    lost = int((exact & ~other).sum())
    diff = (gained - lost) / n
    half = 1.96 * math.sqrt(max(gained + lost - n * diff**2, 0.0)) / n
    return 100 * diff, 100 * half


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--beams", type=int, nargs="+", default=list(BEAMS))
    parser.add_argument("--only", nargs="+", choices=("compute", "accuracy"))
    args = parser.parse_args(argv)
    parts = args.only or (["compute"] if args.quick else ["compute", "accuracy"])
    beams = tuple(args.beams)
    if "compute" in parts:
        compute(args.quick, beams)
    if "accuracy" in parts:
        for beam, difference in accuracy(beams).items():
            print(
                f"beam {beam}: mean difference {difference.median:+.2f} points "
                f"[{difference.low:+.2f}, {difference.high:+.2f}] over {difference.n} evaluations"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
