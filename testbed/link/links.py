"""The links of a run's devices: shaped by one emulator, then measured.

`Links` knows the emulator of an experiment (`link.emulator`) and what it changes about the
devices. A trial's rates (`testbed.link.rates`: every device's uplink, optional downlinks
and per-pair caps) are shaped by
- `tbf`: each device's egress interface gets the kernel's token bucket at its uplink
  (`testbed.kernel.shaping`), or an htb with a class per capped peer; a device with a downlink
  gets an ifb that its received traffic is redirected to, with a tbf at the downlink.
- `serial`: a `testbed.link.serial.switch.SerialSwitch` joins the devices through a userspace link
  that clocks every frame out at the least of its sender's uplink, receiver's downlink and
  pair's rate; each device gets a second interface (`sl0`) on its own /24, and the devices'
  addresses become those, so the workers' and the probe's traffic crosses the emulator.
  Needs root on this host and the devices' network namespaces (docker and local backends).

After every change of rate a probe checks every shaped direction, one transfer at a time so
that probes never share a link (`testbed.link.rates.probe_plan`: each device's uplink to the
next rank, its downlink from its fastest sender, every pair cap; `link.probe_s` seconds of
traffic at the direction's target, timed after its first tenth); a direction more than 5%
off its target is flagged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from ipaddress import ip_network
from typing import Any

from testbed.backends.base import Backend, Device
from testbed.errors import ConfigError, ShapingError
from testbed.experiment.profiles import LinkProfile
from testbed.kernel.shaping import ShapingPlan, plan
from testbed.link.probe import WIRE_PER_PAYLOAD, probe, probe_bytes
from testbed.link.rates import LinkRates, RateOverrides, probe_plan
from testbed.link.serial.switch import SerialSwitch

log = logging.getLogger(__name__)

RATE_TOLERANCE = 0.05


@dataclass
class LinkState:
    """A trial's link: the rates shaped, and what the probe measured (TCP payload rates)."""

    rate_mbit: float  # the swept bandwidth
    measured_mbit: dict[int, float] = field(default_factory=dict)  # uplink probe, by sender
    qdisc: dict[int, str] = field(default_factory=dict)  # `tc -s qdisc` text by rank
    serial: dict[int, dict[str, Any]] | None = None  # the serial emulator's counters by rank
    uplink_mbit: dict[int, float] = field(default_factory=dict)  # shaped, by rank
    downlink_mbit: dict[int, float | None] = field(default_factory=dict)  # None: unshaped
    pair_mbit: dict[str, float] = field(default_factory=dict)  # "SRC->DST": cap
    downlink_measured_mbit: dict[int, float] = field(default_factory=dict)  # by receiver
    # every transfer the probe made, "SRC->DST": {"target_mbit": the path's frame rate,
    # "measured_mbit": its payload rate}; the uplink/downlink probes say which one is theirs
    transfers: dict[str, dict[str, float]] = field(default_factory=dict)
    uplink_probe: dict[int, str] = field(default_factory=dict)
    downlink_probe: dict[int, str] = field(default_factory=dict)

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


def emulator_for(requested: str | None, backend: str) -> str:
    """The emulator a run uses: the experiment's, else serial (tbf on ssh boards)."""
    if requested == "serial" and backend == "ssh":
        raise ConfigError(
            "link.emulator: serial needs the devices on this host (docker or local backend); "
            "boards over ssh are shaped with tbf"
        )
    return requested or ("tbf" if backend == "ssh" else "serial")


class Links:
    """The links between a backend's started devices; `stop()` removes what it added."""

    def __init__(
        self,
        backend: Backend,
        profile: LinkProfile,
        emulator: str,
        run_id: str,
        overrides: RateOverrides | None = None,
    ):
        self.backend, self.profile, self.emulator = backend, profile, emulator
        self.overrides = overrides or RateOverrides()
        self.rates: LinkRates | None = None  # what `shape` set last
        self.switch: SerialSwitch | None = None
        if emulator == "serial":
            if profile.needs_netem:
                raise ShapingError(
                    f"profile '{profile.name}' asks for delay, jitter or loss, which the serial "
                    "emulator does not add (yet); use a rate-only profile"
                )
            self.switch = self._start_switch(run_id)

    def _start_switch(self, run_id: str) -> SerialSwitch:
        from testbed.kernel.addresses import choose_subnet, host_networks
        from testbed.kernel.netns import run_tag

        backend = self.backend
        missing = [d.name for d in backend.devices if d.netns_path is None]
        if missing or os.geteuid() != 0:
            raise ShapingError(
                "link.emulator serial needs root on this host and the devices' network "
                f"namespaces ({backend.name} backend); use link.emulator: tbf"
            )
        used = host_networks() + [ip_network(f"{d.address}/24", False) for d in backend.devices]
        subnet = choose_subnet(f"{run_id}-serial", used)
        paths = [d.netns_path for d in backend.devices if d.netns_path is not None]
        rate = self.profile.rate_mbit or 10.0
        cpusets = [d.cpuset for d in backend.devices]
        switch = SerialSwitch(run_tag(run_id), paths, subnet, rate, cpusets=cpusets).start()
        backend.devices = [
            replace(d, address=switch.address(d.rank), interface=switch.interface)
            for d in backend.devices
        ]
        return switch

    def shape(self, rate_mbit: float, probe_seconds: float) -> LinkState:
        """Every device's rates at the swept `rate_mbit` (with the experiment's per-device
        and per-pair rates), then every shaped direction probed."""
        devices = self.backend.devices
        rates = self.overrides.resolve(rate_mbit, len(devices))
        self._set(rates, in_place=False)
        self.rates = rates
        state = LinkState(
            rate_mbit,
            uplink_mbit=dict(enumerate(rates.uplink_mbit)),
            downlink_mbit=dict(enumerate(rates.downlink_mbit)),
            pair_mbit={f"{s}->{d}": cap for (s, d), cap in rates.pair_mbit.items()},
        )
        self._probe(rates, probe_seconds, state)
        for device in devices:
            state.qdisc[device.rank] = self.backend.qdisc_stats(device)
        if self.switch is not None:
            state.serial = self.switch.stats()
        return state

    def _probe(self, rates: LinkRates, probe_seconds: float, state: LinkState) -> None:
        """Each transfer of the probe plan in turn; each device told which are its own."""
        devices, probes = self.backend.devices, probe_plan(rates)
        for source, target in probes.transfers:
            key, target_mbit = f"{source}->{target}", rates.path_mbit(source, target)
            byte_count = probe_bytes(target_mbit, probe_seconds)
            measured = probe(self.backend, devices[source], devices[target], byte_count)
            state.transfers[key] = {"target_mbit": target_mbit, "measured_mbit": measured}
            if state.transfer_flagged(key):
                log.warning(
                    "%s achieves %.2f Mbit/s (frames), more than 5%% off its %g Mbit/s target",
                    key, measured * WIRE_PER_PAYLOAD, target_mbit,
                )  # fmt: skip
        for rank, (source, target) in probes.uplink.items():
            state.uplink_probe[rank] = key = f"{source}->{target}"
            state.measured_mbit[rank] = state.transfers[key]["measured_mbit"]
        for rank, (source, target) in probes.downlink.items():
            state.downlink_probe[rank] = key = f"{source}->{target}"
            state.downlink_measured_mbit[rank] = state.transfers[key]["measured_mbit"]

    def set_rate(self, rate_mbit: float) -> None:
        """Every rate scaled to the swept rate `rate_mbit` from now on (`LinkRates.scaled`),
        changed in place and not probed: a replayed trace's step (`testbed.link.replay`).
        The links must have been `shape`d."""
        if self.rates is None:
            raise ShapingError("links: set_rate before shape (a link is shaped once first)")
        self._set(self.rates.scaled(rate_mbit), in_place=True)

    def _set(self, rates: LinkRates, in_place: bool) -> None:
        """The serial emulator's rates, or tbf's plan per device: attached (`shape`) or
        changed in place (`change_rate`)."""
        if self.switch is not None:
            self.switch.set_rates(rates.uplink_mbit, rates.downlink_mbit, dict(rates.pair_mbit))
            return
        apply: Callable[[Device, ShapingPlan], None]
        apply = self.backend.change_rate if in_place else self.backend.shape
        devices = self.backend.devices
        for device in devices:
            rank = device.rank
            caps = {peer: (devices[peer].address, cap)
                    for peer, cap in rates.peer_caps_mbit(rank).items()}  # fmt: skip
            up, down = rates.uplink_mbit[rank], rates.downlink_mbit[rank]
            log.debug("shaping %s/%s: up %g, down %s, caps %s Mbit/s",
                      device.name, device.interface, up, down, caps)  # fmt: skip
            apply(device, plan(self.profile, up, peer_caps_mbit=caps, downlink_mbit=down))

    def counters(self) -> dict[int, LinkCounters]:
        """Per rank, what its link has done so far: bytes carried (its egress qdisc's counter)
        and, on the serial emulator, its port's stalls (else None)."""
        serial = self.switch.stats() if self.switch is not None else {}
        return {
            d.rank: LinkCounters(
                qdisc_sent_bytes(self.backend.qdisc_stats(d)),
                [(round(start * 1e9), round(ms * 1e6)) for start, ms in serial[d.rank]["stall_log"]]
                if serial
                else None,
            )
            for d in self.backend.devices
        }

    def stop(self) -> None:
        if self.switch is not None:
            self.switch.stop()
            self.switch = None

    def __enter__(self) -> Links:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


@dataclass(frozen=True)
class LinkCounters:
    """A device's link so far: bytes carried, and the serial emulator's stalls of its port as
    (start ns, length ns) by CLOCK_REALTIME (None on links the emulator does not clock)."""

    sent_bytes: int
    stalls: list[tuple[int, int]] | None = None


def qdisc_sent_bytes(text: str) -> int:
    """The `Sent N bytes` counter of `tc -s qdisc show` text (the root qdisc's, listed first)."""
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["Sent"] and len(parts) > 1 and parts[1].isdigit():
            return int(parts[1])
    return 0
