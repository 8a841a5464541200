"""Link shaping: a profile and a rate become qdisc parameters, and those become kernel state.

Three layers, as in pyroute2's own `sched_*` modules:

- Parameter builders (`tbf_params`, `netem_params`, `plan`, `tc_argv`) are pure functions: no
  root, no kernel, unit-tested. A plan is a root `tbf` (the rate) plus, only when the profile
  asks for delay, jitter or loss, a `netem` child under it (tbf class 1:1).
- The capability probe (`qdisc_support`) tries each qdisc once in a throwaway namespace. A plan
  that needs netem on a kernel without `sch_netem` fails with a message saying so: the
  impairment is never dropped silently.
- Applying (`apply`, `clear`, `qdisc_stats`) is a thin layer: pyroute2 inside the device's
  network namespace, `ethtool` and `tc` through `nsenter` (argument lists, never a shell).
  A shaped interface also gets offloads off and `gso_max_segs 1`, so that tbf meters, queues
  and drops real frames (see `gso_argv` for what goes wrong otherwise).

Egress only: each device shapes what it sends. Rates follow tc's convention (1 mbit = 10^6
bit/s) and count whole link-layer frames (Ethernet header included), so TCP payload goodput is
about MSS / (MTU + 14) of the rate (1448 / 1514, 95.6 %, at MTU 1500 with TCP timestamps).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from testbed.errors import ShapingError
from testbed.profiles import LinkProfile

log = logging.getLogger(__name__)

BIT_PER_MBIT = 1_000_000  # tc's `mbit`
ETHERNET_FRAME_BYTES = 1514  # MTU 1500 + 14 bytes of Ethernet header, as tbf counts a packet
MIN_BURST_FRAMES = 2  # the bucket: what a message gets through at once
NETEM_DEFAULT_LIMIT_PACKETS = 1000  # the kernel's own default

TBF_HANDLE = 0x10000  # "1:"
TBF_CLASS = 0x10001  # "1:1", where tbf keeps its single child
NETEM_HANDLE = 0x100000  # "10:"
ROOT = 0xFFFFFFFF
PROBED_QDISCS = ("tbf", "htb", "netem", "ingress")


@dataclass(frozen=True)
class TbfParams:
    rate_bit_s: int
    burst_bytes: int
    limit_bytes: int


@dataclass(frozen=True)
class NetemParams:
    delay_us: int
    jitter_us: int
    loss_pct: float
    limit_packets: int


@dataclass(frozen=True)
class ShapingPlan:
    """What one interface's egress gets: a root tbf and, if needed, a netem child."""

    profile_name: str
    rate_mbit: float
    tbf: TbfParams
    netem: NetemParams | None = None

    @property
    def needs_netem(self) -> bool:
        return self.netem is not None

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data, to be saved with the results."""
        return asdict(self)


def tbf_params(
    rate_mbit: float,
    mtu: int = ETHERNET_FRAME_BYTES,
    queue_latency_ms: float = 50.0,
    burst_bytes: int | None = None,
) -> TbfParams:
    """Token-bucket parameters for a rate.

    The burst (bucket size) is `MIN_BURST_FRAMES` full frames unless a larger one is asked
    for. It is what tbf lets through at once after an idle gap, where a real link would
    serialise every byte at the rate: a bucket of rate / HZ bytes (the old tc-tbf rule of
    thumb, 10 KB at 20 Mbit/s on a HZ = 250 kernel) let two thirds of a 15 KB message through
    at once and Prism's messages crossed in half their time. tbf's watchdog is an hrtimer, so
    a two-frame bucket still holds the rate (measured here: within 0.1% at 1-20 Mbit/s).

    The queue limit holds `queue_latency_ms` of traffic at the rate plus the burst, as tc's
    `latency` option computes it: a packet waits at most that long in the shaper.

    Args:
        rate_mbit: rate in tc's mbit (10^6 bit/s) of link-layer frames.
        mtu: the largest frame, link-layer header included.
        queue_latency_ms: the latency bound that sets the queue limit.
        burst_bytes: a bucket size asked for explicitly (raised to the floor).
    """
    if rate_mbit <= 0:
        raise ShapingError(f"a shaped rate must be positive, got {rate_mbit} mbit")
    rate_bit_s = round(rate_mbit * BIT_PER_MBIT)
    rate_bytes_s = rate_bit_s / 8
    burst = max(burst_bytes or 0, MIN_BURST_FRAMES * mtu)
    limit = math.ceil(rate_bytes_s * queue_latency_ms / 1000) + burst
    return TbfParams(rate_bit_s=rate_bit_s, burst_bytes=burst, limit_bytes=limit)


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


def plan(
    profile: LinkProfile,
    rate_mbit: float | None = None,
    support: Mapping[str, bool] | None = None,
) -> ShapingPlan:
    """The shaping plan for a profile at a rate (the profile's own rate when None).

    When `support` (as from `qdisc_support()`) is given, the plan is checked against it.
    """
    rate = rate_mbit if rate_mbit is not None else profile.rate_mbit
    if rate is None:
        raise ShapingError(f"profile '{profile.name}' has no rate_mbit and no rate was given")
    tbf = tbf_params(
        rate, queue_latency_ms=profile.queue_latency_ms, burst_bytes=profile.burst_bytes
    )
    shaping = ShapingPlan(profile.name, float(rate), tbf, netem_params(profile, tbf))
    if support is not None:
        check_support(shaping, support)
    return shaping


def check_support(shaping: ShapingPlan, support: Mapping[str, bool]) -> None:
    """Raises ShapingError when the kernel lacks a qdisc the plan needs."""
    if not support.get("tbf", False):
        raise ShapingError("this kernel has no tbf qdisc (sch_tbf): links cannot be rate-limited")
    if shaping.needs_netem and not support.get("netem", False):
        raise ShapingError(
            f"profile '{shaping.profile_name}' needs delay/jitter/loss emulation (sch_netem), "
            "which this kernel does not have; use a rate-only profile such as 'ideal'"
        )


def tc_argv(interface: str, shaping: ShapingPlan) -> list[list[str]]:
    """The plan as `tc` commands, for hosts that cannot enter the namespace and for logs.

    Such a host also runs `gso_argv` and `offload_argv` first, as `apply` does. The root is a
    `replace`, so the commands work on an interface with the default qdisc. An
    earlier plan's netem child survives a `replace` of the root tbf (tbf keeps a child that is
    not a fifo): when changing a plan, run `clear_argv` first (it fails harmlessly when the
    interface has no root qdisc of its own).
    """
    tbf = shaping.tbf
    commands = [
        ["tc", "qdisc", "replace", "dev", interface, "root", "handle", "1:", "tbf"]
        + ["rate", f"{tbf.rate_bit_s}bit", "burst", str(tbf.burst_bytes)]
        + ["limit", str(tbf.limit_bytes)]
    ]
    if shaping.netem is not None:
        commands.append(_netem_argv(interface, shaping.netem))
    return commands


def _netem_argv(interface: str, netem: NetemParams) -> list[str]:
    argv = ["tc", "qdisc", "add", "dev", interface, "parent", "1:1", "handle", "10:", "netem"]
    argv += ["limit", str(netem.limit_packets)]
    if netem.delay_us or netem.jitter_us:
        argv += ["delay", _tc_time(netem.delay_us)]
        if netem.jitter_us:
            argv.append(_tc_time(netem.jitter_us))
    if netem.loss_pct:
        argv += ["loss", f"{netem.loss_pct:g}%"]
    return argv


def _tc_time(microseconds: int) -> str:
    if microseconds % 1000 == 0:
        return f"{microseconds // 1000}ms"
    return f"{microseconds}us"


def clear_argv(interface: str) -> list[str]:
    """The `tc` command that removes the interface's root qdisc (and its children)."""
    return ["tc", "qdisc", "del", "dev", interface, "root"]


def offload_argv(interface: str) -> list[str]:
    """The `ethtool` command that turns segmentation and receive offloads off (GSO/TSO/GRO)."""
    return ["ethtool", "-K", interface, "gso", "off", "tso", "off", "gro", "off"]


def gso_argv(interface: str) -> list[str]:
    """The `ip` command that makes TCP hand the qdisc one MSS per packet (gso_max_segs 1).

    `ethtool -K gso off` is not enough: recent kernels (6.18 here) let TCP build GSO
    super-packets whatever the device's features, and segment them after the qdisc. tbf then
    splits an oversized packet itself and, with its queue full, drops some of the segments
    without telling TCP: real losses, SACK recovery and retransmission timeouts. Measured at
    1-20 Mbit/s over 2 s bulk transfers: tens to thousands of retransmissions and rates off by
    -14 % to +6 % (BBR, this host's default) without it; no retransmission and rates within
    0.2 % (BBR and cubic) with it, as a full queue is then reported to TCP as local
    congestion. Sockets read the limit when they connect: shape before devices connect.
    """
    return ["ip", "link", "set", "dev", interface, "gso_max_segs", "1"]


# Capability probe ------------------------------------------------------------------------------


def qdisc_support() -> dict[str, bool]:
    """Which of tbf, htb, netem and ingress this kernel can attach (probed once, then cached).

    Each qdisc is added to the loopback interface of a throwaway network namespace, then
    removed with the namespace (loopback needs no module, unlike dummy, which some kernels
    lack). Raises ShapingError when the probe itself cannot run (no root, no pyroute2).
    """
    return dict(_probe_qdiscs())


@functools.cache
def _probe_qdiscs() -> tuple[tuple[str, bool], ...]:
    try:
        from pyroute2 import IPRoute, NetlinkError, netns
    except ImportError as error:
        raise ShapingError(f"cannot probe qdisc support: pyroute2 is missing ({error})") from None
    name = f"tbprobe-{os.getpid()}-{os.urandom(3).hex()}"
    try:
        netns.create(name)
    except OSError as error:
        raise ShapingError(
            f"cannot probe qdisc support: creating a netns failed ({error})"
        ) from None
    log.debug("probe: created netns %s", name)
    found: dict[str, bool] = {}
    try:
        with IPRoute(netns=name, flags=0) as ipr:
            index = ipr.link_lookup(ifname="lo")[0]
            for kind in PROBED_QDISCS:
                found[kind] = _try_qdisc(ipr, NetlinkError, index, kind)
    except OSError as error:
        raise ShapingError(f"cannot probe qdisc support in netns {name}: {error}") from None
    finally:
        try:
            netns.remove(name)
            log.debug("probe: removed netns %s", name)
        except OSError as error:
            log.warning("probe: could not remove netns %s: %s", name, error)
    log.info("qdisc support: %s", found)
    return tuple(found.items())


def _try_qdisc(ipr: Any, netlink_error: type[Exception], index: int, kind: str) -> bool:
    keywords: dict[str, Any] = {
        "tbf": {"handle": TBF_HANDLE, "rate": "1000000bit", "burst": 8000, "limit": 16000},
        "htb": {"handle": TBF_HANDLE, "default": 0},
        "netem": {"handle": TBF_HANDLE, "delay": 1000},
        "ingress": {},
    }[kind]
    try:
        ipr.tc("add", kind, index, **keywords)
    except netlink_error as error:
        code = getattr(error, "code", None)
        if code == errno.EPERM:
            raise ShapingError(f"cannot probe qdisc {kind}: permission denied") from None
        log.debug("probe: qdisc %s unavailable (%s)", kind, error)
        return False
    log.debug("probe: qdisc %s available", kind)
    try:  # the next kind is added where this one sits
        if kind == "ingress":
            ipr.tc("del", "ingress", index)
        else:
            ipr.tc("del", index=index, parent=ROOT)
    except netlink_error as error:
        raise ShapingError(f"cannot probe qdiscs: removing {kind} failed ({error})") from None
    return True


# Applying -------------------------------------------------------------------------------------


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
    re-add would let a moment of traffic through at line rate. A netem child stays."""
    where = _where(netns_path, interface)
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


def change_argv(interface: str, shaping: ShapingPlan) -> list[str]:
    """`change` as a `tc` command: the root tbf's parameters, replaced in place."""
    argv = tc_argv(interface, shaping)[0]
    return [*argv[:2], "change", *argv[3:]]


def netlink_requests(
    interface: str, shaping: ShapingPlan
) -> list[tuple[str, list[str], str, dict[str, Any]]]:
    """The plan as pyroute2 `tc("add", kind, index, **keywords)` calls, in order.

    Each entry is (what it does, the equivalent tc command, qdisc kind, keywords).
    """
    tbf = shaping.tbf
    commands = tc_argv(interface, shaping)
    tbf_keywords = {
        "handle": TBF_HANDLE,
        "rate": f"{tbf.rate_bit_s}bit",
        "burst": tbf.burst_bytes,
        "limit": tbf.limit_bytes,
    }
    requests = [("adding the tbf root qdisc", commands[0], "tbf", tbf_keywords)]
    if shaping.netem is not None:
        netem = shaping.netem
        netem_keywords = {
            "parent": TBF_CLASS,
            "handle": NETEM_HANDLE,
            "delay": netem.delay_us,
            "jitter": netem.jitter_us,
            "loss": netem.loss_pct,
            "limit": netem.limit_packets,
        }
        requests.append(("adding the netem qdisc under tbf", commands[1], "netem", netem_keywords))
    return requests


def clear(netns_path: str | None, interface: str) -> None:
    """Removes the interface's root qdisc (back to the kernel default); no error when none."""
    where = _where(netns_path, interface)
    with _netlink(netns_path, interface) as (ipr, netlink_error, index):
        _delete_root(ipr, netlink_error, index, where, interface)


def qdisc_stats(netns_path: str | None, interface: str) -> str:
    """The text of `tc -s qdisc show dev <interface>` inside the namespace, for the results."""
    where = _where(netns_path, interface)
    argv = _in_netns(netns_path, ["tc", "-s", "qdisc", "show", "dev", interface])
    log.debug("%s: %s", where, " ".join(argv))
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ShapingError(f"{where}: reading qdisc statistics failed: {error}") from None
    if result.returncode != 0:
        raise ShapingError(f"{where}: reading qdisc statistics failed: {result.stderr.strip()}")
    return result.stdout


def set_offloads(netns_path: str | None, interface: str) -> bool:
    """Turns GSO/TSO/GRO off; a missing or failing ethtool is a warning. True when done."""
    where = _where(netns_path, interface)
    argv = _in_netns(netns_path, offload_argv(interface))
    missing = [tool for tool in (argv[0], "ethtool") if shutil.which(tool) is None]
    if missing:
        log.warning("%s: offloads left on: %s not installed", where, " and ".join(missing))
        return False
    log.debug("%s: %s", where, " ".join(argv))
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("%s: turning offloads off failed: %s", where, error)
        return False
    if result.returncode != 0:
        log.warning("%s: turning offloads off failed: %s", where, result.stderr.strip())
    return result.returncode == 0


def _where(netns_path: str | None, interface: str) -> str:
    return f"interface {interface} in netns {netns_path or '(host)'}"


def _in_netns(netns_path: str | None, argv: list[str]) -> list[str]:
    return argv if netns_path is None else ["nsenter", f"--net={netns_path}", *argv]


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
