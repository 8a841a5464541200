"""The rate probe: a fixed byte count sent from one device to another, timed by the receiver
(`devices.probe`) after its first tenth, so that the bucket and TCP slow start stay out.
"""

from __future__ import annotations

import json

from testbed.backends.base import Backend, Device
from testbed.errors import ShapingError
from testbed.link.wire import FULL_FRAME_BYTES, TCP_MSS_BYTES

PROBE_PORT = 5201
# links meter whole Ethernet frames; the probe counts TCP payload (a full frame of 1514 bytes
# carries 1448 payload bytes)
WIRE_PER_PAYLOAD = FULL_FRAME_BYTES / TCP_MSS_BYTES


def probe_bytes(rate_mbit: float, seconds: float) -> int:
    """The payload that keeps a link shaped to `rate_mbit` busy for `seconds`."""
    return max(1, round(rate_mbit * 1e6 / 8 * seconds / WIRE_PER_PAYLOAD))


def probe(
    backend: Backend, sender: Device, receiver: Device, byte_count: int, at_s: float | None = None
) -> float:
    """Achieved rate (10^6 bit/s) from sender to receiver, measured at the receiver; the
    sender starts at `at_s` (time.time()) where given.

    A fixed byte count, not a duration: a timed sender would go on filling its socket buffer
    and the probe would last that much longer on a slow link."""
    python = backend.python
    server = backend.spawn(
        receiver,
        [
            python,
            "-m",
            "devices.probe",
            "serve",
            "--host",
            receiver.address,
            "--port",
            str(PROBE_PORT),
            "--once",
        ],
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
                *([] if at_s is None else ["--at", repr(at_s)]),
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
