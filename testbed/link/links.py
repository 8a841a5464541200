"""The links of a run's devices: shaped by one emulator, then measured.

`Links` knows the emulator of an experiment (`link.emulator`) and what it changes about the
devices:
- `tbf`: each device's egress interface gets the kernel's token bucket at the trial's rate
  (`testbed.link.plan`), so every directed pair of devices sees that rate.
- `serial`: a `testbed.serial_switch.SerialSwitch` joins the devices through a userspace link
  that clocks every frame out at its sender's rate; each device gets a second interface
  (`sl0`) on its own /24, and the devices' addresses become those, so the workers' and the
  probe's traffic crosses the emulator. Needs root on this host and the devices' network
  namespaces (docker and local backends).

After every change of rate a probe measures each device's sending rate (device i to device
i + 1, in turn, so probes never share a link; `link.probe_s` seconds of traffic at the target
rate, timed after its first tenth) and the result is flagged when it is more than 5% off.
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
from testbed.link.plan import ShapingPlan, plan
from testbed.link.probe import WIRE_PER_PAYLOAD, probe, probe_bytes
from testbed.profiles import LinkProfile
from testbed.serial_switch import SerialSwitch

log = logging.getLogger(__name__)

RATE_TOLERANCE = 0.05


@dataclass
class LinkState:
    rate_mbit: float
    measured_mbit: dict[int, float] = field(default_factory=dict)  # by sending rank
    qdisc: dict[int, str] = field(default_factory=dict)  # `tc -s qdisc` text by rank
    serial: dict[int, dict[str, Any]] | None = None  # the serial emulator's counters by rank

    def wire_mbit(self, rank: int) -> float | None:
        """The probe's payload rate as the frame rate tbf enforces (headers included)."""
        measured = self.measured_mbit.get(rank)
        return None if measured is None else measured * WIRE_PER_PAYLOAD

    def flagged(self, rank: int) -> bool:
        wire = self.wire_mbit(rank)
        return wire is None or abs(wire / self.rate_mbit - 1) > RATE_TOLERANCE


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

    def __init__(self, backend: Backend, profile: LinkProfile, emulator: str, run_id: str):
        self.backend, self.profile, self.emulator = backend, profile, emulator
        self.switch: SerialSwitch | None = None
        if emulator == "serial":
            if profile.needs_netem:
                raise ShapingError(
                    f"profile '{profile.name}' asks for delay, jitter or loss, which the serial "
                    "emulator does not add (yet); use a rate-only profile"
                )
            self.switch = self._start_switch(run_id)

    def _start_switch(self, run_id: str) -> SerialSwitch:
        from testbed.backends.local import choose_subnet, host_networks, run_tag

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
        """Every device's uplink at `rate_mbit`, then each one's rate probed."""
        devices = self.backend.devices
        self._set(rate_mbit, self.backend.shape)
        state = LinkState(rate_mbit)
        byte_count = probe_bytes(rate_mbit, probe_seconds)
        if len(devices) > 1:
            for device in devices:
                peer = devices[(device.rank + 1) % len(devices)]
                state.measured_mbit[device.rank] = probe(self.backend, device, peer, byte_count)
        for device in devices:
            state.qdisc[device.rank] = self.backend.qdisc_stats(device)
            if len(devices) > 1 and state.flagged(device.rank):
                log.warning(
                    "device %d achieves %.2f Mbit/s, more than 5%% off the %g Mbit/s target",
                    device.rank, state.measured_mbit[device.rank], rate_mbit,
                )  # fmt: skip
        if self.switch is not None:
            state.serial = self.switch.stats()
        return state

    def set_rate(self, rate_mbit: float) -> None:
        """Every device's uplink at `rate_mbit` from now on, changed in place and not probed:
        a replayed trace's step (`testbed.link.replay`). The links must have been `shape`d."""
        self._set(rate_mbit, self.backend.change_rate)

    def _set(self, rate_mbit: float, apply: Callable[[Device, ShapingPlan], None]) -> None:
        """The serial emulator's rate, or `apply` (shape or change) of tbf's plan, per device."""
        for device in self.backend.devices:
            if self.switch is not None:
                self.switch.set_rate(device.rank, rate_mbit)
            else:
                log.debug("shaping %s/%s to %g Mbit/s", device.name, device.interface, rate_mbit)
                apply(device, plan(self.profile, rate_mbit))

    def sent_bytes(self) -> dict[int, int]:
        """Bytes each device's link has carried so far (its egress qdisc's counter)."""
        return {d.rank: qdisc_sent_bytes(self.backend.qdisc_stats(d)) for d in self.backend.devices}

    def stop(self) -> None:
        if self.switch is not None:
            self.switch.stop()
            self.switch = None

    def __enter__(self) -> Links:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def qdisc_sent_bytes(text: str) -> int:
    """The `Sent N bytes` counter of `tc -s qdisc show` text (the root qdisc's, listed first)."""
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["Sent"] and len(parts) > 1 and parts[1].isdigit():
            return int(parts[1])
    return 0
