"""A userspace serial link between the devices that clocks every frame out at its rate, so that
a lone small message takes its wire time as on a real link (bulk holds the rate within 0.01%),
and draws netem's delay, jitter, loss, duplication and reordering itself, seeded, on any
kernel; it needs the devices on this host and root.

This is the emulator as the table sees it; the link itself is `testbed.link.serial.switch`
(and its program). It joins the devices through a switch namespace of its own, so it needs
their network namespaces on this host (a backend whose devices are `on_this_host`). Each
device gets a second interface, `sl0`, on a /24 of its own, and is reached at its address
there (`start` gives them), so that the workers' and the probe's traffic crosses the emulator.
It clocks every frame out at the least of its sender's uplink, its receiver's downlink and its
pair's rate.
"""

from __future__ import annotations

import hashlib
import os
import signal
from ipaddress import ip_network

from testbed.backends.base import Backend
from testbed.errors import ShapingError
from testbed.experiment.profiles import LinkProfile
from testbed.kernel.addresses import choose_subnet, host_networks
from testbed.kernel.names import run_tag
from testbed.link.emulator import PORT_COUNTED, Attachment, Emulator, LinkCounters, Refusal
from testbed.link.paths import PathImpairments
from testbed.link.rates import LinkRates
from testbed.link.serial.switch import ProgramOptions, SerialSwitch

DEFAULT_RATE_MBIT = 10.0  # the ports' rate until the first shaping
CORE_ENV = "TESTBED_SERIAL_CORE"
SPIN_ENV = "TESTBED_SERIAL_SPIN_US"  # the program's --spin-us, to measure polling


def port_seed(seed: int, devices: int, rate_mbit: float, place: int | str) -> int:
    """A hop's seed: 63 bits of SHA-256 over what identifies its session and its place (a
    port's rank for its uplink, "down1" for a downlink, "0->1" for a pair). Not the
    impairment variant: the variants of one session draw the same random numbers (common
    random numbers), so that two variants differ by their parameters, not by their luck; a
    run's `seed` gives other draws."""
    text = f"{seed}:{devices}:{rate_mbit!r}:{place}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


class SerialEmulator(Emulator):
    name = "serial"
    impairs_paths = True
    shares_medium = True

    def __init__(self, backend: Backend, profile: LinkProfile, run_id: str):
        super().__init__(backend, profile, run_id)
        self.switch: SerialSwitch | None = None
        self.medium = ("dedicated", 0.0)  # the switch's: a line each until told otherwise

    @classmethod
    def refusal(
        cls,
        profile: LinkProfile,
        backend: type[Backend],
        pair_rates: bool,
        paths: PathImpairments | None = None,
    ) -> Refusal | None:
        if (shared := super().refusal(profile, backend, pair_rates, paths)) is not None:
            return shared
        if not backend.on_this_host:
            from testbed.backends.table import BACKENDS

            here = " or ".join(name for name, kind in BACKENDS.items() if kind.on_this_host)
            return Refusal(
                "link.emulator",
                f"serial needs the devices on this host (the {here} backend); the "
                f"{backend.name} backend's devices are shaped with {backend.default_emulator}",
            )
        return None

    def start(self) -> dict[int, Attachment]:
        """The switch (`testbed.link.serial.switch`); each device is reached on its `sl0`."""
        backend = self.backend
        missing = [d.name for d in backend.devices if d.netns_path is None]
        if missing or os.geteuid() != 0:
            raise ShapingError(
                "link.emulator serial needs root on this host and the devices' network "
                f"namespaces ({backend.name} backend); use link.emulator: tbf"
            )
        used = host_networks("serial switch", ShapingError)
        used += [ip_network(f"{d.address}/24", False) for d in backend.devices]
        subnet = choose_subnet(f"{self.run_id}-serial", used)
        paths = [d.netns_path for d in backend.devices if d.netns_path is not None]
        rate = self.profile.rate_mbit or DEFAULT_RATE_MBIT
        cpusets = [d.cpuset for d in backend.devices]
        # the C core where it builds; TESTBED_SERIAL_CORE (c, python) chooses, to measure one
        # loop against the other
        core = os.environ.get(CORE_ENV)
        spin = os.environ.get(SPIN_ENV)
        spin_us = None if spin is None else float(spin)
        # the link profile's queue bound on the host's clock (a device's own uplink profile
        # shapes its impairments, not its queue)
        queue_ms = self.profile.dilated(self.dilation).queue_latency_ms
        program = ProgramOptions(spin_us=spin_us, queue_ms=queue_ms, core=core, cpusets=cpusets)
        switch = SerialSwitch(run_tag(self.run_id), paths, subnet, rate, program=program)
        self.switch = switch.start()  # a switch that fails to start removes what it made
        return {
            d.rank: Attachment(switch.address(d.rank), switch.interface) for d in backend.devices
        }

    def set_rates(self, rates: LinkRates, in_place: bool) -> None:
        """The profile's medium, then the ports' rates, changed in place whatever `in_place`
        says (the emulator has no other way: a port is never unshaped). Shaping anew removes
        the impairments, so that the probe measures the rate alone; `impair` adds them
        again."""
        assert self.switch is not None
        medium = (self.profile.medium, self.profile.dilated(self.dilation).airtime_us)
        if medium != self.medium:  # a trial of link.medium's other medium
            self.switch.set_medium(medium[0] == "shared", medium[1])
            self.medium = medium
        self.switch.set_rates(rates.uplink_mbit, rates.downlink_mbit, dict(rates.pair_mbit))
        if not in_place:
            paths = self.paths.within(rates.devices)
            for rank in range(rates.devices):
                self.switch.impair(rank, {}, 0)
            for rank in paths.downlink:
                self.switch.impair(rank, {}, 0, hop="down")
            for source, target in paths.pair:
                self.switch.impair(source, {}, 0, hop="pair", target=target)

    def impair(self, rates: LinkRates, step: int = 0) -> None:
        """Every port's impairments (its device's uplink profile), with a fresh generator
        seeded by that profile's seed (plus a trace's step), the device count, the swept rate
        and the port: a session that repeats another's traffic meets the same draws. Then
        the receivers' downlinks and the pairs (testbed.link.paths), each seeded likewise by
        its place, left alone by a trace's steps (which change the uplinks)."""
        assert self.switch is not None
        if not step:
            self.seeds = {}
        devices, swept = rates.devices, rates.swept_mbit
        for rank in range(devices):
            uplink = self.uplink(rank)
            seed = port_seed(uplink.seed + step, devices, swept, rank)
            self.switch.impair(rank, uplink.impairments(), seed)
            self.seeds[str(rank)] = seed
        if step:  # the later hops do not change with a trace's steps: their draws go on
            return
        paths = self.paths.within(devices)
        for rank, parameters in paths.downlink.items():
            seed = port_seed(self.profile.seed, devices, swept, f"down{rank}")
            self.switch.impair(rank, dict(parameters), seed, hop="down")
            self.seeds[f"down{rank}"] = seed
        for (source, target), parameters in paths.pair.items():
            seed = port_seed(self.profile.seed, devices, swept, f"{source}->{target}")
            self.switch.impair(source, dict(parameters), seed, hop="pair", target=target)
            self.seeds[f"{source}->{target}"] = seed

    def counters(self) -> dict[int, LinkCounters]:
        """Bytes carried (each device's `sl0` qdisc), every port's stalls and impairment
        events so far, and its counters (`PORT_COUNTED`)."""
        assert self.switch is not None
        ports = self.switch.stats()
        return {
            rank: LinkCounters(
                counter.sent_bytes,
                [(round(start * 1e9), round(ms * 1e6)) for start, ms in ports[rank]["stall_log"]],
                [(round(at * 1e9), what) for at, what in ports[rank]["event_log"]],
                {name: ports[rank][name] for name in PORT_COUNTED},
            )
            for rank, counter in super().counters().items()
        }

    def stats(self) -> dict[int, dict[str, object]] | None:
        return None if self.switch is None else self.switch.stats()

    def gone(self) -> str | None:
        status = None if self.switch is None else self.switch.exited()
        if status is None:
            return None
        try:
            killed = f" ({signal.Signals(-status).name})" if status < 0 else ""
        except ValueError:
            killed = ""
        return f"the serial link emulator exited with status {status}{killed}"

    def stop(self) -> None:
        if self.switch is not None:
            self.switch.stop()
            self.switch = None
