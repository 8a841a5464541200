"""The Trace level of a session when `level_k=auto`, kept simple (docs/method.md, Level
selection).

The finest tree level whose message crosses the link within this device's local FFN time
(so that communication stays hidden behind it), via `tracevq.methods.auto_level`. The FFN
time is measured here, before the session, on the device's own partition shape: every
block's FFN on random activations, a few rounds, the median per block. The link rate comes
from the caller (`--rate-mbit`, 10^6 bit/s, e.g. the probe's figure); without it the finest
level is used. Each device chooses for itself: the header of every message carries its level.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from tracevq.methods import Method, TraceMethod, auto_level

FFN_ROUNDS = 3


@torch.no_grad()
def measure_ffn_ms(method: Method, tokens: int, batch: int) -> float:
    """Median time of one block's FFN on (batch, tokens, D) activations."""
    z = torch.randn(batch, tokens, method.model.config.dim)
    times = []
    for _ in range(FFN_ROUNDS):
        for block in method.model.blocks:
            began = time.perf_counter()
            block.ffn(z)
            times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times)


def choose_level(
    method: Method, tokens: int, batch: int, rate_mbit: float | None
) -> dict[str, Any]:
    """Set the method's level if it asks for `auto`; returns what was decided and why."""
    if not isinstance(method, TraceMethod) or method.spec.level_k != "auto":
        return {"mode": "fixed"}
    finest = len(method.level_bits) - 1
    if rate_mbit is None:
        method.set_level(finest)
        return {
            "mode": "auto",
            "level": finest,
            "rate_mbit": None,
            "reason": "no link rate given (--rate-mbit): finest level",
        }
    ffn_ms = measure_ffn_ms(method, tokens, batch)
    level = auto_level(method.level_bits, tokens * batch, rate_mbit * 1e6, ffn_ms)
    method.set_level(level)
    transfer_ms = 1000 * method.payload_bits(tokens, batch) / (rate_mbit * 1e6)
    return {
        "mode": "auto",
        "level": level,
        "r_bits": method.level_bits[level],
        "rate_mbit": rate_mbit,
        "ffn_ms": ffn_ms,
        "transfer_ms": transfer_ms,
    }
