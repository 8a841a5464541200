"""Codebooks for a model without training: k-means on its activations over seeded random
inputs, in one call and from the command line.

    python -m tracevq.fit vit-tiny --K 16 --out bundle-K16.pt [--calibration-inputs 8]

The testbed fits (and caches) its bundles through `fit_random_calibration`; the compose demo
runs this command before its devices start. Exit 2 for bad input, with one line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from tracevq.bundle import Bundle, FitSettings, fit_bundle
from tracevq.checkpoint import load_checkpoint
from tracevq.errors import TraceError
from tracevq.method_table import codebook_methods
from tracevq.models import build_model


def fit_random_calibration(
    model_name: str,
    settings: FitSettings,
    *,
    model_seed: int = 0,
    checkpoint: str | Path | None = None,
    checkpoint_ema: bool = False,
    calibration_inputs: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> Bundle:
    """The bundle of `model_name` (seeded weights, or the checkpoint's) fitted with `settings`
    on `calibration_inputs` standard-normal inputs drawn with the settings' seed."""
    model = build_model(model_name, seed=model_seed)
    if checkpoint:
        load_checkpoint(model, checkpoint, ema=checkpoint_ema)
    generator = torch.Generator().manual_seed(settings.seed)
    calibration = torch.randn(model.config.input_shape(calibration_inputs), generator=generator)
    return fit_bundle(model, calibration, settings, progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tracevq.fit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", help="model configuration name, e.g. vit-tiny")
    parser.add_argument("--K", type=int, required=True, help="codebook size")
    parser.add_argument("--out", type=Path, required=True, help="bundle file to write")
    families = codebook_methods()
    parser.add_argument("--families", nargs="+", default=families, choices=families)
    parser.add_argument("--calibration-inputs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        settings = FitSettings(args.K, tuple(args.families), seed=args.seed)
        bundle = fit_random_calibration(
            args.model, settings, calibration_inputs=args.calibration_inputs
        )
        bundle.save(args.out)
    except (TraceError, ValueError) as error:
        print(f"tracevq.fit: {error}", file=sys.stderr)
        return 2
    print(f"{args.out}: {args.model} K={args.K} ({', '.join(args.families)}), {bundle.fingerprint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
