"""Per-device and per-direction rates on real links: two local devices, device 0's uplink at
2 Mbit/s and device 1's at 10, each direction's probe within 5% of its own rate, with the
tbf emulator (a tbf per uplink) and the serial one (its ports' rates); a downlink through an
ifb, a pair cap through htb and u32, and a trace step changing them in place.

Rates are judged as the shaper meters them: the probe's TCP payload rate times 1514 / 1448
(`WIRE_PER_PAYLOAD`). Probes are short (0.5 s of traffic at the target); on the serial link
each is judged while the machine ran the emulator (`stalls.py`: CI saw a 10 Mbit/s probe
read 8.80 once)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.backends.base import DeviceSpec
from testbed.backends.local import LocalBackend
from testbed.experiment.profiles import load_profile
from testbed.kernel.netns import remove_leftovers
from testbed.link.emulators import EMULATORS
from testbed.link.links import Links, LinkState
from testbed.link.probe import WIRE_PER_PAYLOAD, probe, probe_bytes
from testbed.link.rates import RateOverrides

from .stalls import TOLERANCE, holds_rate, stalled_ms

pytestmark = pytest.mark.netns

PROBE_S = 0.5


@pytest.fixture
def backend(root: None, tmp_path: Path) -> Iterator[LocalBackend]:
    """Two local devices, removed (namespaces and all) whether the test passed or not."""
    run_id = uuid.uuid4().hex[:12]
    devices = LocalBackend(run_id, tmp_path)
    try:
        devices.start(DeviceSpec(count=2, cpus=1, memory_mb=512))
        yield devices
    finally:
        devices.stop()
        remove_leftovers(run_id)


def shaped(backend: LocalBackend, emulator: str, overrides: RateOverrides, swept: float):
    profile, kind = load_profile("ideal"), EMULATORS[emulator]
    links = Links(backend, profile, kind, backend.run_id, overrides)
    return links, links.shape(swept, PROBE_S)


def wire(state: LinkState, key: str) -> float:
    return state.transfers[key]["measured_mbit"] * WIRE_PER_PAYLOAD


def holds(state: LinkState, key: str, target: float) -> bool:
    """The probe `key` at `target` within 5%, the serial emulator's stalls excused (all of
    the link's, which the probes of a shaping share)."""
    return holds_rate(wire(state, key), target, PROBE_S, stalled_ms(state.emulator_stats))


@pytest.mark.parametrize("emulator", ["tbf", "serial"])
def test_each_uplink_holds_its_own_rate(backend: LocalBackend, emulator: str, record_property):
    overrides = RateOverrides(uplink_mbit={0: 2.0, 1: 10.0})
    links, state = shaped(backend, emulator, overrides, swept=5.0)
    with links:
        record_property("wire_mbit", {k: round(wire(state, k), 3) for k in state.transfers})
        print(f"\n{emulator}: " + ", ".join(f"{k} {wire(state, k):.3f}" for k in state.transfers))
        assert state.uplink_mbit == {0: 2.0, 1: 10.0}
        assert state.uplink_probe == {0: "0->1", 1: "1->0"}
        assert state.downlink_probe == {0: "1->0", 1: "0->1"}  # the same two transfers
        assert holds(state, "0->1", 2.0), state.emulator_stats
        assert holds(state, "1->0", 10.0), state.emulator_stats
        assert stalled_ms(state.emulator_stats) or not (state.flagged(0) or state.flagged(1))


def test_a_downlink_is_shaped_on_an_ifb(backend: LocalBackend, record_property):
    overrides = RateOverrides(downlink_mbit={1: 3.0})
    links, state = shaped(backend, "tbf", overrides, swept=10.0)
    with links:
        print(f"\nifb: 0->1 {wire(state, '0->1'):.3f}, 1->0 {wire(state, '1->0'):.3f}")
        record_property("wire_mbit", {k: round(wire(state, k), 3) for k in state.transfers})
        assert wire(state, "0->1") == pytest.approx(3.0, rel=TOLERANCE)  # device 1's downlink
        assert wire(state, "1->0") == pytest.approx(10.0, rel=TOLERANCE)  # unshaped downlink
        receiver = links.devices[1]
        text = backend.traffic_control.stats(receiver)
        assert "qdisc ingress ffff:" in text, text
        sent = re.search(r"Sent (\d+) bytes", text)
        assert sent and int(sent.group(1)) > 0, text


def test_a_pair_cap_and_a_trace_step_change_in_place(backend: LocalBackend, record_property):
    """0->1 capped at 4 inside an uplink of 10 (htb + u32); then the swept rate halves, as a
    trace would, and every class follows in place (`tc class change`)."""
    overrides = RateOverrides(pair_mbit={(0, 1): 4.0})
    links, state = shaped(backend, "tbf", overrides, swept=10.0)
    with links:
        print(f"\nhtb: 0->1 {wire(state, '0->1'):.3f}, 1->0 {wire(state, '1->0'):.3f}")
        assert wire(state, "0->1") == pytest.approx(4.0, rel=TOLERANCE)
        assert wire(state, "1->0") == pytest.approx(10.0, rel=TOLERANCE)
        links.set_rate(5.0)  # every rate x 0.5: the pair's cap 2, device 1's uplink 5
        sender, receiver = links.devices
        capped = probe(backend, sender, receiver, probe_bytes(2.0, PROBE_S)) * WIRE_PER_PAYLOAD
        back = probe(backend, receiver, sender, probe_bytes(5.0, PROBE_S)) * WIRE_PER_PAYLOAD
        print(f"after the step: 0->1 {capped:.3f}, 1->0 {back:.3f}")
        record_property("after_step_wire_mbit", [round(capped, 3), round(back, 3)])
        assert capped == pytest.approx(2.0, rel=TOLERANCE)
        assert back == pytest.approx(5.0, rel=TOLERANCE)
        assert "qdisc htb 1: root" in backend.traffic_control.stats(sender)


def test_a_serial_downlink_slows_what_its_device_receives(backend: LocalBackend):
    """The serial emulator clocks a frame at the least of uplink and downlink; the sender's
    backpressure gets an htb class at the receiver's downlink."""
    overrides = RateOverrides(downlink_mbit={1: 3.0})
    links, state = shaped(backend, "serial", overrides, swept=10.0)
    with links:
        print(f"\nserial down: 0->1 {wire(state, '0->1'):.3f}, 1->0 {wire(state, '1->0'):.3f}")
        assert holds(state, "0->1", 3.0), state.emulator_stats
        assert holds(state, "1->0", 10.0), state.emulator_stats
        assert "qdisc htb 1: root" in backend.traffic_control.stats(links.devices[0])
