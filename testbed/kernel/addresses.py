"""IPv4 addresses of a run's networks: what the host already routes, and a /24 for a run that
clashes with none of it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import socket
from collections.abc import Iterable

from testbed.errors import DeviceError, TestbedError
from testbed.kernel.netns import netlink_step

SUBNET_RANGE = (ipaddress.IPv4Address("10.200.0.0"), ipaddress.IPv4Address("10.254.255.255"))


def choose_subnet(run_id: str, used: Iterable[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """The run's /24 in 10.200-10.254: starts where the run id's hash points, skips clashes.

    Networks of prefix length 0 (default routes) are ignored: they overlap everything.
    """
    first, last = int(SUBNET_RANGE[0]) >> 8, int(SUBNET_RANGE[1]) >> 8  # numbers of the /24s
    blocked: set[int] = set()
    for network in used:
        if network.prefixlen > 0:
            low = max(int(network.network_address) >> 8, first)
            high = min(int(network.broadcast_address) >> 8, last)
            blocked.update(range(low, high + 1))
    count = last - first + 1
    start = int(hashlib.sha1(run_id.encode()).hexdigest(), 16) % count
    for step in range(count):
        number = first + (start + step) % count
        if number not in blocked:
            return ipaddress.IPv4Network((number << 8, 24))
    raise DeviceError(f"no /24 in {SUBNET_RANGE[0]}-{SUBNET_RANGE[1]} is free of the host's routes")


def host_networks(
    who: str = "host", error: type[TestbedError] = DeviceError
) -> list[ipaddress.IPv4Network]:
    """IPv4 networks the host namespace routes or holds addresses in (all tables)."""
    from pyroute2 import IPRoute

    networks = []
    with netlink_step("read the host's routes and addresses", who, error), IPRoute() as ipr:
        for route in ipr.get_routes(family=socket.AF_INET):
            destination = route.get("dst") or "0.0.0.0"
            networks.append(ipaddress.ip_network(f"{destination}/{route['dst_len']}", False))
        for address in ipr.get_addr(family=socket.AF_INET):
            networks.append(
                ipaddress.ip_network(f"{address.get('address')}/{address['prefixlen']}", False)
            )
    return networks
