"""Network namespaces: where they are mounted, how a command runs in one, how netlink is
spoken inside one, and how a run's namespaces and links are found and removed (by their names,
`testbed.kernel.names`).

One way in for every caller: a command runs in a namespace through `nsenter --net=PATH`
(`in_netns`), netlink through pyroute2 opened on the namespace's PATH (`iproute`). A path
names any namespace: a run's own under NETNS_DIR (`/var/run/netns/tb-<tag>-d0`) as well as a
container's (`/proc/<pid>/ns/net`), which `ip netns exec`, taking only names under
NETNS_DIR, cannot enter.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from testbed.errors import TestbedError
from testbed.kernel.names import holds_links, link_tag, netns_tag, run_tag

log = logging.getLogger(__name__)

NETNS_DIR = Path("/var/run/netns")  # iproute2's and pyroute2's


def netns_path(name: str) -> str:
    return str(NETNS_DIR / name)


def in_netns(netns_path: str | None, argv: Sequence[str]) -> list[str]:
    """`argv` run inside the namespace mounted at `netns_path` (None: the host's)."""
    return list(argv) if netns_path is None else ["nsenter", f"--net={netns_path}", *argv]


@contextlib.contextmanager
def netlink_step(action: str, who: str, error: type[TestbedError]) -> Iterator[None]:
    """Logs a netlink action at DEBUG and turns its failure into `error`: `WHO: ACTION failed`."""
    from pyroute2 import NetlinkError

    log.debug("netlink: %s", action)
    try:
        yield
    except (OSError, NetlinkError) as problem:
        raise error(f"{who}: {action} failed: {problem}") from problem


@contextlib.contextmanager
def iproute(netns_path: str, who: str, error: type[TestbedError]) -> Iterator[Any]:
    """An IPRoute inside an existing namespace (never creating one)."""
    from pyroute2 import IPRoute

    with netlink_step(f"enter namespace {netns_path}", who, error):
        ipr = IPRoute(netns=netns_path, flags=0)
    try:
        yield ipr
    finally:
        ipr.close()


def open_netns(netns_path: str, where: str, error: type[TestbedError]) -> int:
    """A file descriptor of the namespace (to create an interface's peer inside it)."""
    try:
        return os.open(netns_path, os.O_RDONLY)
    except OSError as problem:
        raise error(f"{where}: cannot open the device's namespace: {problem}") from None


def create_netns(name: str, who: str, error: type[TestbedError]) -> str:
    """A new namespace `name` under NETNS_DIR, its loopback up; returns its path."""
    from pyroute2 import netns

    with netlink_step(f"create namespace {name}", who, error):
        netns.create(name)
    path = netns_path(name)
    try:
        with iproute(path, who, error) as ipr, netlink_step(f"{name}: set lo up", who, error):
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
    except BaseException:
        with contextlib.suppress(OSError):
            netns.remove(name)
        raise
    return path


def pids_in(netns_path: Path) -> list[int]:
    """Processes whose network namespace is the one mounted at `netns_path`."""
    try:
        target = netns_path.stat()
    except OSError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            ns = (entry / "ns" / "net").stat()
            if (ns.st_dev, ns.st_ino) == (target.st_dev, target.st_ino):
                pids.append(int(entry.name))
    return pids


def _delete_links(netns_name: str | None, tag: str | None) -> list[str]:
    """Deletes the run's veths (with their peers) and bridges in a namespace (None: the host's)."""
    from pyroute2 import IPRoute, NetlinkError, NetNS

    removed = []
    try:
        with NetNS(netns_name, flags=0) if netns_name else IPRoute() as ipr:
            ours = []
            for link in ipr.get_links():
                named = link_tag(link.get("ifname") or "")
                if named and tag in (None, named[0]):
                    ours.append((not named[1], link.get("ifname"), link["index"]))
            # ports first: deleting a port's veth also deletes the device's end, its peer
            for _, ifname, index in sorted(ours):
                log.debug("netlink: %s: delete link %s", netns_name or "host", ifname)
                with contextlib.suppress(NetlinkError):
                    ipr.link("del", index=index)
                    removed.append(f"link {ifname}")
    except FileNotFoundError:
        pass  # the namespace is already gone
    return removed


def remove_namespaces(names: Sequence[str]) -> list[str]:
    """Kills what runs in the namespaces, deletes their links, unmounts them; returns what went."""
    from pyroute2 import netns

    removed = []
    for name in names:
        for pid in pids_in(NETNS_DIR / name):
            log.debug("kill -KILL %d (left in %s)", pid, name)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                removed.append(f"process {pid}")
    for name in names:
        if holds_links(name):
            removed += _delete_links(name, netns_tag(name))
    for name in reversed(names):  # devices before the switch
        log.debug("netlink: remove namespace %s", name)
        try:
            netns.remove(name)
            removed.append(f"namespace {name}")
        except FileNotFoundError:
            pass
        except OSError as problem:
            log.warning("removing namespace %s: %s", name, problem)
    return removed


def leftovers_by_tag() -> dict[str, list[str]]:
    """What runs left on this host, by run tag: their namespaces, and their links in the
    host's namespace."""
    from pyroute2 import IPRoute, netns

    found: dict[str, list[str]] = {}
    for name in sorted(netns.listnetns(str(NETNS_DIR))):
        if tag := netns_tag(name):
            found.setdefault(tag, []).append(f"namespace {name}")
    with IPRoute() as ipr:
        for link in ipr.get_links():
            ifname = link.get("ifname") or ""
            if named := link_tag(ifname):
                found.setdefault(named[0], []).append(f"link {ifname}")
    return found


def remove_leftovers(run_id: str | None = None, tag: str | None = None) -> list[str]:
    """Removes the namespaces, bridges and veths that a run (by id or tag), or every run, left
    behind. Returns what was removed (processes still running in those namespaces are killed).
    """
    from pyroute2 import netns

    tag = tag or (run_tag(run_id) if run_id else None)
    names = []
    for name in sorted(netns.listnetns(str(NETNS_DIR))):
        found = netns_tag(name)
        if found and tag in (None, found):
            names.append(name)
    switches = [name for name in names if holds_links(name)]
    removed = remove_namespaces(switches + [name for name in names if name not in switches])
    return removed + _delete_links(None, tag)
