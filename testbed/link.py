"""The links of a run's devices: shape every device's egress, then measure what it achieves.

Each device's egress is shaped to the trial's rate, so every directed pair of devices sees
that rate. After every change a probe measures each device's sending rate (device i to
device i + 1, in turn, so probes never share a link; `link.probe_s` seconds of traffic at
the target rate, timed after its first tenth) and the result is flagged when it is more
than 5% off the target.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from testbed import shaping
from testbed.backends.base import Backend, Device
from testbed.errors import ShapingError
from testbed.profiles import LinkProfile

log = logging.getLogger(__name__)

RATE_TOLERANCE = 0.05
PROBE_PORT = 5201
# tbf meters whole Ethernet frames; the probe counts TCP payload. With a 1500-byte MTU and
# TCP timestamps (Linux's default) a full frame of 1514 bytes carries 1448 payload bytes.
WIRE_PER_PAYLOAD = 1514 / 1448


@dataclass
class LinkState:
    rate_mbit: float
    measured_mbit: dict[int, float] = field(default_factory=dict)  # by sending rank
    qdisc: dict[int, str] = field(default_factory=dict)  # `tc -s qdisc` text by rank

    def wire_mbit(self, rank: int) -> float | None:
        """The probe's payload rate as the frame rate tbf enforces (headers included)."""
        measured = self.measured_mbit.get(rank)
        return None if measured is None else measured * WIRE_PER_PAYLOAD

    def flagged(self, rank: int) -> bool:
        wire = self.wire_mbit(rank)
        return wire is None or abs(wire / self.rate_mbit - 1) > RATE_TOLERANCE


def shape_all(backend: Backend, profile: LinkProfile, rate_mbit: float) -> None:
    plan = shaping.plan(profile, rate_mbit)
    for device in backend.devices:
        log.debug("shaping %s/%s to %g Mbit/s", device.name, device.interface, rate_mbit)
        backend.shape(device, plan)


def qdisc_text(backend: Backend, device: Device) -> str:
    return backend.qdisc_stats(device)


def probe_bytes(rate_mbit: float, seconds: float) -> int:
    """The payload that keeps a link shaped to `rate_mbit` busy for `seconds`."""
    return max(1, round(rate_mbit * 1e6 / 8 * seconds / WIRE_PER_PAYLOAD))


def probe(backend: Backend, sender: Device, receiver: Device, byte_count: int) -> float:
    """Achieved rate (10^6 bit/s) from sender to receiver, measured at the receiver.

    A fixed byte count, not a duration: a timed sender would go on filling its socket buffer
    and the probe would last that much longer on a slow link."""
    python = backend.python
    server = backend.spawn(
        receiver, [python, "-m", "devices.probe", "serve", "--port", str(PROBE_PORT), "--once"]
    )
    try:
        client = backend.run(
            sender,
            [
                python,
                "-m",
                "devices.probe",
                "send",
                "--to",
                f"{receiver.address}:{PROBE_PORT}",
                "--bytes",
                str(byte_count),
            ],
            timeout_s=60,
        )
        server.wait(30)
    finally:
        server.kill()
    if not client.ok:
        raise ShapingError(
            f"rate probe from device {sender.rank} to device {receiver.rank} failed: "
            f"{client.tail(3)}"
        )
    line = client.stdout.strip().splitlines()[-1]
    return float(json.loads(line)["mbit_per_s"])


def shape_and_probe(
    backend: Backend, profile: LinkProfile, rate_mbit: float, probe_seconds: float
) -> LinkState:
    shape_all(backend, profile, rate_mbit)
    state = LinkState(rate_mbit)
    devices = backend.devices
    byte_count = probe_bytes(rate_mbit, probe_seconds)
    if len(devices) > 1:
        for device in devices:
            peer = devices[(device.rank + 1) % len(devices)]
            state.measured_mbit[device.rank] = probe(backend, device, peer, byte_count)
    for device in devices:
        state.qdisc[device.rank] = qdisc_text(backend, device)
        if len(devices) > 1 and state.flagged(device.rank):
            log.warning(
                "device %d achieves %.2f Mbit/s, more than 5%% off the %g Mbit/s target",
                device.rank,
                state.measured_mbit[device.rank],
                rate_mbit,
            )
    return state
