"""Who sends how fast to whom: every device's uplink and downlink and the per-pair caps of
one trial, and which probe transfers check them (pure, no kernel).

How an experiment's rates combine (`link` in the experiment file, `testbed.experiment.schema`):
- `bandwidth_mbit` (swept) is every device's uplink; downlinks are unshaped.
- `uplink_mbit` / `downlink_mbit` replace that for the devices they name (absolute Mbit/s,
  the same in every trial of the sweep: the sweep then varies the other devices).
- `pair_mbit` caps one direction of one pair inside the sender's uplink and the receiver's
  downlink: the path from s to d runs at min(uplink[s], downlink[d], pair[s, d]).
- A replayed bandwidth trace (`Links.set_rate`) scales every rate by the trace's rate over
  the swept one, so devices keep their ratios as the network slows down or speeds up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from testbed.experiment.link_section import LinkSection


@dataclass(frozen=True)
class RateOverrides:
    """The experiment's per-device and per-pair rates (Mbit/s), by rank."""

    uplink_mbit: Mapping[int, float] = field(default_factory=dict)
    downlink_mbit: Mapping[int, float] = field(default_factory=dict)
    pair_mbit: Mapping[tuple[int, int], float] = field(default_factory=dict)

    def resolve(self, swept_mbit: float, devices: int) -> LinkRates:
        """The rates of a trial of `devices` devices at the swept rate (ranks beyond it unused)."""
        ranks = range(devices)
        return LinkRates(
            swept_mbit=float(swept_mbit),
            uplink_mbit=tuple(float(self.uplink_mbit.get(r, swept_mbit)) for r in ranks),
            downlink_mbit=tuple(self.downlink_mbit.get(r) for r in ranks),
            pair_mbit={
                (s, d): rate for (s, d), rate in self.pair_mbit.items() if max(s, d) < devices
            },
        )


def rate_overrides(link: LinkSection) -> RateOverrides:
    """The experiment file's `link` section's per-device and per-pair rates."""
    return RateOverrides(dict(link.uplink_mbit), dict(link.downlink_mbit), link.pairs())


@dataclass(frozen=True)
class LinkRates:
    swept_mbit: float
    uplink_mbit: tuple[float, ...]  # by rank
    downlink_mbit: tuple[float | None, ...]  # by rank; None: unshaped
    pair_mbit: Mapping[tuple[int, int], float] = field(default_factory=dict)

    @classmethod
    def uniform(cls, rate_mbit: float, devices: int) -> LinkRates:
        return RateOverrides().resolve(rate_mbit, devices)

    @property
    def devices(self) -> int:
        return len(self.uplink_mbit)

    @property
    def has_downlinks(self) -> bool:
        return any(rate is not None for rate in self.downlink_mbit)

    def path_mbit(self, source: int, target: int) -> float:
        """What `source` can send to `target`: the least of the uplink, downlink and pair cap."""
        down = self.downlink_mbit[target]
        limits = (self.uplink_mbit[source], down, self.pair_mbit.get((source, target)))
        return min(limit for limit in limits if limit is not None)

    def peer_caps_mbit(self, source: int) -> dict[int, float]:
        """The pair caps below `source`'s uplink, by receiving rank (its htb classes)."""
        uplink = self.uplink_mbit[source]
        return {
            d: cap for (s, d), cap in sorted(self.pair_mbit.items()) if s == source and cap < uplink
        }

    def scaled(self, rate_mbit: float) -> LinkRates:
        """Every rate times `rate_mbit` / the swept rate: a trace's step."""
        factor = rate_mbit / self.swept_mbit
        return LinkRates(
            swept_mbit=float(rate_mbit),
            uplink_mbit=tuple(r * factor for r in self.uplink_mbit),
            downlink_mbit=tuple(None if r is None else r * factor for r in self.downlink_mbit),
            pair_mbit={pair: r * factor for pair, r in self.pair_mbit.items()},
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "swept_mbit": self.swept_mbit,
            "uplink_mbit": list(self.uplink_mbit),
            "downlink_mbit": list(self.downlink_mbit),
            "pair_mbit": {f"{s}->{d}": r for (s, d), r in sorted(self.pair_mbit.items())},
        }


@dataclass(frozen=True)
class ProbePlan:
    """The transfers a probe makes, one at a time, and which one checks what."""

    transfers: tuple[tuple[int, int], ...]
    uplink: Mapping[int, tuple[int, int]]  # by rank: the transfer that checks its uplink
    downlink: Mapping[int, tuple[int, int]]  # by rank: the transfer that checks its downlink


def probe_plan(rates: LinkRates) -> ProbePlan:
    """Each device's uplink is checked by sending to the next rank, its downlink by receiving
    from the peer that can send to it fastest (the previous rank when none is faster, so
    that with no downlinks and no pairs the P transfers of a ring check everything), and
    every pair cap by its own transfer. A transfer used twice is made once."""
    count = rates.devices
    if count < 2:
        return ProbePlan((), {}, {})
    uplink = {rank: (rank, (rank + 1) % count) for rank in range(count)}
    downlink = {}
    for rank in range(count):
        previous = (rank - 1) % count
        senders = [previous] + [s for s in range(count) if s not in (rank, previous)]
        best = max(senders, key=lambda s: _sender_mbit(rates, s, rank))  # first of the ties
        downlink[rank] = (best, rank)
    wanted = [*uplink.values(), *downlink.values(), *sorted(rates.pair_mbit)]
    return ProbePlan(tuple(dict.fromkeys(wanted)), uplink, downlink)


def _sender_mbit(rates: LinkRates, source: int, target: int) -> float:
    cap = rates.pair_mbit.get((source, target), math.inf)
    return min(rates.uplink_mbit[source], cap)
