"""`python -m devices.gemm`: how fast this device computes the model's own products.

    python -m devices.gemm --model vit-b16 [--tokens 99] [--threads 1] [--seconds 1]
                           [--speed 0.5 | --control FILE] [--blocks]

One *block* is the four products of a Transformer block on `tokens` rows: Q/K/V (D x 3D),
the attention's output (D x D), the FFN's two (D x 4D, 4D x D), fp32, with torch's threads
as given: 2 n (3 + 1 + 4 + 4) D^2 floating-point operations at mlp_ratio 4. The probe runs
blocks for `seconds` after a warm-up and prints one JSON line: the rate (GFLOP/s, 10^9 per
second) and the median block time; `--blocks` adds every block's time. Each block is one
stretch of compute at the device's speed (devices.pace), as the worker's blocks are, so the
probe measures the rate a device of that speed gives.

The testbed runs it once on the host, pinned to one core (the rate a speed of 1.0 means,
cached), and on every device when the devices start (the rate recorded with each row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from devices.pace import Control, Pace

WARMUP_BLOCKS = 3


def block_flops(tokens: int, dim: int, mlp_dim: int) -> int:
    """Floating-point operations of one block's four products on `tokens` rows."""
    return 2 * tokens * dim * (3 * dim + dim + 2 * mlp_dim)


def measure(
    tokens: int, dim: int, mlp_dim: int, seconds: float, pace: Pace, least_blocks: int = 5
) -> dict[str, object]:
    """Blocks for `seconds` (at least `least_blocks`), each a stretch at the pace's speed."""
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=generator)
    weights = [
        torch.randn(rows, cols, generator=generator) / cols**0.5
        for rows, cols in ((3 * dim, dim), (dim, dim), (mlp_dim, dim), (dim, mlp_dim))
    ]

    def block() -> None:
        with pace.stretch():
            F.linear(x, weights[0])
            F.linear(x, weights[1])
            F.linear(F.linear(x, weights[2]), weights[3])

    with torch.no_grad():
        for _ in range(WARMUP_BLOCKS):
            block()
        times_ms: list[float] = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(times_ms) < least_blocks:
            began = time.perf_counter()
            block()
            times_ms.append(1000 * (time.perf_counter() - began))
    flops = block_flops(tokens, dim, mlp_dim)
    median_ms = statistics.median(times_ms)
    return {
        "gflops": round(flops / (median_ms / 1000) / 1e9, 3),
        "block_ms": round(median_ms, 4),
        "blocks": len(times_ms),
        "tokens": tokens,
        "block_flops": flops,
        "times_ms": [round(t, 4) for t in times_ms],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devices.gemm", description=__doc__)
    parser.add_argument("--model", default="vit-b16", help="a model of tracevq.config")
    parser.add_argument("--tokens", type=int, help="rows per product (default: N / 2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--speed", type=float, default=1.0, help="the device's speed (pace)")
    parser.add_argument("--control", type=Path, help="a control file giving the speed")
    parser.add_argument("--blocks", action="store_true", help="print every block's time")
    args = parser.parse_args(argv)
    try:
        import torch

        from tracevq.config import model_config

        config = model_config(args.model)
        if not 0 < args.speed <= 1:
            raise ValueError(f"--speed must lie in (0, 1], got {args.speed}")
        torch.set_num_threads(args.threads)
        control = None if args.control is None else Control(args.control)
        pace = Pace(args.speed, control, args.threads)
        tokens = args.tokens or -(-config.tokens // 2)
        found = measure(tokens, config.dim, config.mlp_dim, args.seconds, pace)
    except Exception as error:  # noqa: BLE001 - the CLI boundary: one line, non-zero exit
        print(f"gemm: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if not args.blocks:
        found.pop("times_ms")
    found.update(model=args.model, threads=args.threads, speed=pace.speed)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
