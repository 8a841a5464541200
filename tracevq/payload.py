"""Analytic payload per device per layer (the paper's Table II), without running anything."""

from __future__ import annotations

from collections.abc import Sequence

from tracevq.config import ModelConfig, model_config
from tracevq.errors import ConfigError
from tracevq.method_table import METHODS
from tracevq.partition import partition_ranges
from tracevq.spec import MethodSpec, method_spec


def message_bits(spec: MethodSpec, tokens: int, dim: int, batch: int = 1) -> int:
    """Bits one device sends for one layer when it holds `tokens` tokens (x `batch` inputs)."""
    return METHODS[spec.name].message_bits(spec, tokens, dim, batch)


def exchanges(spec: MethodSpec, depth: int) -> int:
    """Messages a device sends each peer per inference: one per block, except for the Trace
    placements whose block-0 K/V come from the exact embedding, which receivers compute."""
    placement = spec.resolved_placement
    return depth if placement is None else placement.exchanges(depth)


def payload_bits(
    model: str | ModelConfig,
    method: str,
    devices: int,
    batch: int = 1,
    sizes: Sequence[int] | None = None,
    **params: object,
) -> list[int]:
    """Payload bits per layer for each device rank (one copy, as in the paper's Table II), at
    the partition `sizes` (every device's tokens; default even).

    A single device sends nothing; a method that does not exchange (`single`) is refused at
    more than one device.
    """
    config = model if isinstance(model, ModelConfig) else model_config(model)
    spec = method_spec(method, **params)
    if not spec.exchanges and devices > 1:
        raise ConfigError(f"method {spec.name!r} runs on one device, not {devices}", "devices")
    sizes = [b - a for a, b in partition_ranges(config.tokens, devices, sizes)]
    if devices == 1:
        return [0]
    return [message_bits(spec, size, config.dim, batch) for size in sizes]
