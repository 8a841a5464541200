"""htb, one class per peer: a device's uplink shared by classes that cap what it sends to
particular peers (pure, no kernel). u32 filters on the destination address pick the class
(`testbed.kernel.u32`); each class queues in a pfifo (`testbed.kernel.fifo`), or in a netem
where the pair has impairments of its own (`testbed.kernel.shaping` gives those leaves).

Layout (handles in tc's hex): root qdisc `1:` with `default 2`; class `1:1` is the whole
uplink (rate = ceil = the uplink); under it `1:2` carries traffic to peers without a cap and
`1:<10 + rank>` traffic to a capped peer, each with ceil = its cap (at most the uplink). A
class that has tokens of its own sends without asking its parent, so the children's
guaranteed rates share the uplink equally (they sum to it) and a lone flow borrows up to its
ceil: the uplink is enforced however the traffic is split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from testbed.errors import ShapingError
from testbed.kernel.fifo import pfifo_argv
from testbed.kernel.tbf import ETHERNET_FRAME_BYTES, MIN_BURST_FRAMES, QUEUE_LATENCY_MS
from testbed.kernel.u32 import u32_destination_argv
from testbed.units import BIT_PER_MBIT

HTB_HANDLE = "1:"
UPLINK_MINOR = 0x1
DEFAULT_MINOR = 0x2
PEER_MINOR_BASE = 0x10  # peer rank r: class 1:(0x10 + r), its pfifo (0x10 + r):


@dataclass(frozen=True)
class HtbClass:
    minor: int
    rate_bit_s: int  # guaranteed
    ceil_bit_s: int  # at most
    burst_bytes: int
    limit_packets: int  # its pfifo leaf (0: the uplink class, which has children, no leaf)
    address: str | None = None  # the peer whose traffic it carries (u32 on the destination)


@dataclass(frozen=True)
class HtbParams:
    uplink: HtbClass
    default: HtbClass
    peers: tuple[HtbClass, ...]

    @property
    def leaves(self) -> tuple[HtbClass, ...]:
        return (self.default, *self.peers)


def htb_params(
    uplink_mbit: float,
    peer_caps_mbit: Mapping[int, tuple[str, float]],
    queue_latency_ms: float = QUEUE_LATENCY_MS,
    mtu: int = ETHERNET_FRAME_BYTES,
) -> HtbParams:
    """Classes for an uplink and per-peer caps {rank: (address, cap)}; a cap above the
    uplink is the uplink. Bursts are two frames, as tbf's (`testbed.kernel.tbf.tbf_params`);
    each leaf's queue holds `queue_latency_ms` at its ceil, in full frames, plus the burst."""
    if uplink_mbit <= 0 or any(cap <= 0 for _, cap in peer_caps_mbit.values()):
        raise ShapingError(f"a shaped rate must be positive: {uplink_mbit}, {peer_caps_mbit}")
    uplink = round(uplink_mbit * BIT_PER_MBIT)
    share = max(uplink // (len(peer_caps_mbit) + 1), 8)
    burst = MIN_BURST_FRAMES * mtu

    def leaf(minor: int, ceil_bit_s: int, address: str | None = None) -> HtbClass:
        queued = math.ceil(ceil_bit_s / 8 * queue_latency_ms / 1000 / mtu) + MIN_BURST_FRAMES
        rate = min(share, ceil_bit_s)
        return HtbClass(minor, rate, ceil_bit_s, burst, queued, address)

    peers = tuple(
        leaf(PEER_MINOR_BASE + rank, min(round(cap * BIT_PER_MBIT), uplink), address)
        for rank, (address, cap) in sorted(peer_caps_mbit.items())
    )
    return HtbParams(
        uplink=HtbClass(UPLINK_MINOR, uplink, uplink, burst, 0),
        default=leaf(DEFAULT_MINOR, uplink),
        peers=peers,
    )


def htb_root_argv(interface: str) -> list[str]:
    """The root htb, unclassified traffic to class 1:2."""
    return (
        ["tc", "qdisc", "replace", "dev", interface]
        + ["root", "handle", HTB_HANDLE]
        + ["htb", "default", f"{DEFAULT_MINOR:x}"]
    )


def htb_class_argv(
    interface: str, klass: HtbClass, action: str = "add", mtu: int = ETHERNET_FRAME_BYTES
) -> list[str]:
    """A class as `tc class add|change`; the uplink class hangs from the root, the others
    from the uplink class."""
    parent = HTB_HANDLE if klass.minor == UPLINK_MINOR else f"1:{UPLINK_MINOR:x}"
    return (
        ["tc", "class", action, "dev", interface, "parent", parent]
        + ["classid", f"1:{klass.minor:x}", "htb"]
        + ["rate", f"{klass.rate_bit_s}bit", "ceil", f"{klass.ceil_bit_s}bit"]
        + ["burst", str(klass.burst_bytes), "cburst", str(klass.burst_bytes), "quantum", str(mtu)]
    )


# a leaf's queue other than its pfifo, as a command: (class, action) -> argv, or None
LeafArgv = Callable[[HtbClass, str], "list[str] | None"]


def htb_argv(interface: str, htb: HtbParams, leaf: LeafArgv | None = None) -> list[list[str]]:
    """The root, its classes, their leaves (a pfifo, or what `leaf` gives) and a u32 filter
    per capped peer."""
    commands = [htb_root_argv(interface), htb_class_argv(interface, htb.uplink)]
    for klass in htb.leaves:
        commands.append(htb_class_argv(interface, klass))
        commands.append(_leaf_argv(interface, klass, "add", leaf))
        if klass.address is not None:
            commands.append(u32_destination_argv(interface, klass.address, klass.minor))
    return commands


def htb_change_argv(
    interface: str, htb: HtbParams, leaf: LeafArgv | None = None
) -> list[list[str]]:
    """Every class's rates and every leaf's queue changed in place (same layout)."""
    commands = [htb_class_argv(interface, htb.uplink, "change")]
    for klass in htb.leaves:
        commands.append(htb_class_argv(interface, klass, "change"))
        commands.append(_leaf_argv(interface, klass, "change", leaf))
    return commands


def _leaf_argv(interface: str, klass: HtbClass, action: str, leaf: LeafArgv | None) -> list[str]:
    argv = None if leaf is None else leaf(klass, action)
    return argv or pfifo_argv(interface, klass.minor, klass.limit_packets, action)
