"""Network interfaces: how long a name may be, how an interface is set up for the run's
traffic alone, and which offloads a shaped or bridged interface must not have.
"""

from __future__ import annotations

from typing import Any

from testbed.errors import TestbedError
from testbed.kernel.netns import netlink_step

IFNAME_MAX_CHARS = 15  # IFNAMSIZ - 1
# IFLA_INET6_ADDR_GEN_MODE none: the interface gets no IPv6 link-local address
NO_LINK_LOCAL = {"attrs": [("AF_INET6", {"attrs": [("IFLA_INET6_ADDR_GEN_MODE", 1)]})]}


def check_ifname(name: str, what: str, error: type[Exception] = ValueError) -> str:
    """`name`, or `error` saying that `what` makes an interface name too long."""
    if not name or len(name) > IFNAME_MAX_CHARS or "/" in name:
        raise error(
            f"{what} makes the interface name {name!r}, which is too long or holds a '/' (at "
            f"most {IFNAME_MAX_CHARS} characters)"
        )
    return name


def link_up(
    ipr: Any, where: str, ifname: str, who: str, error: type[TestbedError], **settings: Any
) -> None:
    """Sets a link up (with `settings`, e.g. master) and without an IPv6 link-local address.

    Without link-local addresses a run's network carries only the experiment's traffic (no
    duplicate address detection, router or multicast listener messages), as in Docker's
    containers, where IPv6 is off.
    """
    with netlink_step(f"{where}: {ifname}: no IPv6 link-local", who, error):
        index = ipr.link_lookup(ifname=ifname)[0]
        ipr.link("set", index=index, IFLA_AF_SPEC=NO_LINK_LOCAL)
    with netlink_step(f"{where}: {ifname}: up {settings or ''}".rstrip(), who, error):
        ipr.link("set", index=index, state="up", **settings)


def offload_argv(interface: str, checksums: bool = False) -> list[str]:
    """The `ethtool` command that turns segmentation and receive offloads off (GSO/TSO/GRO),
    and with `checksums` transmit checksumming too: a frame copied through a packet socket
    must carry its own checksum (measured: with `tx on`, no TCP handshake crosses the serial
    emulator)."""
    features = ["gso", "off", "tso", "off", "gro", "off"] + (["tx", "off"] if checksums else [])
    return ["ethtool", "-K", interface, *features]
