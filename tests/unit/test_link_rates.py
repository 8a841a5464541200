"""The rates a trial's links are shaped to (`testbed.link.rates`): how per-device and per-pair
rates combine, how a trace's step scales them and what the probe checks; and `Links`, which
shapes each device with them and probes each direction, on a backend that records instead of
shaping."""

from __future__ import annotations

import pytest

from testbed.experiment.profiles import LinkProfile
from testbed.link.rates import LinkRates, RateOverrides, probe_plan

IDEAL = LinkProfile(name="ideal", rate_mbit=10)


# rates -----------------------------------------------------------------------------------------


def test_per_device_rates_replace_the_swept_one_and_pairs_take_the_least() -> None:
    overrides = RateOverrides({0: 2.0}, {2: 3.0}, {(1, 0): 1.0, (0, 5): 1.0})
    rates = overrides.resolve(10.0, 3)
    assert rates.uplink_mbit == (2.0, 10.0, 10.0)
    assert rates.downlink_mbit == (None, None, 3.0)
    assert rates.pair_mbit == {(1, 0): 1.0}  # device 5 is not in a 3-device trial
    assert rates.path_mbit(0, 1) == 2.0  # the sender's uplink
    assert rates.path_mbit(1, 2) == 3.0  # the receiver's downlink
    assert rates.path_mbit(1, 0) == 1.0  # the pair's cap
    assert rates.peer_caps_mbit(1) == {0: 1.0}
    assert RateOverrides(pair_mbit={(0, 1): 20.0}).resolve(10.0, 2).peer_caps_mbit(0) == {}


def test_a_trace_step_scales_every_rate() -> None:
    rates = RateOverrides({0: 2.0}, {1: 4.0}, {(1, 0): 1.0}).resolve(10.0, 2).scaled(5.0)
    assert rates.swept_mbit == 5.0
    assert rates.uplink_mbit == (1.0, 5.0)
    assert rates.downlink_mbit == (None, 2.0)
    assert rates.pair_mbit == {(1, 0): 0.5}


def test_the_probe_is_a_ring_when_every_device_has_the_same_rates() -> None:
    probes = probe_plan(LinkRates.uniform(10.0, 3))
    assert probes.transfers == ((0, 1), (1, 2), (2, 0))
    assert probes.uplink == {0: (0, 1), 1: (1, 2), 2: (2, 0)}
    assert probes.downlink == {0: (2, 0), 1: (0, 1), 2: (1, 2)}
    assert probe_plan(LinkRates.uniform(10.0, 1)).transfers == ()


def test_a_downlink_is_probed_from_its_fastest_sender_and_every_pair_on_its_own() -> None:
    # device 0 is slow (2), so device 1's downlink (5) is checked from device 2 (10)
    rates = RateOverrides({0: 2.0}, {1: 5.0}, {(2, 0): 1.0}).resolve(10.0, 3)
    probes = probe_plan(rates)
    assert probes.downlink[1] == (2, 1)
    assert probes.downlink[0] == (1, 0)  # device 2 -> 0 is capped at 1: device 1 is faster
    assert probes.transfers == ((0, 1), (1, 2), (2, 0), (1, 0), (2, 1))


# Links, with a backend that records instead of shaping ------------------------------------------


class RecordingTrafficControl:
    """Records each plan in `calls` (the backend's, which the probe shares) instead of shaping."""

    def __init__(self, calls: list[tuple[str, int, object]]):
        self.calls = calls

    def apply(self, device, shaping) -> None:
        self.calls.append(("shape", device.rank, shaping))

    def change(self, device, shaping) -> None:
        self.calls.append(("change", device.rank, shaping))

    def stats(self, device) -> str:
        return "qdisc tbf 1: root\n Sent 0 bytes 0 pkt"


class RecordingBackend:
    name, python = "fake", "python"
    on_this_host = False  # no tc of its own to ask about netem's seed

    def __init__(self, count: int):
        from testbed.backends.base import Device

        self.devices = [Device(r, f"d{r}", f"10.0.0.{r + 1}", "eth0", 1.0, 1) for r in range(count)]
        self.calls: list[tuple[str, int, object]] = []
        self.traffic_control = RecordingTrafficControl(self.calls)

    def for_each(self, devices, action) -> None:
        for device in devices:
            action(device)


def test_links_shape_each_device_probe_each_direction_and_scale_in_place(monkeypatch) -> None:
    from testbed.link import links as links_module
    from testbed.link.links import Links
    from testbed.link.probe import WIRE_PER_PAYLOAD
    from testbed.link.token_bucket import TokenBucket

    backend = RecordingBackend(3)
    achieved = {(0, 1): 2.0, (1, 2): 10.0, (2, 0): 10.0, (1, 0): 1.3, (2, 1): 3.0}
    monkeypatch.setattr(
        links_module,
        "probe",
        lambda _, sender, receiver, __: achieved[(sender.rank, receiver.rank)] / WIRE_PER_PAYLOAD,
    )
    overrides = RateOverrides({0: 2.0}, {1: 3.0}, {(1, 0): 1.0})
    links = Links(backend, IDEAL, TokenBucket, "run", overrides)  # type: ignore[arg-type]
    state = links.shape(10.0, 0.5)

    plans = {rank: shaping for _, rank, shaping in backend.calls}
    assert [kind for kind, _, _ in backend.calls] == ["shape"] * 3
    assert plans[0].rate_mbit == 2.0 and plans[0].is_tbf_only
    assert plans[1].htb is not None and plans[1].htb.peers[0].address == "10.0.0.1"
    assert plans[1].downlink is not None and plans[1].downlink.rate_bit_s == 3_000_000
    assert state.uplink_mbit == {0: 2.0, 1: 10.0, 2: 10.0}
    assert state.downlink_mbit == {0: None, 1: 3.0, 2: None}
    assert state.pair_mbit == {"1->0": 1.0}
    assert state.uplink_probe == {0: "0->1", 1: "1->2", 2: "2->0"}
    assert state.downlink_probe == {0: "2->0", 1: "2->1", 2: "1->2"}
    assert state.transfers["1->0"]["target_mbit"] == 1.0
    assert state.wire_mbit(0) == pytest.approx(2.0)
    assert state.downlink_wire_mbit(1) == pytest.approx(3.0)
    assert not state.flagged(0) and not state.flagged(1) and not state.flagged(2)
    assert state.transfer_flagged("1->0")  # 1.3 against a cap of 1: recorded and flagged

    backend.calls.clear()
    links.set_rate(5.0)  # a trace step: every rate halved, in place
    changed = {rank: shaping for kind, rank, shaping in backend.calls if kind == "change"}
    assert len(changed) == 3 and len(backend.calls) == 3
    assert [changed[r].rate_mbit for r in range(3)] == [1.0, 5.0, 5.0]
    assert changed[1].downlink is not None and changed[1].downlink.rate_bit_s == 1_500_000
    assert changed[1].htb is not None and changed[1].htb.peers[0].ceil_bit_s == 500_000


def test_tbf_probes_the_rates_alone_then_adds_the_netems_and_steps_carry_them(monkeypatch):
    """The user guide's order: rates shaped, probed, then the impairments added; a trace's
    step changes rate and netem in place, and a step without impairments leaves the netem
    idle rather than the last step's."""
    from testbed.experiment.profiles import LinkProfile
    from testbed.link import links as links_module
    from testbed.link.links import Links
    from testbed.link.probe import WIRE_PER_PAYLOAD
    from testbed.link.token_bucket import TokenBucket

    backend = RecordingBackend(2)
    monkeypatch.setattr(TokenBucket, "refusal", classmethod(lambda *_: None))  # no kernel probe

    def probe(_, sender, receiver, __):
        backend.calls.append(("probe", sender.rank, None))
        return 10.0 / WIRE_PER_PAYLOAD

    monkeypatch.setattr(links_module, "probe", probe)
    lossy = LinkProfile(name="lossy", delay_ms=20, loss_pct=1)
    links = Links(backend, lossy, TokenBucket, "run")  # type: ignore[arg-type]
    links.shape(10.0, 0.5)
    kinds = [
        (kind, shaping is not None and shaping.netem is not None)
        for kind, _, shaping in backend.calls
    ]
    assert kinds == [("shape", False)] * 2 + [("probe", False)] * 2 + [("shape", True)] * 2

    backend.calls.clear()
    links.set_rate(5.0, {"delay_ms": 40, "loss_pct": 5}, step=1)
    changed = [shaping for kind, _, shaping in backend.calls]
    assert [kind for kind, _, _ in backend.calls] == ["change"] * 2  # once each, not twice
    assert changed[0].netem.impairments["delay_ms"] == 40
    assert changed[0].netem.impairments["loss_pct"] == 5

    backend.calls.clear()
    links.set_rate(5.0, {"delay_ms": 0, "loss_pct": 0}, step=2)
    idle = backend.calls[0][2]
    assert idle.netem is not None and idle.netem.impairments["delay_ms"] == 0
    assert idle.netem.impairments["loss_pct"] == 0
