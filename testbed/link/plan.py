"""A shaping plan: a profile and a rate become one interface's qdiscs (pure, no kernel).

The link code follows pyroute2's own `sched_*` modules:

- Parameter builders are pure functions, one module per qdisc kind (`testbed.link.tbf`,
  `testbed.link.netem`), combined here: a plan is a root `tbf` (the rate) plus, only when the
  profile asks for delay, jitter or loss, a `netem` child under it (tbf class 1:1). No root,
  no kernel, unit-tested.
- The capability probe (`testbed.link.support.qdisc_support`) tries each qdisc once in a
  throwaway namespace. A plan that needs netem on a kernel without `sch_netem` fails with a
  message saying so: the impairment is never dropped silently.
- Applying (`testbed.link.netlink`: `apply`, `change`, `clear`, `qdisc_stats`) is a thin
  layer: pyroute2 inside the device's network namespace, `ethtool` and `tc` through `nsenter`
  (argument lists, never a shell).

Egress only: each device shapes what it sends. Rates follow tc's convention (1 mbit = 10^6
bit/s) and count whole link-layer frames (Ethernet header included), so TCP payload goodput is
about MSS / (MTU + 14) of the rate (1448 / 1514, 95.6 %, at MTU 1500 with TCP timestamps).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from testbed.errors import ShapingError
from testbed.link.netem import NetemParams, netem_argv, netem_keywords, netem_params
from testbed.link.tbf import TbfParams, tbf_argv, tbf_keywords, tbf_params
from testbed.profiles import LinkProfile


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
    commands = [tbf_argv(interface, shaping.tbf)]
    if shaping.netem is not None:
        commands.append(netem_argv(interface, shaping.netem))
    return commands


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
    commands = tc_argv(interface, shaping)
    requests = [("adding the tbf root qdisc", commands[0], "tbf", tbf_keywords(shaping.tbf))]
    if shaping.netem is not None:
        keywords = netem_keywords(shaping.netem)
        requests.append(("adding the netem qdisc under tbf", commands[1], "netem", keywords))
    return requests
