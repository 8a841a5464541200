"""The links of a run's devices: shaped by one emulator, then measured.

`Links` holds the run's emulator (`testbed.link.emulators`: tbf, the kernel's token bucket on
each device's egress; serial, a userspace link that clocks every frame out at the rate) and
shapes a trial's rates (`testbed.link.rates`: every device's uplink, optional downlinks and
per-pair caps) with it. It refuses what the emulator cannot emulate (the emulator's own
`refusal`, which the preflight asks too) before building anything.

After every change of rate a probe checks every shaped direction, one transfer at a time so
that probes never share a link (`testbed.link.rates.probe_plan`: each device's uplink to the
next rank, its downlink from its fastest sender, every pair cap; `link.probe_s` seconds of
traffic at the direction's target, timed after its first tenth); a direction more than 5%
off its target is flagged.

In virtual time (`dilation` d: testbed.experiment.dilation) everything here stays in the
experiment's units: the emulator is given rates / d and its profiles' times x d (`wall`,
`Emulator.uplink`), and what the probe measures is multiplied back by d.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from testbed.backends.base import Backend, Device
from testbed.errors import ShapingError
from testbed.experiment.netem_parameters import checked, impaired
from testbed.experiment.profiles import LinkProfile
from testbed.kernel.netem import netem_options
from testbed.link.emulator import Emulator, LinkCounters
from testbed.link.paths import PathImpairments
from testbed.link.probe import WIRE_PER_PAYLOAD, probe, probe_bytes
from testbed.link.rates import LinkRates, RateOverrides, probe_plan
from testbed.link.wire import FULL_FRAME_BYTES

log = logging.getLogger(__name__)

RATE_TOLERANCE = 0.05


@dataclass
class LinkState:
    """A trial's link: the rates shaped, and what the probe measured (TCP payload rates)."""

    rate_mbit: float  # the swept bandwidth
    measured_mbit: dict[int, float] = field(default_factory=dict)  # uplink probe, by sender
    qdisc: dict[int, str] = field(default_factory=dict)  # `tc -s qdisc` text by rank
    emulator_stats: dict[int, dict[str, Any]] | None = None  # the emulator's own, by rank
    uplink_mbit: dict[int, float] = field(default_factory=dict)  # shaped, by rank
    downlink_mbit: dict[int, float | None] = field(default_factory=dict)  # None: unshaped
    pair_mbit: dict[str, float] = field(default_factory=dict)  # "SRC->DST": cap
    downlink_measured_mbit: dict[int, float] = field(default_factory=dict)  # by receiver
    # every transfer the probe made, "SRC->DST": {"target_mbit": the path's frame rate,
    # "measured_mbit": its payload rate}; the uplink/downlink probes say which one is theirs
    transfers: dict[str, dict[str, float]] = field(default_factory=dict)
    uplink_probe: dict[int, str] = field(default_factory=dict)
    downlink_probe: dict[int, str] = field(default_factory=dict)
    # by rank, its uplink's impairments as tc-netem's words ("delay 30ms 10ms loss random
    # 0.5%"), its one-way delay, and each port's seed where the emulator draws them itself
    impairments: dict[int, str] = field(default_factory=dict)
    delay_ms: dict[int, float] = field(default_factory=dict)
    impairment_seeds: dict[str, int] = field(default_factory=dict)  # by hop ("0", "down1", "0->1")
    # the medium (dedicated: a line per device; shared: one cell) and, on a shared one, what
    # each device's transfer achieved with every device sending at once (the probe's
    # payload rate, by sender; each alone is `measured_mbit`)
    medium: str = "dedicated"
    airtime_us: float = 0.0
    together_mbit: dict[int, float] = field(default_factory=dict)
    # by hop as the seeds, netem's parameters in force after the shaping (checked, every
    # default filled in): every uplink's, and the later hops' that impair
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    # how long setting the rates and probing every transfer took (s): the orchestration's
    shape_s: float = 0.0
    probe_s: float = 0.0

    def rates(self, devices: int) -> LinkRates:
        """The rates shaped, as `LinkRates` (each uplink the swept rate where none is
        recorded: a run without links)."""
        ranks = range(devices)
        pairs = {}
        for key, cap in self.pair_mbit.items():
            source, target = key.split("->")
            pairs[(int(source), int(target))] = cap
        return LinkRates(
            self.rate_mbit,
            tuple(self.uplink_mbit.get(rank, self.rate_mbit) for rank in ranks),
            tuple(self.downlink_mbit.get(rank) for rank in ranks),
            pairs,
        )

    def wire_mbit(self, rank: int) -> float | None:
        """The uplink probe's payload rate as the frame rate tbf enforces (headers included)."""
        return _wire(self.measured_mbit.get(rank))

    def downlink_wire_mbit(self, rank: int) -> float | None:
        return _wire(self.downlink_measured_mbit.get(rank))

    def flagged(self, rank: int) -> bool:
        """The device's uplink probe, or its downlink probe, more than 5% off its target."""
        probes = [self.uplink_probe.get(rank), self.downlink_probe.get(rank)]
        if not self.transfers:  # a state from before per-direction probes
            wire = self.wire_mbit(rank)
            return wire is None or abs(wire / self.rate_mbit - 1) > RATE_TOLERANCE
        return any(key is None or self.transfer_flagged(key) for key in probes)

    def transfer_flagged(self, key: str) -> bool:
        transfer = self.transfers[key]
        wire = transfer["measured_mbit"] * WIRE_PER_PAYLOAD
        return abs(wire / transfer["target_mbit"] - 1) > RATE_TOLERANCE


def _wire(payload_mbit: float | None) -> float | None:
    return None if payload_mbit is None else payload_mbit * WIRE_PER_PAYLOAD


TOGETHER_START_S = 1.5  # every sender of the probe at once starts then: after their start-up


def with_airtime(rate_mbit: float, airtime_us: float) -> float:
    """What full frames achieve on a line of `rate_mbit` when each also takes `airtime_us`
    (a shared medium's per-frame overhead)."""
    bits = 8 * FULL_FRAME_BYTES
    return bits / (bits / rate_mbit + airtime_us)


class Links:
    """The links between a backend's started devices; `stop()` removes what it added."""

    def __init__(
        self,
        backend: Backend,
        profile: LinkProfile,
        emulator: type[Emulator],
        run_id: str,
        overrides: RateOverrides | None = None,
        paths: PathImpairments | None = None,
        dilation: float = 1.0,
    ):
        """`dilation`: the sessions' (testbed.experiment.dilation): everything here is in
        virtual time, the emulator is given rates / dilation and times x dilation, and what
        the probe measures is multiplied back."""
        self.backend, self.profile, self.dilation = backend, profile, dilation
        self.overrides = overrides or RateOverrides()
        self.rates: LinkRates | None = None  # what `shape` set last
        paths = paths or PathImpairments()
        pair_rates = bool(self.overrides.pair_mbit)
        refused = emulator.refusal(profile, type(backend), pair_rates, paths)
        if refused is not None:
            raise ShapingError(f"{refused.field}: {refused.why}")
        self.paths = paths  # virtual; the emulator's are on the host's clock
        self.emulator = emulator(backend, profile, run_id)
        self.emulator.dilation = dilation
        self.emulator.paths = paths.dilated(dilation)
        self.emulator.attachments = self.emulator.start()

    @property
    def devices(self) -> list[Device]:
        """The devices as the links reach them (at the emulator's addresses, if it gave any):
        what the probe, the workers' peers and the counters use."""
        return self.emulator.devices

    def shape(
        self,
        rate_mbit: float,
        probe_seconds: float,
        profile: LinkProfile | None = None,
        uplinks: dict[int, LinkProfile] | None = None,
    ) -> LinkState:
        """Every device's rates at the swept `rate_mbit` (with the experiment's per-device
        and per-pair rates), then every shaped direction probed, then the impairments of
        `profile` (a trial's variant of the run's profile; the run's by default), or of a
        device's own uplink profile in `uplinks`, added."""
        if profile is not None or uplinks is not None:
            self.set_profile(profile or self.profile, uplinks)
        self.emulator.step = {}  # a trace's steps are the replay's, from its first
        devices = self.devices
        rates = self.overrides.resolve(rate_mbit, len(devices))
        began = time.monotonic()
        self.emulator.set_rates(self.wall(rates), in_place=False)
        shaped = time.monotonic()
        self.rates = rates
        state = LinkState(
            rate_mbit,
            uplink_mbit=dict(enumerate(rates.uplink_mbit)),
            downlink_mbit=dict(enumerate(rates.downlink_mbit)),
            pair_mbit={f"{s}->{d}": cap for (s, d), cap in rates.pair_mbit.items()},
        )
        self._probe(rates, probe_seconds, state)
        state.medium, state.airtime_us = self.profile.medium, self.profile.airtime_us
        if state.medium == "shared" and len(devices) > 1:
            state.together_mbit = self._probe_together(rates, probe_seconds)
        state.shape_s, state.probe_s = shaped - began, time.monotonic() - shaped
        self.emulator.impair(self.wall(rates))  # after the probe, which checks the rate alone
        for device in devices:
            state.impairments[device.rank], state.delay_ms[device.rank] = self._words(device.rank)
        state.impairment_seeds = dict(self.emulator.seeds)
        state.parameters = self._parameters(len(devices))
        for device in devices:
            state.qdisc[device.rank] = self.backend.traffic_control.stats(device)
        state.emulator_stats = self.emulator.stats()
        return state

    def _probe(self, rates: LinkRates, probe_seconds: float, state: LinkState) -> None:
        """Each transfer of the probe plan in turn; each device told which are its own."""
        devices, probes = self.devices, probe_plan(rates)
        for source, target in probes.transfers:
            key = f"{source}->{target}"
            target_mbit = with_airtime(rates.path_mbit(source, target), self.profile.airtime_us)
            byte_count = probe_bytes(target_mbit, probe_seconds)
            measured = self.dilation * probe(
                self.backend, devices[source], devices[target], byte_count
            )
            state.transfers[key] = {"target_mbit": target_mbit, "measured_mbit": measured}
            if state.transfer_flagged(key):
                log.warning(
                    "%s achieves %.2f Mbit/s (frames), more than 5%% off its %g Mbit/s target",
                    key,
                    measured * WIRE_PER_PAYLOAD,
                    target_mbit,
                )
        for rank, (source, target) in probes.uplink.items():
            state.uplink_probe[rank] = key = f"{source}->{target}"
            state.measured_mbit[rank] = state.transfers[key]["measured_mbit"]
        for rank, (source, target) in probes.downlink.items():
            state.downlink_probe[rank] = key = f"{source}->{target}"
            state.downlink_measured_mbit[rank] = state.transfers[key]["measured_mbit"]

    def _probe_together(self, rates: LinkRates, probe_seconds: float) -> dict[int, float]:
        """On a shared medium: every device sends to the next at once (from one moment, after
        every sender has started), each its share of the cell for `probe_seconds`; what each
        achieved, by sender."""
        devices = self.devices
        count = len(devices)
        at_s = time.time() + TOGETHER_START_S

        def one(rank: int) -> float:
            share_mbit = with_airtime(rates.uplink_mbit[rank], self.profile.airtime_us) / count
            receiver = devices[(rank + 1) % count]
            byte_count = probe_bytes(share_mbit, probe_seconds)
            return self.dilation * probe(self.backend, devices[rank], receiver, byte_count, at_s)

        with ThreadPoolExecutor(count) as pool:
            return dict(enumerate(pool.map(one, range(count))))

    def set_profile(
        self, profile: LinkProfile, uplinks: dict[int, LinkProfile] | None = None
    ) -> None:
        """Shape after `profile` (and each device in `uplinks` after its own) from the next
        `shape` on; refused like the run's profile."""
        pair_rates = bool(self.overrides.pair_mbit)
        for each in [profile, *(uplinks or {}).values()]:
            refused = self.emulator.refusal(
                each, type(self.backend), pair_rates, self.emulator.paths
            )
            if refused is not None:
                raise ShapingError(f"{refused.field}: {refused.why}")
        self.profile = self.emulator.profile = profile
        self.emulator.uplinks = dict(uplinks or {})

    def set_rate(
        self, rate_mbit: float, impairments: dict[str, float] | None = None, step: int = 0
    ) -> dict[int, str]:
        """Every rate scaled to the swept rate `rate_mbit` from now on (`LinkRates.scaled`),
        changed in place and not probed, and where given the impairments of the trace's
        `step` laid over every uplink: a replayed trace's step (`testbed.link.replay`).
        Returns each rank's uplink impairments as netem's words. The links must have been
        `shape`d."""
        if self.rates is None:
            raise ShapingError("links: set_rate before shape (a link is shaped once first)")
        changed = impairments is not None and impairments != self.emulator.step
        if impairments is not None:
            self.emulator.step = dict(impairments)
        rates = self.rates.scaled(rate_mbit)
        self.emulator.set_rates(self.wall(rates), in_place=True)
        if changed:
            self.emulator.impair(self.wall(rates), step)
        return {rank: self._words(rank)[0] for rank in range(rates.devices)}

    def set_device(self, rank: int, change: dict[str, object]) -> str:
        """One device's uplink from now on (a timeline's link event): `rate_mbit`, changed in
        place like a trace's step, and netem's parameters laid over its uplink. Returns the
        uplink's impairments as netem's words. The links must have been `shape`d."""
        if self.rates is None:
            raise ShapingError("links: set_device before shape (a link is shaped once first)")
        impairments = {k: v for k, v in change.items() if k != "rate_mbit"}
        rate = change.get("rate_mbit")
        if isinstance(rate, int | float):
            uplinks = list(self.rates.uplink_mbit)
            uplinks[rank] = float(rate)
            self.rates = dataclasses.replace(self.rates, uplink_mbit=tuple(uplinks))
            self.emulator.set_rates(self.wall(self.rates), in_place=True)
        if impairments:
            laid = self.emulator.uplinks.get(rank, self.profile).with_impairments(impairments)
            self.emulator.uplinks[rank] = laid
            self.emulator.impair(self.wall(self.rates), step=1 + len(self.emulator.seeds))
        return self._words(rank)[0]

    def _parameters(self, devices: int) -> dict[str, dict[str, Any]]:
        """Every hop's netem parameters in force, by hop: each uplink's, then the receivers'
        downlinks and the pairs that impair (testbed.link.paths)."""
        hops = {
            str(rank): checked(self.emulator.virtual_uplink(rank).impairments())
            for rank in range(devices)
        }
        paths = self.paths.within(devices)
        later = {f"down{rank}": p for rank, p in paths.downlink.items()}
        later |= {f"{source}->{target}": p for (source, target), p in paths.pair.items()}
        for hop, parameters in later.items():
            if impaired(values := checked(dict(parameters))):
                hops[hop] = values
        return hops

    def _words(self, rank: int) -> tuple[str, float]:
        """The rank's uplink impairments as netem's words, and its one-way delay."""
        values = checked(self.emulator.virtual_uplink(rank).impairments())
        return " ".join(netem_options(values)), values["delay_ms"]

    def wall(self, rates: LinkRates) -> LinkRates:
        """`rates` on the host's clock: each divided by the dilation."""
        return rates if self.dilation == 1 else rates.scaled(rates.swept_mbit / self.dilation)

    def counters(self) -> dict[int, LinkCounters]:
        """Per rank, what its link has done so far: bytes carried (its egress qdisc's counter)
        and, on the serial emulator, its port's stalls (else None)."""
        return self.emulator.counters()

    def gone(self) -> str | None:
        """Why a device or the emulator no longer runs, or None: the first device that
        stopped, named, else the emulator."""
        for device in self.devices:
            why = self.backend.gone(device)
            if why is not None:
                return f"device {device.rank} stopped: {why}"
        return self.emulator.gone()

    def stop(self) -> None:
        self.emulator.stop()

    def __enter__(self) -> Links:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
