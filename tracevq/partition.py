"""Contiguous token partitions for sequence parallelism: sizes differ by at most one, CLS on 0."""

from __future__ import annotations

from tracevq.errors import ConfigError


def partition_sizes(tokens: int, devices: int) -> list[int]:
    """Tokens per device; the first `tokens % devices` devices hold one more."""
    if devices < 1:
        raise ConfigError(f"devices must be at least 1, got {devices}")
    if devices > tokens:
        raise ConfigError(f"devices ({devices}) exceed the sequence length ({tokens} tokens)")
    base, extra = divmod(tokens, devices)
    return [base + (1 if rank < extra else 0) for rank in range(devices)]


def partition_ranges(tokens: int, devices: int) -> list[tuple[int, int]]:
    """Half-open token ranges [start, stop) per device; device 0 starts with CLS (token 0)."""
    ranges, start = [], 0
    for size in partition_sizes(tokens, devices):
        ranges.append((start, start + size))
        start += size
    return ranges
