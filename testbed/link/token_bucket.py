"""The kernel's token bucket (tbf) on each device's egress: it holds a bulk rate within 0.1%,
but its bucket lets a lone small message through at line rate, faster than a real link would;
netem adds delay, jitter and loss where the kernel has `sch_netem`.

Each device's interface gets the shaping plan of its rates (`testbed.kernel.shaping`): a root
tbf at its uplink, or an htb with a class per capped or impaired peer, and an ifb with a tbf
for its downlink; netem under the tbf for the uplink's delay, jitter and loss, as a pair's
class leaf for the pair's, and on the ifb for the downlink's, where the kernel has
`sch_netem` (this project's machines have not: those commands are held against Debian's
kernel in the netem reference guest, `checks.guest`). The rates are shaped and
probed first, the netems added after the probe; a trace's step changes rates and netem in
place. The backend's traffic control (`Backend.traffic_control`) applies the plan (netlink
into the device's namespace, or tc over ssh on a board). A bucket of two frames holds a bulk
rate within 0.1 %, but lets a lone small message through at line rate.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import replace

from testbed.backends.base import Backend, Device
from testbed.errors import ShapingError
from testbed.experiment.profiles import LinkProfile
from testbed.kernel.htb import PEER_MINOR_BASE
from testbed.kernel.netem import LinkImpairments, netem_counters
from testbed.kernel.shaping import Hops, ShapingPlan, duplicating_peer, keeping_netem, plan
from testbed.link.emulator import Attachment, Emulator, LinkCounters, Refusal, qdisc_sent_bytes
from testbed.link.paths import PathImpairments
from testbed.link.rates import LinkRates
from testbed.link.serial.emulator import port_seed

log = logging.getLogger(__name__)


class TokenBucket(Emulator):
    name = "tbf"
    impairs_paths = True

    @classmethod
    def refusal(
        cls,
        profile: LinkProfile,
        backend: type[Backend],
        pair_rates: bool,
        paths: PathImpairments | None = None,
    ) -> Refusal | None:
        """Delay, jitter and loss need netem, whose uplink qdisc cannot sit beside per-pair
        classes and which this host's kernel may lack (probed where the devices share it, as
        root)."""
        if (shared := super().refusal(profile, backend, pair_rates, paths)) is not None:
            return shared
        paths = paths or PathImpairments()
        if not profile.needs_netem and not paths:
            return None
        if profile.needs_netem and (pair_rates or paths.pair):
            field = "link.pair_mbit" if pair_rates else "link.pair_impairments"
            return Refusal(
                field,
                f"per-pair {'rates' if pair_rates else 'impairments'} with profile "
                f"'{profile.name}' (delay, jitter or loss) are not supported on tbf; use a "
                "rate-only profile such as 'ideal', or the serial emulator",
            )
        if (duplicating := _duplicating_pair(paths)) is not None:
            return Refusal(
                "link.pair_impairments",
                f"the pair {duplicating[0]}->{duplicating[1]} duplicates frames beside other "
                f"pairs' impairments of device {duplicating[0]}; the kernel refuses a "
                "duplicating netem beside any other netem in one tree (recent kernels, "
                "Debian's 6.1.192 among them); use the serial emulator",
            )
        if not backend.on_this_host or os.geteuid() != 0:
            return None  # the boards' kernels, or no probe without root: checked when shaping
        from testbed.kernel.support import qdisc_support

        try:
            support = qdisc_support()
        except ShapingError as error:
            log.debug("cannot probe qdiscs before the run: %s", error)
            return None
        if support.get("netem", False):
            return None
        if not profile.needs_netem:
            field = "link.downlink_impairments" if paths.downlink else "link.pair_impairments"
            return Refusal(
                field,
                "needs netem's impairments (sch_netem), which this kernel does not have; the "
                "serial emulator draws them itself (link: {emulator: serial})",
            )
        return Refusal(
            "link.profile",
            f"'{profile.name}' needs netem's impairments (sch_netem), which this kernel does "
            "not have; the serial emulator draws them itself (link: {emulator: serial})",
        )

    def __init__(self, backend: Backend, profile: LinkProfile, run_id: str):
        super().__init__(backend, profile, run_id)
        self.applied: dict[int, ShapingPlan] = {}  # what each rank's kernel has, by rank
        self.seeded = False  # whether netem is given its seed (`start`)

    def start(self) -> dict[int, Attachment]:
        """Asks this host's `tc` whether netem takes a seed (boards' are not asked: their
        netem draws unseeded)."""
        if self.backend.on_this_host:
            from testbed.kernel.support import netem_takes_seed

            self.seeded = netem_takes_seed()
        return {}

    def set_rates(self, rates: LinkRates, in_place: bool) -> None:
        """Shaping anew gives every link its rates alone, so that the probe checks the rate
        alone (the impairments follow in `impair`); a change in place (a trace's step)
        carries the rates and the step's impairments together (`change_argvs`)."""
        plans = self._plans(rates, impaired=in_place)
        self._apply(plans, in_place, every=not in_place)

    def impair(self, rates: LinkRates, step: int = 0) -> None:
        """After the probe, the links whose plan has netems applied anew with them (a moment
        unshaped, while nothing is sent); a later `step` (a trace's, a timeline's) changed in
        place."""
        self._apply(self._plans(rates, impaired=True), in_place=step > 0, every=False)

    def counters(self) -> dict[int, LinkCounters]:
        """Bytes carried, and, on a link with a netem, its frames and losses by netem's own
        statistics (`netem_counters`: its full queue's drops among the losses)."""
        counters = {}
        for device in self.devices:
            text = self.backend.traffic_control.stats(device)
            netem = netem_counters(text)
            port = None if netem is None else {"frames": netem.passed, "lost": netem.dropped}
            counters[device.rank] = LinkCounters(qdisc_sent_bytes(text), port=port)
        return counters

    def _apply(self, plans: dict[int, ShapingPlan], in_place: bool, every: bool) -> None:
        """Each device's plan through the backend's traffic control: changed in place (a
        netem in the kernel stays, idle where the plan has none: `keeping_netem`) or applied
        anew; on `every` device, or on those whose plan differs from what their kernel has."""
        if in_place:
            for rank, applied in self.applied.items():
                if applied.netem is not None and rank in plans:
                    plans[rank] = keeping_netem(plans[rank])
        devices = self.devices
        if not every:
            devices = [d for d in devices if plans[d.rank] != self.applied.get(d.rank)]
        control = self.backend.traffic_control
        apply: Callable[[Device, ShapingPlan], None]
        apply = control.change if in_place else control.apply
        self.backend.for_each(devices, lambda device: apply(device, plans[device.rank]))
        self.applied.update({device.rank: plans[device.rank] for device in devices})

    def _plans(self, rates: LinkRates, impaired: bool) -> dict[int, ShapingPlan]:
        """Each rank's plan at `rates`: with its uplink's, downlink's and pairs'
        impairments (seeded where netem takes a seed), or (`impaired` false) its rates only."""
        devices = self.devices
        paths = self.paths.within(rates.devices)
        plans: dict[int, ShapingPlan] = {}
        for device in devices:
            rank = device.rank
            caps = {
                peer: (devices[peer].address, cap)
                for peer, cap in rates.peer_caps_mbit(rank).items()
            }
            impaired_pairs = {
                target: (devices[target].address, dict(parameters))
                for (source, target), parameters in paths.pair.items()
                if source == rank and impaired
            }
            up, down = rates.uplink_mbit[rank], rates.downlink_mbit[rank]
            what = f"up {up:g}, down {down}, caps {caps} Mbit/s, pairs impaired {impaired_pairs}"
            log.debug("shaping %s/%s: %s", device.name, device.interface, what)
            hops = Hops(
                peer_caps_mbit=caps,
                peer_impairments=impaired_pairs,
                downlink_mbit=down,
                downlink_impairments=paths.downlink.get(rank) if impaired else None,
            )
            plans[rank] = profile_plan(self.uplink(rank), up, impaired=impaired, hops=hops)
            if impaired and self.seeded:
                plans[rank] = self._seeded(plans[rank], rates, rank)
        return plans

    def _seeded(self, shaping: ShapingPlan, rates: LinkRates, rank: int) -> ShapingPlan:
        """The plan's netems with their hops' seeds, as the serial emulator seeds its ports
        (the profile's seed, the device count, the swept rate, the hop); recorded in
        `seeds`. netem draws anew from its seed at every change: a step's draws start from
        the seed of its rate."""

        def seed(base: int, place: int | str) -> int:
            self.seeds[str(place)] = value = port_seed(base, rates.devices, rates.swept_mbit, place)
            return value

        netem = shaping.netem and replace(shaping.netem, seed=seed(self.uplink(rank).seed, rank))
        down = shaping.downlink_netem
        down = down and replace(down, seed=seed(self.profile.seed, f"down{rank}"))
        pairs = {}
        for minor, leaf in shaping.peer_netem.items():
            place = f"{rank}->{minor - PEER_MINOR_BASE}"
            pairs[minor] = replace(leaf, seed=seed(self.profile.seed, place))
        return replace(shaping, netem=netem, downlink_netem=down, peer_netem=pairs)


def profile_plan(
    profile: LinkProfile,
    rate_mbit: float | None = None,
    support: Mapping[str, bool] | None = None,
    impaired: bool = True,
    hops: Hops | None = None,
) -> ShapingPlan:
    """The kernel's plan (`testbed.kernel.shaping.plan`) for a link profile at a rate (the
    profile's own when None), checked against `support` when given: the profile's impairments
    handed over as netem's parameters (none where not `impaired`: its rate and queue alone),
    its queue's bounds as tbf's; `hops`: the plan's per-peer and downlink parts (None: the
    uplink alone)."""
    rate = rate_mbit if rate_mbit is not None else profile.rate_mbit
    if rate is None:
        raise ShapingError(f"profile '{profile.name}' has no rate_mbit and no rate was given")
    impairments = LinkImpairments(profile.name, profile.impairments() if impaired else {})
    return plan(impairments, rate, support, hops, profile.queue_latency_ms, profile.burst_bytes)


def _duplicating_pair(paths: PathImpairments) -> tuple[int, int] | None:
    """A pair whose sender's htb tree the kernel would refuse (`duplicating_peer`), the
    first by sender."""
    for source in sorted({source for source, _ in paths.pair}):
        peers = {t: p for (s, t), p in sorted(paths.pair.items()) if s == source}
        if (target := duplicating_peer(peers)) is not None:
            return source, target
    return None
