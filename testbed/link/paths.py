"""What a frame meets after its sender's uplink: the receiver's downlink and the pair's own
impairments (`link.downlink_impairments`, `link.pair_impairments`), pure, no kernel.

A frame from s to d crosses three hops in turn: s's uplink (the trial's link with s's own
`uplink_impairments` laid over it), the pair s->d's hop, then d's downlink. Each hop draws
from netem's model on its own (`testbed.link.serial.netem_draws`, its own seeded generator),
so delays add and losses compound: a pair with 1% loss behind an uplink with 1% loses
1 - 0.99^2 of the frames. The rates are different: they are the least of the three on one
serial line (`testbed.link.rates`). Only the serial emulator draws the two later hops; it
draws them for frames to a receiver it has learned (broadcasts, such as ARP, cross the uplink
alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from testbed.experiment.netem_parameters import dilated

if TYPE_CHECKING:
    from testbed.experiment.link_section import LinkSection


@dataclass(frozen=True)
class PathImpairments:
    """netem's parameters of every receiver's downlink and every directed pair, by rank."""

    downlink: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    pair: Mapping[tuple[int, int], Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, link: LinkSection) -> PathImpairments:
        return cls(dict(link.downlink_impairments), link.impaired_pairs())

    def __bool__(self) -> bool:
        return bool(self.downlink or self.pair)

    def delay_ms(self, source: int, target: int) -> float:
        """What the two later hops add to the one-way delay from `source` to `target`."""
        hops = [self.pair.get((source, target), {}), self.downlink.get(target, {})]
        return sum(float(hop.get("delay_ms") or 0.0) for hop in hops)

    def dilated(self, factor: float) -> PathImpairments:
        """The same hops with every delay and jitter `factor` times as long (virtual time)."""
        return PathImpairments(
            {rank: dilated(p, factor) for rank, p in self.downlink.items()},
            {pair: dilated(p, factor) for pair, p in self.pair.items()},
        )

    def within(self, devices: int) -> PathImpairments:
        """Those of a trial of `devices` devices (ranks beyond it unused)."""
        return PathImpairments(
            {rank: p for rank, p in self.downlink.items() if rank < devices},
            {pair: p for pair, p in self.pair.items() if max(pair) < devices},
        )
