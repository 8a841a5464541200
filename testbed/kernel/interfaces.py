"""Network interfaces: how an interface is set up for the run's traffic alone, how a device
is wired to a switch (a veth pair whose peer is born inside the device's namespace), and which
offloads a shaped or bridged interface must not have. Their names: `testbed.kernel.names`.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Any

from testbed.errors import TestbedError
from testbed.kernel.netns import iproute, netlink_step, open_netns

# IFLA_INET6_ADDR_GEN_MODE none: the interface gets no IPv6 link-local address
NO_LINK_LOCAL = {"attrs": [("AF_INET6", {"attrs": [("IFLA_INET6_ADDR_GEN_MODE", 1)]})]}


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


@dataclass(frozen=True)
class Veth:
    """A veth pair from the namespace `switch` into the namespace `device` (both paths): the
    switch's end `port` (a port of `bridge` when given), and the device's end `interface`,
    addressed `address`."""

    switch: str
    port: str
    device: str
    interface: str
    address: ipaddress.IPv4Interface
    bridge: str | None = None

    @property
    def where(self) -> str:
        """How errors and logs name the pair."""
        return f"{self.switch}: veth {self.port} <-> {self.device}:{self.interface}"


def veth_into(veth: Veth, who: str, error: type[TestbedError], **device_settings: Any) -> None:
    """Creates `veth`: its port here, up, and its peer created inside the device's namespace
    already so named, addressed and up (with `device_settings`, e.g. gso_max_segs). One
    netlink message makes the pair: no interface with a temporary name, nothing moved or
    renamed."""
    switch, port, device, interface = veth.switch, veth.port, veth.device, veth.interface
    device_fd = open_netns(device, veth.where, error)
    try:
        with iproute(switch, who, error) as ipr:
            with netlink_step(f"add {veth.where}", who, error):
                peer = {"ifname": interface, "net_ns_fd": device_fd}
                ipr.link("add", ifname=port, kind="veth", peer=peer)
            bridge = veth.bridge
            master = {} if bridge is None else {"master": ipr.link_lookup(ifname=bridge)[0]}
            link_up(ipr, switch, port, who, error, **master)
    finally:
        os.close(device_fd)
    address = veth.address
    with iproute(device, who, error) as ipr:
        index = ipr.link_lookup(ifname=interface)[0]
        with netlink_step(f"{device}: {interface}: address {address}", who, error):
            ipr.addr(
                "add", index=index, address=str(address.ip), prefixlen=address.network.prefixlen
            )
        link_up(ipr, device, interface, who, error, **device_settings)


def offload_argv(interface: str, checksums: bool = False) -> list[str]:
    """The `ethtool` command that turns segmentation and receive offloads off (GSO/TSO/GRO),
    and with `checksums` transmit checksumming too: a frame copied through a packet socket
    must carry its own checksum (measured: with `tx on`, no TCP handshake crosses the serial
    emulator)."""
    features = ["gso", "off", "tso", "off", "gro", "off"] + (["tx", "off"] if checksums else [])
    return ["ethtool", "-K", interface, *features]
