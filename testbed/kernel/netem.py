"""netem, a link's impairments as the kernel's qdisc (pure, no kernel): delay, jitter and its
distribution, loss (random, Gilbert-Elliott or 4-state), duplication and reordering, with
their correlations, as the `tc qdisc add ... netem` command that asks for them
(tc-netem(8); the parameters are checked by `testbed.experiment.netem_parameters`).

netem sits under the root tbf (class 1:1) for an uplink, as the leaf of an htb class for a
pair's hop (`testbed.kernel.htb`), and on the ifb for a downlink, under its tbf or as its
root where the downlink has no rate of its own; a kernel without `sch_netem` cannot have it
(`testbed.kernel.shaping.check_support` says so rather than dropping the impairment). The
command goes through `tc` (it names distribution tables, which pyroute2 cannot load). No
kernel of this project's machines has `sch_netem`: the commands are held against Debian's
kernel in the netem reference guest (`checks.guest`,
tests/integration/test_netem_guest.py), which reports every parameter back as asked. netem
draws from the kernel's own generator; a `tc` that takes netem's `seed` (iproute2 6.5 and
later, on a kernel that reads it) is given the hop's seed (`NetemParams.seed`), else its
realisation is not repeatable, unlike the serial emulator's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from testbed.experiment.netem_parameters import checked, impaired
from testbed.kernel.tbf import ETHERNET_FRAME_BYTES, TbfParams

NETEM_DEFAULT_LIMIT_PACKETS = 1000  # the kernel's own default


@dataclass(frozen=True)
class LinkImpairments:
    """What a link asks netem for, as its caller builds it from the user's profile: netem's
    parameters (`testbed.experiment.netem_parameters` names them; none: an ideal link), and the
    name that errors and the saved plan give them (the profile's)."""

    name: str
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NetemParams:
    limit_packets: int
    impairments: dict[str, Any] = field(default_factory=dict)  # checked, defaults filled
    seed: int | None = None  # netem's generator's, where tc takes one (`tc_takes_netem_seed`)

    @property
    def delay_us(self) -> int:
        return round(self.impairments["delay_ms"] * 1000)

    @property
    def jitter_us(self) -> int:
        return round(self.impairments["jitter_ms"] * 1000)


def netem_params(
    impairments: LinkImpairments, tbf: TbfParams | None = None, mtu: int = ETHERNET_FRAME_BYTES
) -> NetemParams | None:
    """netem parameters for a link's impairments, or None when it has none.

    Under tbf, netem's queue replaces tbf's byte-limited fifo, so its packet limit is set to
    keep tbf's latency bound: tbf's byte limit plus what the delay (and jitter) keeps in
    flight, in full frames. Without `tbf` the kernel's default of 1000 packets is kept.
    """
    queue = None if tbf is None else (tbf.rate_bit_s, tbf.limit_bytes)
    return netem_for(impairments.parameters, queue, mtu)


def netem_for(
    parameters: Mapping[str, Any],
    queue: tuple[int, int] | None = None,
    mtu: int = ETHERNET_FRAME_BYTES,
) -> NetemParams | None:
    """netem parameters for netem's parameters (as a profile or a hop names them), or None
    when they impair nothing. Where netem replaces a shaper's queue, `queue` is that
    shaper's (rate bit/s, limit bytes), and netem's limit keeps its latency bound: the
    shaper's bytes plus what the delay (and jitter) keeps in flight at the rate, in full
    frames. Without one the kernel's default of 1000 packets is kept."""
    values = checked(parameters)
    if not impaired(values):
        return None
    return NetemParams(_limit_packets(values, queue, mtu), values)


def netem_idle(
    queue: tuple[int, int] | None = None, mtu: int = ETHERNET_FRAME_BYTES
) -> NetemParams:
    """A netem that impairs nothing, only queues (`queue` as `netem_for`'s): what a link whose
    netem is in the kernel gets for a trace's step without impairments, so that the step
    after it changes that netem in place."""
    values = checked({})
    return NetemParams(_limit_packets(values, queue, mtu), values)


def _limit_packets(values: dict[str, Any], queue: tuple[int, int] | None, mtu: int) -> int:
    if queue is None:
        return NETEM_DEFAULT_LIMIT_PACKETS
    rate_bit_s, limit_bytes = queue
    flight_ms = values["delay_ms"] + values["jitter_ms"]
    in_flight_bytes = rate_bit_s / 8 * flight_ms / 1000
    return math.ceil((limit_bytes + in_flight_bytes) / mtu)


def netem_argv(
    interface: str,
    netem: NetemParams,
    parent: str = "1:1",
    handle: str = "10:",
    action: str = "add",
) -> list[str]:
    """netem as a `tc qdisc add|change|replace` command, by default under the root tbf's
    class 1:1; `parent` "root" makes it the interface's root qdisc. Every parameter is
    written, so a `change` sets each one (a left-out one is 0), except the distribution:
    netem keeps its table until another is named."""
    where = ["root"] if parent == "root" else ["parent", parent]
    argv = ["tc", "qdisc", action, "dev", interface, *where, "handle", handle, "netem"]
    seed = [] if netem.seed is None else ["seed", str(netem.seed)]
    return argv + ["limit", str(netem.limit_packets)] + netem_options(netem.impairments) + seed


def tc_takes_netem_seed(usage: str) -> bool:
    """Whether a `tc` takes netem's `seed`, from what `TC_SEED_PROBE_ARGV` printed (tc reads
    its words before asking the kernel: "help" stops it either way, and an unknown `seed` is
    named first)."""
    return 'What is "seed"' not in usage and "Usage" in usage


# tc parses netem's options and stops at "help": no qdisc is added, no kernel is asked
TC_SEED_PROBE_ARGV = ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "seed", "1", "help"]


def netem_options(values: dict[str, Any]) -> list[str]:
    """tc's words for checked impairments, in tc-netem(8)'s order.

    iproute2 6.1's `tc` sends netem's correlations (TCA_NETEM_CORR, the duplication's among
    them) only when it has read a delay or a random loss correlation: `duplicate 10% 50%`
    alone reaches the kernel as `duplicate 10%`. A duplication correlation without either is
    therefore carried by a delay correlation of 0% (`delay D 0ms 0%`, or `delay 0ms 0ms 0%`),
    which changes nothing: netem draws a correlation of 0 independently, and a jitter of 0
    leaves the delay as it is."""
    words: list[str] = []
    carried = bool(
        values["duplicate_pct"]
        and values["duplicate_correlation_pct"]
        and not (values["jitter_ms"] and values["delay_correlation_pct"])
        and not (
            values["loss_model"] == "random"
            and values["loss_pct"]
            and values["loss_correlation_pct"]
        )
    )
    if values["delay_ms"] or values["jitter_ms"] or carried:
        words += ["delay", _tc_time(values["delay_ms"])]
        if values["jitter_ms"] or carried:
            words.append(_tc_time(values["jitter_ms"]))
            if values["delay_correlation_pct"] or carried:
                words.append(_pct(values["delay_correlation_pct"]))
        if values["delay_distribution"] != "uniform":
            words += ["distribution", values["delay_distribution"]]
    words += _loss(values)
    if values["duplicate_pct"]:
        words += ["duplicate", _pct(values["duplicate_pct"])]
        if values["duplicate_correlation_pct"]:
            words.append(_pct(values["duplicate_correlation_pct"]))
    if values["reorder_pct"]:
        words += ["reorder", _pct(values["reorder_pct"])]
        if values["reorder_correlation_pct"]:
            words.append(_pct(values["reorder_correlation_pct"]))
        words += ["gap", str(values["reorder_gap"])]
    return words


def _loss(values: dict[str, Any]) -> list[str]:
    if values["loss_model"] == "gemodel":
        ge = values["loss_gemodel"]
        keys = ("p_pct", "r_pct", "one_minus_h_pct", "one_minus_k_pct")
        return ["loss", "gemodel", *(_pct(ge[key]) for key in keys)]
    if values["loss_model"] == "state":
        state = values["loss_state"]
        keys = ("p13_pct", "p31_pct", "p32_pct", "p23_pct", "p14_pct")
        return ["loss", "state", *(_pct(state[key]) for key in keys)]
    if not values["loss_pct"]:
        return []
    words = ["loss", "random", _pct(values["loss_pct"])]
    if values["loss_correlation_pct"]:
        words.append(_pct(values["loss_correlation_pct"]))
    return words


def _pct(value: float) -> str:
    return f"{value:g}%"


def _tc_time(milliseconds: float) -> str:
    microseconds = round(milliseconds * 1000)
    if microseconds % 1000 == 0:
        return f"{microseconds // 1000}ms"
    return f"{microseconds}us"


@dataclass(frozen=True)
class NetemCounters:
    """What an interface's netem qdiscs did so far, by their statistics (`tc -s qdisc show`):
    the packets they let through (sent on, or held in their queue) and those they dropped.
    The kernel counts a loss draw and a full queue's drop alike, and neither a duplicate nor
    a reordering at all."""

    passed: int
    dropped: int


NETEM_STATISTICS = re.compile(
    r"^qdisc netem .*\n\s*Sent \d+ bytes (?P<sent>\d+) pkt \(dropped (?P<dropped>\d+),.*\n"
    r"\s*backlog \S+ (?P<backlog>\d+)p",
    re.M,
)


def netem_counters(text: str) -> NetemCounters | None:
    """The netem qdiscs' counters, summed, in the `tc -s qdisc show` text of one interface (a
    `downlink (...)` section after it, `testbed.kernel.netlink.qdisc_stats`'s, is not this
    interface's); None where it has no netem."""
    own = text.split("\ndownlink (", 1)[0]
    found = list(NETEM_STATISTICS.finditer(own))
    if not found:
        return None
    return NetemCounters(
        passed=sum(int(m["sent"]) + int(m["backlog"]) for m in found),
        dropped=sum(int(m["dropped"]) for m in found),
    )
