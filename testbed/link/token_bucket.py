"""The kernel's token bucket (tbf) on each device's egress: it holds a bulk rate within 0.1%,
but its bucket lets a lone small message through at line rate, faster than a real link would;
netem adds delay, jitter and loss where the kernel has `sch_netem`.

Each device's interface gets the shaping plan of its rates (`testbed.kernel.shaping`): a root
tbf at its uplink, or an htb with a class per capped or impaired peer, and an ifb with a tbf
for its downlink; netem under the tbf for the uplink's delay, jitter and loss, as a pair's
class leaf for the pair's, and on the ifb for the downlink's, where the kernel has
`sch_netem` (this project's machines have not: that path is tested by its `tc` commands).
The backend applies the plan (netlink into the device's namespace, or tc over ssh on a board).
A bucket of two frames holds a bulk rate within 0.1 %, but lets a lone small message through
at line rate.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from testbed.backends.base import Backend, Device
from testbed.errors import ShapingError
from testbed.experiment.profiles import LinkProfile
from testbed.kernel.netem import LinkImpairments
from testbed.kernel.shaping import ShapingPlan, plan
from testbed.link.emulator import Emulator, Refusal
from testbed.link.paths import PathImpairments
from testbed.link.rates import LinkRates

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

    def set_rates(self, rates: LinkRates, in_place: bool) -> None:
        apply: Callable[[Device, ShapingPlan], None]
        apply = self.backend.change_rate if in_place else self.backend.shape
        devices = self.devices
        paths = self.paths.within(rates.devices)
        plans: dict[int, ShapingPlan] = {}
        for device in devices:
            rank = device.rank
            caps = {
                peer: (devices[peer].address, cap)
                for peer, cap in rates.peer_caps_mbit(rank).items()
            }
            impaired = {
                target: (devices[target].address, dict(parameters))
                for (source, target), parameters in paths.pair.items()
                if source == rank
            }
            up, down = rates.uplink_mbit[rank], rates.downlink_mbit[rank]
            what = f"up {up:g}, down {down}, caps {caps} Mbit/s, pairs impaired {impaired}"
            log.debug("shaping %s/%s: %s", device.name, device.interface, what)
            plans[rank] = profile_plan(
                self.uplink(rank),
                up,
                peer_caps_mbit=caps,
                downlink_mbit=down,
                downlink_impairments=paths.downlink.get(rank),
                peer_impairments=impaired,
            )
        self.backend.for_each(devices, lambda device: apply(device, plans[device.rank]))


def profile_plan(
    profile: LinkProfile,
    rate_mbit: float | None = None,
    support: Mapping[str, bool] | None = None,
    **hops: Any,
) -> ShapingPlan:
    """The kernel's plan (`testbed.kernel.shaping.plan`) for a link profile at a rate (the
    profile's own when None), checked against `support` when given: the profile's impairments
    handed over as netem's parameters, its queue's bounds as tbf's; `hops`: the plan's
    per-peer and downlink arguments."""
    rate = rate_mbit if rate_mbit is not None else profile.rate_mbit
    if rate is None:
        raise ShapingError(f"profile '{profile.name}' has no rate_mbit and no rate was given")
    impairments = LinkImpairments(profile.name, profile.impairments())
    bounds = {"queue_latency_ms": profile.queue_latency_ms, "burst_bytes": profile.burst_bytes}
    return plan(impairments, rate, support, **bounds, **hops)
