"""A run's names on this host, built and read back here only.

Everything a run makes on this host is named from its tag, the first 8 hex digits of the run
id's SHA-1 (`run_tag`), whatever characters the run id holds:

- network namespaces (under /var/run/netns, so that `ip netns` lists them): `tb-<tag>-sw`,
  the local backend's switch; `tb-<tag>-d<rank>`, its devices; `tb-<tag>-sl`, the serial
  link's switch;
- interfaces: `tb<tag>`, the local switch's bridge; `tb<tag>h<rank>`, the bridge's ports;
  `tb<tag>s<rank>`, the serial link's ports. An interface name fits the kernel's 15
  characters (`check_ifname`).

`testbed.kernel.netns` finds what a dead run left by these names (`NETNS_PATTERN`,
`LINK_PATTERN`: the run's tag, and whether a namespace is a switch, which holds the run's
links, or a link a port).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from testbed.errors import ShapingError

IFNAME_MAX_CHARS = 15  # IFNAMSIZ - 1
SWITCH_SUFFIX = "sw"  # the local backend's switch: tb-<tag>-sw
SERIAL_SUFFIX = "sl"  # the serial link's switch: tb-<tag>-sl
TAG_PATTERN = re.compile(r"^[0-9a-f]{8}$")
NETNS_PATTERN = re.compile(r"^tb-(?P<tag>[0-9a-f]{8})-(?P<kind>sw|sl|d\d+)$")
LINK_PATTERN = re.compile(r"^tb(?P<tag>[0-9a-f]{8})(?P<port>[hs]\d+)?$")


def run_tag(run_id: str) -> str:
    """8 hex digits naming everything of a run, whatever characters the run id holds."""
    return hashlib.sha1(run_id.encode()).hexdigest()[:8]


def check_ifname(name: str, what: str, error: type[Exception] = ValueError) -> str:
    """`name`, or `error` saying that `what` makes an interface name too long."""
    if not name or len(name) > IFNAME_MAX_CHARS or "/" in name:
        raise error(
            f"{what} makes the interface name {name!r}, which is too long or holds a '/' (at "
            f"most {IFNAME_MAX_CHARS} characters)"
        )
    return name


@dataclass(frozen=True)
class RunNames:
    """The names of a run's namespaces and interfaces (the module's docstring)."""

    tag: str

    @classmethod
    def for_run(cls, run_id: str) -> RunNames:
        return cls(run_tag(run_id))

    @property
    def switch_netns(self) -> str:
        return f"tb-{self.tag}-{SWITCH_SUFFIX}"

    @property
    def serial_netns(self) -> str:
        return f"tb-{self.tag}-{SERIAL_SUFFIX}"

    def device_netns(self, rank: int) -> str:
        return f"tb-{self.tag}-d{rank}"

    @property
    def bridge(self) -> str:
        return f"tb{self.tag}"

    def port(self, rank: int) -> str:
        """The bridge's end of the veth pair of device `rank`."""
        return check_ifname(f"tb{self.tag}h{rank}", f"rank {rank}")

    def serial_port(self, rank: int) -> str:
        """The serial switch's end of the veth pair of device `rank`."""
        return check_ifname(f"tb{self.tag}s{rank}", f"serial switch: rank {rank}", ShapingError)


def netns_tag(name: str) -> str | None:
    """The run tag of one of a run's namespaces, or None for a name not ours."""
    match = NETNS_PATTERN.match(name)
    return None if match is None else match["tag"]


def holds_links(name: str) -> bool:
    """Whether a run's namespace is a switch, holding the run's links (their peers elsewhere)."""
    match = NETNS_PATTERN.match(name)
    return match is not None and match["kind"] in (SWITCH_SUFFIX, SERIAL_SUFFIX)


def link_tag(ifname: str) -> tuple[str, bool] | None:
    """(the run tag, whether it is a port) of one of a run's interfaces, or None."""
    match = LINK_PATTERN.match(ifname)
    return None if match is None else (match["tag"], match["port"] is not None)
