"""A probe on the serial link, judged while the machine ran the emulator.

This VM's host sometimes does not run the serial emulator for 5-60 ms, and a probe's link
loses about that much: the emulator counts those stalls per port (`stalled_ms`, a stall's
length is what the link lost at most), so a rate may read low by them and never high. tbf is
the kernel's and has no stalls to count (its stats are None: nothing excused)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

TOLERANCE = 0.05


def stalled_ms(stats: Mapping[Any, Mapping[str, Any]] | None) -> float:
    """The emulator's stalls so far, its ports summed (0 for an emulator without them)."""
    return sum(float(port["stalled_ms"]) for port in (stats or {}).values())


def holds_rate(measured: float, target: float, probe_s: float, lost_ms: float) -> bool:
    """`measured` within TOLERANCE of `target`, a probe of `probe_s` excused `lost_ms`."""
    running = measured * probe_s / max(probe_s - lost_ms / 1e3, 1e-9)
    return measured <= target * (1 + TOLERANCE) and running >= target * (1 - TOLERANCE)


def rate_in_force(read: Callable[[], float], target: float) -> float:
    """A kernel-shaped link's rate: `read()` once more when the first reads low. tbf cannot
    send faster than its rate, so a low read is the sender held up by this VM (CI saw a
    10 Mbit/s tbf probe on the boards read 9.46, its neighbours 10.00 and 2.00) and the
    higher read is the better estimate; a read above the target is returned as it is."""
    first = read()
    if first >= target * (1 - TOLERANCE):
        return first
    return max(first, read())
