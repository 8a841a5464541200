"""netem, delay, jitter and loss: a profile's impairments become parameters (pure, no kernel).

netem sits under the root tbf (class 1:1); a kernel without `sch_netem` cannot have it
(`testbed.kernel.shaping.check_support` says so rather than dropping the impairment).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from testbed.experiment.profiles import LinkProfile
from testbed.kernel.tbf import ETHERNET_FRAME_BYTES, TBF_CLASS, TbfParams

NETEM_DEFAULT_LIMIT_PACKETS = 1000  # the kernel's own default
NETEM_HANDLE = 0x100000  # "10:"


@dataclass(frozen=True)
class NetemParams:
    delay_us: int
    jitter_us: int
    loss_pct: float
    limit_packets: int


def netem_params(
    profile: LinkProfile, tbf: TbfParams | None = None, mtu: int = ETHERNET_FRAME_BYTES
) -> NetemParams | None:
    """netem parameters for a profile's impairments, or None when it has none.

    Under tbf, netem's queue replaces tbf's byte-limited fifo, so its packet limit is set to
    keep tbf's latency bound: tbf's byte limit plus what the delay (and jitter) keeps in
    flight, in full frames. Without `tbf` the kernel's default of 1000 packets is kept.
    """
    if not profile.needs_netem:
        return None
    limit = NETEM_DEFAULT_LIMIT_PACKETS
    if tbf is not None:
        in_flight_bytes = tbf.rate_bit_s / 8 * (profile.delay_ms + profile.jitter_ms) / 1000
        limit = math.ceil((tbf.limit_bytes + in_flight_bytes) / mtu)
    return NetemParams(
        delay_us=round(profile.delay_ms * 1000),
        jitter_us=round(profile.jitter_ms * 1000),
        loss_pct=profile.loss_pct,
        limit_packets=limit,
    )


def netem_argv(interface: str, netem: NetemParams) -> list[str]:
    """netem under the root tbf's class 1:1 as a `tc qdisc add` command."""
    argv = ["tc", "qdisc", "add", "dev", interface, "parent", "1:1", "handle", "10:", "netem"]
    argv += ["limit", str(netem.limit_packets)]
    if netem.delay_us or netem.jitter_us:
        argv += ["delay", _tc_time(netem.delay_us)]
        if netem.jitter_us:
            argv.append(_tc_time(netem.jitter_us))
    if netem.loss_pct:
        argv += ["loss", f"{netem.loss_pct:g}%"]
    return argv


def netem_keywords(netem: NetemParams) -> dict[str, Any]:
    """netem under the root tbf as pyroute2 `tc(..., "netem", index, **keywords)` keywords."""
    return {
        "parent": TBF_CLASS,
        "handle": NETEM_HANDLE,
        "delay": netem.delay_us,
        "jitter": netem.jitter_us,
        "loss": netem.loss_pct,
        "limit": netem.limit_packets,
    }


def _tc_time(microseconds: int) -> str:
    if microseconds % 1000 == 0:
        return f"{microseconds // 1000}ms"
    return f"{microseconds}us"
