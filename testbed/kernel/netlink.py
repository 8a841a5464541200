"""Applying a plan: pyroute2 inside the device's network namespace for the root and the
interface, `tc`, `ip` and `ethtool` through `nsenter` for the rest (argument lists, never a
shell). A thin layer over `testbed.kernel.shaping`.

A root tbf alone goes through pyroute2 (`ShapingPlan.is_tbf_only`), and so does changing its
rate in place; pyroute2 also sets `gso_max_segs` and removes the old root. Every other plan,
netem included, goes as the plan's own `tc`/`ip` argument lists through `nsenter`: netem
(whose distribution tables pyroute2 cannot load), per-peer classes and a downlink; the same
commands the ssh backend and the logs show, and the ones held against a kernel with netem in
the reference guest (`checks.guest`), where pyroute2's netem options, u32 keys and
mirred actions would be a second rendering of them to keep in step.

A shaped interface also gets offloads off and `gso_max_segs 1`, so that tbf meters, queues
and drops real frames (see `testbed.kernel.shaping.gso_argv` for what goes wrong otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

from testbed.errors import ShapingError
from testbed.kernel.ifb import ifb_name
from testbed.kernel.interfaces import offload_argv
from testbed.kernel.netns import in_netns
from testbed.kernel.processes import run_checked
from testbed.kernel.shaping import (
    ShapingPlan,
    change_argv,
    change_argvs,
    check_support,
    clear_argv,
    downlink_clear_argv,
    gso_argv,
    netlink_requests,
    tc_argv,
)
from testbed.kernel.support import ROOT, qdisc_support

log = logging.getLogger(__name__)


def apply(
    netns_path: str | None,
    interface: str,
    shaping: ShapingPlan,
    support: Mapping[str, bool] | None = None,
) -> None:
    """Shapes an interface's egress as planned, replacing whatever root qdisc it had.

    Also limits TCP to one MSS per packet on the interface (see `gso_argv`) and turns
    offloads off (`offload_argv`; a missing ethtool is a warning). Neither is undone by
    `clear`: both are harmless without a shaper, and namespaces are removed with their run.

    Args:
        netns_path: the device's network namespace (`/proc/<pid>/ns/net`,
            `/var/run/netns/NAME`), or None for the host's own namespace.
        interface: the interface as seen inside that namespace.
        shaping: from `plan()`.
        support: qdisc capabilities; probed (once per process) when None.
    """
    check_support(shaping, qdisc_support() if support is None else support)
    where = _where(netns_path, interface)
    with _netlink(netns_path, interface) as (ipr, netlink_error, index):
        log.debug("%s: %s", where, " ".join(gso_argv(interface)))
        try:
            ipr.link("set", index=index, gso_max_segs=1)
        except netlink_error as error:
            raise ShapingError(f"{where}: setting gso_max_segs to 1 failed: {error}") from None
        _delete_root(ipr, netlink_error, index, where, interface)
        if not shaping.is_tbf_only:
            _apply_argv(netns_path, interface, shaping)
            set_offloads(netns_path, interface)
            return
        _clear_downlink(netns_path, interface)  # an earlier plan's, if it had one
        for action, argv, kind, keywords in netlink_requests(interface, shaping):
            log.debug("%s: %s", where, " ".join(argv))
            try:
                ipr.tc("add", kind, index, **keywords)
            except netlink_error as error:
                with contextlib.suppress(ShapingError):  # leave no half-shaped link behind
                    _delete_root(ipr, netlink_error, index, where, interface)
                raise ShapingError(f"{where}: {action} failed: {error}") from None
    set_offloads(netns_path, interface)


def change(netns_path: str | None, interface: str, shaping: ShapingPlan) -> None:
    """Changes the rate, bucket and limit of the tbf root that `apply` attached, in place
    (`tc qdisc change`): the link is never unshaped between two rates, where a delete and
    re-add would let a moment of traffic through at line rate. A plan with a netem, per-peer
    classes or a downlink has its netem's parameters and each of its rates changed
    (`change_argvs`): a trace's step carries its delay and loss with its rate."""
    where = _where(netns_path, interface)
    if not shaping.is_tbf_only:
        for argv in change_argvs(interface, shaping):
            _run_tc(netns_path, argv, where, "changing a rate in place")
        return
    _, argv, kind, keywords = netlink_requests(interface, shaping)[0]
    log.debug("%s: %s", where, " ".join(change_argv(interface, shaping)))
    with _netlink(netns_path, interface) as (ipr, netlink_error, index):
        try:
            ipr.tc("change", kind, index, **keywords)
        except netlink_error as error:
            raise ShapingError(
                f"{where}: changing the tbf to {shaping.tbf.rate_bit_s} bit/s failed: {error} "
                "(a link is shaped once before its rate can change)"
            ) from None


def clear(netns_path: str | None, interface: str) -> None:
    """Removes the interface's root qdisc (back to the kernel default), its ingress qdisc and
    its ifb; no error when there are none."""
    where = _where(netns_path, interface)
    with _netlink(netns_path, interface) as (ipr, netlink_error, index):
        _delete_root(ipr, netlink_error, index, where, interface)
    _clear_downlink(netns_path, interface)


def _apply_argv(netns_path: str | None, interface: str, shaping: ShapingPlan) -> None:
    """A plan's commands (root already deleted); on a failure nothing of it is left."""
    where = _where(netns_path, interface)
    _clear_downlink(netns_path, interface)
    try:
        for argv in tc_argv(interface, shaping):
            _run_tc(netns_path, argv, where, "shaping")
    except ShapingError:
        with contextlib.suppress(ShapingError):  # leave no half-shaped link behind
            _run_tc(netns_path, clear_argv(interface), where, "clearing")
        _clear_downlink(netns_path, interface)
        raise
    if shaping.has_downlink:
        set_offloads(netns_path, ifb_name(interface))


def _clear_downlink(netns_path: str | None, interface: str) -> None:
    for argv in downlink_clear_argv(interface):
        with contextlib.suppress(ShapingError):  # absent: nothing to remove
            _run_tc(netns_path, argv, _where(netns_path, interface), "clearing", quiet=True)


def _run_tc(
    netns_path: str | None, argv: list[str], where: str, doing: str, quiet: bool = False
) -> str:
    """One `tc` or `ip` command in the namespace; ShapingError with its stderr on failure."""
    return run_checked(in_netns(netns_path, argv), where, doing, quiet=quiet)


def qdisc_stats(netns_path: str | None, interface: str) -> str:
    """The text of `tc -s qdisc show dev <interface>` inside the namespace, for the results,
    followed by its ifb's (the downlink's shaper) when it has one."""
    text = _show_qdiscs(netns_path, interface)
    ifb = ifb_name(interface)
    with contextlib.suppress(ShapingError):  # no ifb: no downlink shaped
        text += f"downlink ({ifb}):\n" + _show_qdiscs(netns_path, ifb, quiet=True)
    return text


def _show_qdiscs(netns_path: str | None, interface: str, quiet: bool = False) -> str:
    argv = ["tc", "-s", "qdisc", "show", "dev", interface]
    return _run_tc(
        netns_path, argv, _where(netns_path, interface), "reading qdisc statistics", quiet
    )


def set_offloads(netns_path: str | None, interface: str) -> bool:
    """Turns GSO/TSO/GRO off; a missing or failing ethtool is a warning. True when done."""
    where = _where(netns_path, interface)
    argv = in_netns(netns_path, offload_argv(interface))
    missing = [tool for tool in (argv[0], "ethtool") if shutil.which(tool) is None]
    if missing:
        log.warning("%s: offloads left on: %s not installed", where, " and ".join(missing))
        return False
    try:
        run_checked(argv, where, "turning offloads off")
    except ShapingError as error:
        log.warning("%s", error)
        return False
    return True


def _where(netns_path: str | None, interface: str) -> str:
    return f"interface {interface} in netns {netns_path or '(host)'}"


@contextlib.contextmanager
def _netlink(netns_path: str | None, interface: str) -> Iterator[tuple[Any, type, int]]:
    """An IPRoute in the namespace (never creating one), its error type, the interface index."""
    where = _where(netns_path, interface)
    try:
        from pyroute2 import IPRoute, NetlinkError
    except ImportError as error:
        raise ShapingError(f"{where}: cannot shape without pyroute2 ({error})") from None
    try:
        ipr = IPRoute() if netns_path is None else IPRoute(netns=netns_path, flags=0)
    except OSError as error:
        raise ShapingError(f"{where}: cannot enter the network namespace ({error})") from None
    try:
        indices = ipr.link_lookup(ifname=interface)
        if not indices:
            raise ShapingError(f"{where}: no such interface")
        yield ipr, NetlinkError, indices[0]
    finally:
        ipr.close()


def _delete_root(ipr: Any, netlink_error: type, index: int, where: str, interface: str) -> None:
    log.debug("%s: %s", where, " ".join(clear_argv(interface)))
    try:
        ipr.tc("del", index=index, parent=ROOT)
    except netlink_error as error:
        # ENOENT/EINVAL: only the kernel's default qdisc is there, nothing of ours to remove
        if getattr(error, "code", None) not in (errno.ENOENT, errno.EINVAL):
            raise ShapingError(f"{where}: removing the root qdisc failed: {error}") from None
