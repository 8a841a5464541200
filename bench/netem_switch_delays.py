"""The serial emulator's delays as its switch delivers them, for `python -m bench.netem_conformance
--netns` (as root): two network namespaces joined by `testbed.link.serial.switch.SerialSwitch`
(C core, no tbf in front, 100 Mbit/s), the sender's uplink impaired, isolated TCP messages of
14 bytes 40 ms apart (bench.serial_link_check's endpoints: the receiver's kernel timestamp of
each message less the sender's clock before `sendall`). The same messages over the switch
without impairments first: their median (the stack's and the emulator's own time, the wire
time of a frame at 100 Mbit/s included) is taken off.

40 ms apart, a frame never waits behind the one before it under jitter up to ±20 ms, so what
arrives is what the emulator drew, through its real clock.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from bench.serial_link_check import SUBNET, Bed, _namespaces, message_latencies_s

RATE_MBIT = 100.0
MESSAGE_BYTES = 14
BASELINE_MESSAGES = 200


def switch_delays_ms(parameters: dict[str, Any], seed: int, count: int) -> list[float]:
    """`count` messages' one-way delays through the switch with `parameters` on the sender's
    uplink, less the unimpaired switch's median."""
    from testbed.link.serial.switch import ProgramOptions, SerialSwitch

    with _namespaces(f"tbconf-{os.getpid()}") as names:
        paths = [f"/var/run/netns/{name}" for name in names]
        tag = f"{os.getpid() & 0xFFFFFFFF:08x}"
        with SerialSwitch(tag, paths, SUBNET, RATE_MBIT, False, ProgramOptions(core="c")) as switch:
            addresses = (switch.address(0), switch.address(1))
            bed = Bed("serial (c)", names, addresses, lambda rate: None)
            bare = message_latencies_s(bed, MESSAGE_BYTES, BASELINE_MESSAGES, RATE_MBIT)
            switch.impair(0, parameters, seed)
            impaired = message_latencies_s(bed, MESSAGE_BYTES, count, RATE_MBIT)
    own_s = statistics.median(bare)
    return [(latency - own_s) * 1e3 for latency in impaired]
