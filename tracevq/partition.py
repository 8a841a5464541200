"""Contiguous token partitions for sequence parallelism, CLS on device 0.

A partition is the list of each device's token count, in rank order; device p holds the
tokens [sum of the counts before p, + its count). Three ways to make one:

- `partition_sizes`: even, sizes that differ by at most one (the first devices hold one more);
- `sizes_by_rates`: proportional to each device's compute rate, so that devices of different
  speeds finish their blocks together (every device holds at least one token);
- a list given by the user, checked by `check_sizes`.

Compute is not exactly linear in a device's tokens (attention adds N_p x N, the same term per
token for every device), so proportional sizes equalise the products' time, which dominates
at the sizes here, and nearly the whole block's.
"""

from __future__ import annotations

from collections.abc import Sequence

from tracevq.errors import ConfigError


def partition_sizes(tokens: int, devices: int) -> list[int]:
    """Tokens per device, even; the first `tokens % devices` devices hold one more."""
    if devices < 1:
        raise ConfigError(f"devices must be at least 1, got {devices}")
    if devices > tokens:
        raise ConfigError(f"devices ({devices}) exceed the sequence length ({tokens} tokens)")
    base, extra = divmod(tokens, devices)
    return [base + (1 if rank < extra else 0) for rank in range(devices)]


def sizes_by_rates(tokens: int, rates: Sequence[float]) -> list[int]:
    """Tokens per device proportional to `rates` (largest remainders, ties to the lower
    rank), every device at least one."""
    devices = len(rates)
    partition_sizes(tokens, devices)  # the same refusals as an even partition
    if any(not rate > 0 for rate in rates):
        raise ConfigError(f"every device's rate must be positive, got {list(rates)}")
    spare = tokens - devices  # one token each first
    exact = [spare * rate / sum(rates) for rate in rates]
    sizes = [1 + int(share) for share in exact]
    order = sorted(range(devices), key=lambda r: (-(exact[r] - int(exact[r])), r))
    for rank in order[: tokens - sum(sizes)]:
        sizes[rank] += 1
    return sizes


def check_sizes(tokens: int, sizes: Sequence[int]) -> list[int]:
    """A given partition: whole positive counts that add up to the sequence's tokens."""
    if not sizes:
        raise ConfigError("a partition needs at least one device's token count")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ConfigError(f"every device holds a whole number of tokens, at least 1: {sizes}")
    if sum(sizes) != tokens:
        raise ConfigError(
            f"the partition {list(sizes)} holds {sum(sizes)} tokens, the model has {tokens}"
        )
    return list(sizes)


def ranges_of(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Half-open token ranges [start, stop) per device of a partition."""
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


def device_layout(devices: int | Sequence[int]) -> tuple[int, list[int] | None]:
    """(how many devices, every device's tokens or None for even) of a count of devices or
    of a partition given as every device's tokens."""
    if isinstance(devices, int):
        return devices, None
    return len(devices), list(devices)


def partition_ranges(
    tokens: int, devices: int, sizes: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Token ranges per device: of `sizes` when given (checked), else even."""
    if sizes is None:
        return ranges_of(partition_sizes(tokens, devices))
    if len(sizes) != devices:
        raise ConfigError(f"the partition {list(sizes)} is for {len(sizes)} devices, not {devices}")
    return ranges_of(check_sizes(tokens, sizes))
