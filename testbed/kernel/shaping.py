"""A shaping plan: a rate and netem's parameters become one interface's qdiscs (pure, no kernel).

The link code follows pyroute2's own `sched_*` modules:

- Parameter builders are pure functions, one module per qdisc kind (`testbed.kernel.tbf`,
  `netem`, `htb`, `fifo`, `u32`, `ingress`, `ifb`), combined here: a plan is a root `tbf`
  (the uplink) plus, only when the profile asks for delay, jitter or loss, a `netem` child
  under it (tbf class 1:1). With per-peer caps the root is an `htb` instead, one class per
  capped peer picked by `u32` on the destination. With a downlink rate the interface's
  `ingress` qdisc redirects everything it receives to an `ifb`, whose root tbf is the
  downlink. No root, no kernel, unit-tested.
- The later hops (`testbed.link.paths`) where netem can be had: a pair's impairments are a
  netem as the leaf of the sender's htb class for that peer (a class of the uplink's rate
  where the pair has no cap), a downlink's a netem on the receiver's ifb, under its tbf or
  as its root. So a frame from s to d meets s's uplink rate, then the pair's netem, then d's
  downlink, as on the serial emulator; unlike there, the uplink's own impairments cannot sit
  beside per-peer classes (the htb has no single queue for them to be), and are refused
  with them.
- The capability probe (`testbed.kernel.support.qdisc_support`) tries each qdisc once in a
  throwaway namespace. A plan that needs netem on a kernel without `sch_netem` fails with a
  message saying so: the impairment is never dropped silently.
- Applying (`testbed.kernel.netlink`: `apply`, `change`, `clear`, `qdisc_stats`) is a thin
  layer: pyroute2 inside the device's network namespace, `ethtool` and `tc` through `nsenter`
  (argument lists, never a shell).

Each device shapes what it sends (and, with a downlink rate, what it receives). Rates follow
tc's convention (1 mbit = 10^6 bit/s) and count whole link-layer frames (Ethernet header
included), so TCP payload goodput is about MSS / (MTU + 14) of the rate (1448 / 1514, 95.6 %,
at MTU 1500 with TCP timestamps).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from testbed.errors import ShapingError
from testbed.kernel.htb import (
    PEER_MINOR_BASE,
    HtbClass,
    HtbParams,
    htb_argv,
    htb_change_argv,
    htb_params,
)
from testbed.kernel.ifb import ifb_add_argv, ifb_del_argv, ifb_name, ifb_up_argv
from testbed.kernel.ingress import ingress_argv, ingress_clear_argv
from testbed.kernel.netem import (
    LinkImpairments,
    NetemParams,
    netem_argv,
    netem_for,
    netem_idle,
    netem_params,
)
from testbed.kernel.tbf import (
    ETHERNET_FRAME_BYTES,
    QUEUE_LATENCY_MS,
    TbfParams,
    tbf_argv,
    tbf_keywords,
    tbf_params,
)
from testbed.kernel.u32 import u32_redirect_argv


@dataclass(frozen=True)
class ShapingPlan:
    """What one interface gets: a root tbf and, if needed, a netem child; or, with per-peer
    caps or pair impairments, a root htb (`htb`, whose uplink class replaces the tbf) whose
    impaired peers' leaves are netems (`peer_netem`, by class minor); and, with a downlink
    rate or impairments, an ifb with a tbf at that rate (`downlink`) and a netem
    (`downlink_netem`)."""

    profile_name: str
    rate_mbit: float
    tbf: TbfParams
    netem: NetemParams | None = None
    htb: HtbParams | None = None
    downlink: TbfParams | None = None
    downlink_netem: NetemParams | None = None
    peer_netem: dict[int, NetemParams] = field(default_factory=dict)

    @property
    def needs_netem(self) -> bool:
        return self.netem is not None or self.downlink_netem is not None or bool(self.peer_netem)

    @property
    def has_downlink(self) -> bool:
        """Whether what the interface receives is shaped or impaired (an ifb)."""
        return self.downlink is not None or self.downlink_netem is not None

    @property
    def uplink_only(self) -> bool:
        """Whether only what the interface sends is shaped: no per-peer classes, no ifb."""
        return self.htb is None and not self.has_downlink

    @property
    def is_tbf_only(self) -> bool:
        """A root tbf alone: applied through pyroute2; every other plan goes as `tc` argv."""
        return self.uplink_only and self.netem is None

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain data, to be saved with the results."""
        return asdict(self)


@dataclass(frozen=True)
class Hops:
    """What an interface's plan holds beyond its uplink's rate and impairments: per peer, a
    cap (`peer_caps_mbit`, {peer rank: (its address, cap)}) and netem's parameters
    (`peer_impairments`, {peer rank: (its address, parameters)}), both inside the uplink (a
    root htb); and what the interface receives, shaped at `downlink_mbit` and impaired by
    `downlink_impairments` (an ifb)."""

    peer_caps_mbit: Mapping[int, tuple[str, float]] = field(default_factory=dict)
    peer_impairments: Mapping[int, tuple[str, Mapping[str, Any]]] = field(default_factory=dict)
    downlink_mbit: float | None = None
    downlink_impairments: Mapping[str, Any] | None = None


def plan(
    impairments: LinkImpairments,
    rate_mbit: float,
    support: Mapping[str, bool] | None = None,
    hops: Hops | None = None,
    queue_latency_ms: float = QUEUE_LATENCY_MS,
    burst_bytes: int | None = None,
) -> ShapingPlan:
    """The shaping plan for a link's uplink `impairments` at a rate, with its `hops` (None:
    the uplink alone). `queue_latency_ms` and `burst_bytes` bound every tbf's queue and bucket
    (`tbf_params`). When `support` (as from `qdisc_support()`) is given, the plan is checked
    against it.
    """
    hops = hops or Hops()
    tbf = tbf_params(rate_mbit, queue_latency_ms=queue_latency_ms, burst_bytes=burst_bytes)
    netem = netem_params(impairments, tbf)
    htb, peer_netem = None, {}
    if hops.peer_caps_mbit or hops.peer_impairments:
        htb, peer_netem = _pairs(
            impairments.name,
            rate_mbit,
            netem,
            hops.peer_caps_mbit or {},
            hops.peer_impairments or {},
            queue_latency_ms,
        )
    downlink = None
    if hops.downlink_mbit is not None:
        downlink = tbf_params(
            hops.downlink_mbit, queue_latency_ms=queue_latency_ms, burst_bytes=burst_bytes
        )
    downlink_netem = None
    if hops.downlink_impairments:
        queue = None if downlink is None else (downlink.rate_bit_s, downlink.limit_bytes)
        downlink_netem = netem_for(hops.downlink_impairments, queue)
    shaping = ShapingPlan(
        impairments.name, float(rate_mbit), tbf, netem, htb, downlink, downlink_netem, peer_netem
    )
    if support is not None:
        check_support(shaping, support)
    return shaping


def duplicating_peer(peer_impairments: Mapping[int, Mapping[str, Any]]) -> int | None:
    """Of one sender's peers' impairments (netem leaves of one htb tree), the first peer whose
    netem duplicates frames beside another impaired peer's: the kernel refuses a duplicating
    netem beside any other netem in one tree (Debian's 6.1.192: "cannot mix duplicating
    netems with other netems in tree"). None where there is none."""
    impairing = {r: hop for r, p in peer_impairments.items() if (hop := netem_for(p)) is not None}
    if len(impairing) < 2:
        return None
    return next((r for r, hop in impairing.items() if hop.impairments["duplicate_pct"]), None)


def _pairs(
    name: str,
    rate_mbit: float,
    netem: NetemParams | None,
    peer_caps_mbit: Mapping[int, tuple[str, float]],
    peer_impairments: Mapping[int, tuple[str, Mapping[str, Any]]],
    queue_latency_ms: float,
) -> tuple[HtbParams | None, dict[int, NetemParams]]:
    """The root htb of capped and impaired peers (None: neither) and its netem leaves."""
    impaired_peers = {
        rank: (address, hop)
        for rank, (address, parameters) in peer_impairments.items()
        if (hop := netem_for(parameters)) is not None
    }
    if not (peer_caps_mbit or impaired_peers):
        return None, {}
    if netem is not None:
        field_name = "link.pair_mbit" if peer_caps_mbit else "link.pair_impairments"
        raise ShapingError(
            f"profile '{name}': delay, jitter or loss together with per-pair "
            f"classes ({field_name}) is not supported on tbf; use a rate-only profile "
            "or the serial emulator"
        )
    duplicating = duplicating_peer({rank: p for rank, (_, p) in peer_impairments.items()})
    if duplicating is not None:
        raise ShapingError(
            f"link.pair_impairments: the pair to device {duplicating} duplicates frames "
            "beside other pairs' impairments of the same sender; the kernel refuses a "
            "duplicating netem beside any other netem in one tree (recent kernels, Debian's "
            "6.1.192 among them); use the serial emulator"
        )
    caps = {rank: (address, float(rate_mbit)) for rank, (address, _) in impaired_peers.items()}
    caps.update(peer_caps_mbit)
    htb = htb_params(rate_mbit, caps, queue_latency_ms)
    peer_netem = {
        PEER_MINOR_BASE + rank: _leaf_netem(impaired_peers[rank][1], htb, rank)
        for rank in sorted(impaired_peers)
    }
    return htb, peer_netem


def _leaf_netem(hop: NetemParams, htb: HtbParams, rank: int) -> NetemParams:
    """A pair's netem as its class's leaf: the class's pfifo limit plus what its delay keeps
    in flight at the class's ceil."""
    klass = next(k for k in htb.peers if k.minor == PEER_MINOR_BASE + rank)
    queue = (klass.ceil_bit_s, klass.limit_packets * ETHERNET_FRAME_BYTES)
    netem = netem_for(hop.impairments, queue)
    assert netem is not None
    return netem


def check_support(shaping: ShapingPlan, support: Mapping[str, bool]) -> None:
    """Raises ShapingError when the kernel lacks a qdisc the plan needs."""
    if not support.get("tbf", False):
        raise ShapingError("this kernel has no tbf qdisc (sch_tbf): links cannot be rate-limited")
    if shaping.htb is not None and not support.get("htb", False):
        raise ShapingError("this kernel has no htb qdisc (sch_htb): per-pair rates need it")
    if shaping.has_downlink and not support.get("ingress", False):
        raise ShapingError("this kernel has no ingress qdisc (sch_ingress): downlink rates need it")
    if shaping.needs_netem and not support.get("netem", False):
        what = f"profile '{shaping.profile_name}'" if shaping.netem else "a downlink or a pair"
        raise ShapingError(
            f"{what} needs netem's impairments (sch_netem), which this kernel does not have; "
            "the serial emulator draws them itself"
        )


def tc_argv(interface: str, shaping: ShapingPlan) -> list[list[str]]:
    """The plan as `tc` commands, for hosts that cannot enter the namespace and for logs.

    Such a host also runs `gso_argv` and `offload_argv` first, as `apply` does. The root is a
    `replace`, so the commands work on an interface with the default qdisc. An
    earlier plan's netem child survives a `replace` of the root tbf (tbf keeps a child that is
    not a fifo): when changing a plan, run `clear_argv` first (it fails harmlessly when the
    interface has no root qdisc of its own), and `downlink_clear_argv` before a plan with a
    downlink.
    """
    if shaping.htb is not None:
        commands = htb_argv(interface, shaping.htb, _peer_leaves(interface, shaping))
    else:
        commands = [tbf_argv(interface, shaping.tbf)]
    if shaping.netem is not None:
        commands.append(netem_argv(interface, shaping.netem))
    if shaping.has_downlink:
        commands += downlink_argv(interface, shaping.downlink, shaping.downlink_netem)
    return commands


def _peer_leaves(interface: str, shaping: ShapingPlan) -> Any:
    """The htb leaves that are a pair's netem, as htb_argv's `leaf`."""

    def leaf(klass: HtbClass, action: str) -> list[str] | None:
        netem = shaping.peer_netem.get(klass.minor)
        if netem is None:
            return None
        return netem_argv(interface, netem, f"1:{klass.minor:x}", f"{klass.minor:x}:", action)

    return leaf


def downlink_argv(
    interface: str, downlink: TbfParams | None, netem: NetemParams | None = None
) -> list[list[str]]:
    """An ifb, everything `interface` receives redirected to it; its root tbf the downlink
    and netem under it, or netem as its root where the downlink has no rate."""
    ifb = ifb_name(interface)
    commands = [
        ifb_add_argv(ifb),
        ifb_up_argv(ifb),
        ingress_argv(interface),
        u32_redirect_argv(interface, ifb),
    ]
    if downlink is not None:
        commands.append(tbf_argv(ifb, downlink))
    if netem is not None:
        commands.append(
            netem_argv(ifb, netem, "1:1" if downlink else "root", "10:" if downlink else "1:")
        )
    return commands


def downlink_clear_argv(interface: str) -> list[list[str]]:
    """The ingress qdisc and the ifb removed (each fails harmlessly when absent)."""
    return [ingress_clear_argv(interface), ifb_del_argv(ifb_name(interface))]


def clear_argv(interface: str) -> list[str]:
    """The `tc` command that removes the interface's root qdisc (and its children)."""
    return ["tc", "qdisc", "del", "dev", interface, "root"]


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
    return _as_change(tbf_argv(interface, shaping.tbf))


def change_argvs(interface: str, shaping: ShapingPlan) -> list[list[str]]:
    """An applied plan changed in place, as `tc ... change` commands: the root tbf and the
    uplink's netem under it (a `replace`: added where the applied plan had none, changed
    where it had), or the htb classes with their queues, and the downlink's tbf and netem on
    the ifb. A trace's step so carries its delay and loss to the kernel with its rate. The
    plan's layout (its peers, whether it has a downlink) must be the applied one's; a step
    without impairments after one with them keeps an idle netem (`keeping_netem`)."""
    if shaping.htb is not None:
        commands = htb_change_argv(interface, shaping.htb, _peer_leaves(interface, shaping))
    else:
        commands = [change_argv(interface, shaping)]
        if shaping.netem is not None:
            commands.append(netem_argv(interface, shaping.netem, action="replace"))
    if shaping.downlink is not None:
        ifb = ifb_name(interface)
        commands.append(_as_change(tbf_argv(ifb, shaping.downlink)))
        if shaping.downlink_netem is not None:  # its limit follows the rate
            commands.append(netem_argv(ifb, shaping.downlink_netem, action="change"))
    return commands


def keeping_netem(shaping: ShapingPlan) -> ShapingPlan:
    """The plan with an idle netem under its root tbf where it has none: for a link whose
    netem is in the kernel, a step without impairments sets every one of them to nothing
    (`change_argvs`) rather than leaving the last step's in force."""
    if shaping.netem is not None or shaping.htb is not None:
        return shaping
    queue = (shaping.tbf.rate_bit_s, shaping.tbf.limit_bytes)
    return replace(shaping, netem=netem_idle(queue))


def _as_change(replace_argv: list[str]) -> list[str]:
    return [*replace_argv[:2], "change", *replace_argv[3:]]


def netlink_requests(
    interface: str, shaping: ShapingPlan
) -> list[tuple[str, list[str], str, dict[str, Any]]]:
    """The plan as pyroute2 `tc("add", kind, index, **keywords)` calls, in order.

    Each entry is (what it does, the equivalent tc command, qdisc kind, keywords).
    """
    commands = tc_argv(interface, shaping)
    return [("adding the tbf root qdisc", commands[0], "tbf", tbf_keywords(shaping.tbf))]
