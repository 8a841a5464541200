"""The serial link's arithmetic, parsing and forwarding, without root or sockets."""

from __future__ import annotations

import ipaddress
import json
import math
import socket
import struct
import sys
import time

import pytest

from devices.clock import SO_TIMESTAMPNS_NEW, SO_TIMESTAMPNS_OLD, kernel_timestamp_ns
from testbed.errors import ShapingError
from testbed.experiment.netem_parameters import checked
from testbed.kernel.interfaces import offload_argv
from testbed.kernel.names import SERIAL_SUFFIX
from testbed.kernel.netns import in_netns
from testbed.kernel.tbf import tbf_params
from testbed.link.serial.netem_draws import Impairments
from testbed.link.serial.port import Port, PortCounters, wait_until
from testbed.link.serial.program import Switch, parse_args
from testbed.link.serial.protocol import Command, parse_command, parse_cpu_list, parse_port
from testbed.link.serial.switch import ProgramOptions, SerialSwitch
from testbed.link.wire import (
    FULL_FRAME_BYTES,
    MIN_QUEUE_FRAMES,
    TRUESIZE_BYTES,
    departure_s,
    queue_frames,
    queue_held_ms,
    rcvbuf_request_bytes,
    tcp_message_wire_s,
    wire_time_s,
)

MBIT = 1_000_000


def test_wire_time_counts_every_byte_of_the_frame() -> None:
    assert wire_time_s(1514, 1 * MBIT) == pytest.approx(12.112e-3)
    assert wire_time_s(60, 20 * MBIT) == pytest.approx(24e-6)
    with pytest.raises(ShapingError, match="positive"):
        wire_time_s(100, 0)


def test_an_idle_line_starts_a_frame_when_it_arrives() -> None:
    start, end = departure_s(arrival_s=10.0, free_at_s=9.0, frame_bytes=250, rate_bit_s=MBIT)
    assert start == 10.0
    assert end == pytest.approx(10.002)


def test_back_to_back_frames_leave_one_wire_time_apart() -> None:
    free_at, ends = 0.0, []
    for _ in range(100):  # all arrived together: a burst waits in the queue
        _, free_at = departure_s(0.0, free_at, 1514, 10 * MBIT)
        ends.append(free_at)
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    assert gaps == pytest.approx([1.2112e-3] * 99)
    assert ends[-1] == pytest.approx(100 * 1.2112e-3)  # nothing adds up beyond the wire


def test_the_schedule_ignores_how_late_frames_were_read() -> None:
    """Frames arriving at the rate keep their schedule; only timestamps and ends matter."""
    wire = wire_time_s(1514, 20 * MBIT)
    free_at = 0.0
    for k in range(1000):
        start, free_at = departure_s(k * wire, free_at, 1514, 20 * MBIT)
        assert start == pytest.approx(k * wire)
    assert free_at == pytest.approx(1000 * wire)


def test_an_idle_gap_resets_the_schedule() -> None:
    _, first_end = departure_s(0.0, 0.0, 1514, MBIT)
    start, _ = departure_s(1.0, first_end, 1514, MBIT)
    assert start == 1.0


def test_a_rate_change_applies_from_the_next_frame() -> None:
    _, end_1 = departure_s(0.0, 0.0, 1250, 1 * MBIT)  # 10 ms
    start_2, end_2 = departure_s(0.0, end_1, 1250, 10 * MBIT)  # queued behind it: 1 ms
    assert (end_1, start_2, end_2) == pytest.approx((0.010, 0.010, 0.011))


@pytest.mark.parametrize(
    ("payload_bytes", "wire_bytes"),
    [(14, 80), (200, 266), (1448, 1514), (1449, 1449 + 2 * 66), (15000, 15000 + 11 * 66)],
)
def test_tcp_message_wire_time_counts_headers_of_every_segment(
    payload_bytes: int, wire_bytes: int
) -> None:
    assert tcp_message_wire_s(payload_bytes, 2 * MBIT) == pytest.approx(wire_bytes * 8 / 2e6)


def test_queue_holds_tbf_latency_and_at_least_the_minimum() -> None:
    assert queue_frames(1 * MBIT) == MIN_QUEUE_FRAMES  # 50 ms at 1 Mbit/s is 5 frames
    assert queue_frames(100 * MBIT) == math.ceil(100e6 / 8 * 0.05 / 1514) + 2
    assert queue_frames(100 * MBIT, queue_ms=100) > queue_frames(100 * MBIT)
    assert rcvbuf_request_bytes(10) * 2 == 10 * TRUESIZE_BYTES  # the kernel doubles it


@pytest.mark.parametrize("rate_mbit", [0.41, 1.0, 7.0, 10.0, 20.0])
@pytest.mark.parametrize("queue_ms", [50.0, 1225.0])
def test_the_backpressure_tbf_queues_the_ports_frames(rate_mbit: float, queue_ms: float) -> None:
    # the tbf in front of a port holds what the port holds, in full frames (a third of a
    # frame of rounding), so that a burst is held back in it rather than dropped; at 0.41
    # Mbit/s and 50 ms it held 3 frames, the port 32
    port = queue_frames(rate_mbit * MBIT, queue_ms)
    tbf = tbf_params(rate_mbit, queue_latency_ms=queue_held_ms(rate_mbit * MBIT, queue_ms))
    assert tbf.limit_bytes / FULL_FRAME_BYTES == pytest.approx(port, abs=1)
    assert tbf.limit_bytes >= (port - 1) * FULL_FRAME_BYTES
    assert queue_held_ms(0.41 * MBIT) == pytest.approx(30 * 1514 * 8 / 410, rel=1e-9)  # 886 ms
    assert queue_held_ms(10 * MBIT) == 50.0


def test_kernel_timestamps_of_both_layouts() -> None:
    new = (socket.SOL_SOCKET, SO_TIMESTAMPNS_NEW, struct.pack("=qq", 1_700_000_000, 250_000_000))
    old = (socket.SOL_SOCKET, SO_TIMESTAMPNS_OLD, struct.pack("@ll", 1_700_000_001, 5))
    other = (socket.IPPROTO_IP, SO_TIMESTAMPNS_NEW, struct.pack("=qq", 1, 1))
    assert kernel_timestamp_ns([new]) == 1_700_000_000_250_000_000
    assert kernel_timestamp_ns([other, old]) == 1_700_000_001_000_000_005
    assert kernel_timestamp_ns([other]) is None
    assert kernel_timestamp_ns([]) is None


def test_wait_until_returns_at_or_after_the_deadline() -> None:
    deadline = time.time() + 0.002
    wait_until(deadline, spin_s=150e-6)
    assert time.time() >= deadline
    began = time.time()
    wait_until(began - 1.0, spin_s=150e-6)  # already past: no sleep
    assert time.time() - began < 0.01


def test_port_arguments() -> None:
    assert parse_port("tb0123abcds0=1000000") == ("tb0123abcds0", 1e6)
    assert parse_port("eth0=2.5e6") == ("eth0", 2.5e6)
    for bad in ("eth0", "=5", "a-name-that-is-too-long=5", "eth0=0", "eth0=-1", "eth0=fast"):
        with pytest.raises(ShapingError, match="port"):
            parse_port(bad)
    with pytest.raises(ShapingError, match="positive"):
        parse_port("eth0=nan")


def test_serve_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["serve", "a=1e6", "b=2000000", "--spin-us", "0"])
    assert args.ports == [("a", 1e6), ("b", 2e6)] and args.spin_us == 0
    assert args.queue_ms == 50
    bad_argvs = [["serve", "a=1", "a=2"], ["serve", "a=x"], ["serve"]]
    for bad in [*bad_argvs, ["serve", "a=1", "--queue-ms", "0"]]:
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "given twice" in capsys.readouterr().err


def test_ports_are_served_on_their_devices_cpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_cpu_list("0") == {0} and parse_cpu_list("0,2-4") == {0, 2, 3, 4}
    with pytest.raises(ShapingError, match="expected numbers and ranges"):
        parse_cpu_list("a")
    args = parse_args(["serve", "a=1e6", "b=1e6", "--cpus", "a=1", "--cpus", "b=0,1"])
    assert args.cpus == {"a": {1}, "b": {0, 1}}
    with pytest.raises(SystemExit):
        parse_args(["serve", "a=1e6", "--cpus", "c=0"])
    assert "PORT one of ['a']" in capsys.readouterr().err
    pinned = ProgramOptions(cpusets=["1", None])
    argv = SerialSwitch("0123abcd", ["/x", "/y"], SUBNET, 1, program=pinned).emulator_argv()
    assert argv[-2:] == ["--cpus", "tb0123abcds0=1"]


def test_commands() -> None:
    ports = ["p0", "p1"]
    assert parse_command("stats\n", ports) == Command("stats")
    assert parse_command("rate p1 5000000", ports) == Command("rate", "p1", 5e6)
    with pytest.raises(ShapingError, match="unknown port 'p9'.*p0, p1"):
        parse_command("rate p9 5", ports)
    with pytest.raises(ShapingError, match="rate p0: the rate must be a positive number"):
        parse_command("rate p0 -5", ports)
    with pytest.raises(ShapingError, match="unknown command 'speed p0 5'"):
        parse_command("speed p0 5", ports)


def test_downlink_and_pair_commands() -> None:
    ports = ["p0", "p1"]
    assert parse_command("down p1 3000000", ports) == Command("down", "p1", 3e6)
    assert parse_command("down p1 0", ports) == Command("down", "p1", None)
    assert parse_command("pair p0 p1 2000000", ports) == Command("pair", "p0", 2e6, "p1")
    assert parse_command("pair p0 p1 0", ports) == Command("pair", "p0", None, "p1")
    with pytest.raises(ShapingError, match="pair: unknown port 'p7'"):
        parse_command("pair p0 p7 5", ports)
    with pytest.raises(ShapingError, match="down p0: the rate must be a positive number"):
        parse_command("down p0 -1", ports)


def test_impair_commands_name_their_hop() -> None:
    ports = ["p0", "p1"]
    delay = checked({"delay_ms": 3})
    assert parse_command('impair-pair p0 p1 5 {"delay_ms": 3}', ports) == Command(
        "impair-pair", "p0", target="p1", seed=5, parameters=delay
    )
    assert parse_command('impair-down p1 6 {"delay_ms": 3}', ports) == Command(
        "impair-down", "p1", seed=6, parameters=delay
    )
    with pytest.raises(ShapingError, match="impair-pair: unknown port 'p9'"):
        parse_command("impair-pair p0 p9 5 {}", ports)
    with pytest.raises(ShapingError, match="impair-pair: expected 'impair-pair SRC DST SEED"):
        parse_command("impair-pair p0 5 {}", ports)
    with pytest.raises(ShapingError, match="impair-down p0: the seed must be a whole number"):
        parse_command("impair-down p0 x {}", ports)
    with pytest.raises(ShapingError, match="impair-pair p0 p1: loss_pct"):
        parse_command('impair-pair p0 p1 1 {"loss_pct": 101}', ports)


def test_counters_keep_totals_means_and_maxima() -> None:
    counters = PortCounters()
    counters.record(1514, queued_s=0.0, late_s=10e-6, due_s=100.0)
    counters.record(66, queued_s=2e-3, late_s=30e-6, due_s=100.001)
    stats = counters.as_dict()
    assert (stats["frames"], stats["bytes"]) == (2, 1580)
    assert (stats["queued_us_mean"], stats["queued_us_max"]) == (1000.0, 2000.0)
    assert (stats["late_us_mean"], stats["late_us_max"]) == (20.0, 30.0)
    assert PortCounters().as_dict()["late_us_mean"] == 0.0


class FakePort:
    def __init__(self, name: str):
        self.name, self.sent, self.rates = name, [], []

    def transmit(self, frame: bytes) -> None:
        self.sent.append(frame)

    def set_rate(self, rate_bit_s: float) -> None:
        self.rates.append(rate_bit_s)

    def stats(self) -> dict[str, float]:
        return {"frames": len(self.sent)}


def frame(destination: str, source: str) -> bytes:
    return bytes.fromhex(destination.replace(":", "")) + bytes.fromhex(source.replace(":", ""))


A, B, C = "02:00:00:00:00:0a", "02:00:00:00:00:0b", "02:00:00:00:00:0c"
BROADCAST = "ff:ff:ff:ff:ff:ff"


def test_the_switch_floods_unknown_and_broadcast_then_learns() -> None:
    ports = [FakePort(name) for name in ("p0", "p1", "p2")]
    switch = Switch(ports)  # type: ignore[arg-type]
    switch.forward(ports[0], frame(BROADCAST, A))  # ARP request from A
    assert [len(p.sent) for p in ports] == [0, 1, 1]
    switch.forward(ports[1], frame(A, B))  # reply: A is known
    assert [len(p.sent) for p in ports] == [1, 1, 1]
    switch.forward(ports[0], frame(B, A))
    assert [len(p.sent) for p in ports] == [1, 2, 1]
    switch.forward(ports[0], frame("02:00:00:00:00:0c", A))  # unknown: flooded
    assert [len(p.sent) for p in ports] == [1, 3, 2]
    switch.forward(ports[0], frame("01:00:5e:00:00:01", A))  # multicast: flooded
    assert [len(p.sent) for p in ports] == [1, 4, 3]


def test_the_switch_drops_a_frame_for_the_port_it_came_from() -> None:
    ports = [FakePort("p0"), FakePort("p1")]
    switch = Switch(ports)  # type: ignore[arg-type]
    switch.forward(ports[0], frame(BROADCAST, A))
    switch.forward(ports[0], frame(BROADCAST, B))  # B sits behind port 0 too
    switch.forward(ports[0], frame(B, A))
    assert [len(p.sent) for p in ports] == [0, 2]


def test_the_switch_answers_commands() -> None:
    ports = [FakePort("p0"), FakePort("p1")]
    switch = Switch(ports)  # type: ignore[arg-type]
    assert switch.execute("rate p1 2000000\n") == "ok"
    assert ports[1].rates == [2e6]
    assert json.loads(switch.execute("stats")) == {"p0": {"frames": 0}, "p1": {"frames": 0}}
    assert switch.execute("rate p1 zero").startswith("error rate p1:")


class RatedPort(FakePort):
    def __init__(self, name: str, rate_bit_s: float):
        super().__init__(name)
        self.rate_bit_s, self.down_bit_s = rate_bit_s, None
        self.down_impairments, self.hops, self.hop_delay_s = None, False, 0.0
        self.resized = 0

    def _size_queue(self) -> None:
        self.resized += 1

    def tell_core(self) -> None:  # no core here
        pass

    def set_down(self, rate_bit_s: float | None) -> None:
        self.down_bit_s = rate_bit_s


def test_a_frame_takes_the_least_of_uplink_downlink_and_pair() -> None:
    ports = [RatedPort("p0", 2e6), RatedPort("p1", 10e6)]
    switch = Switch(ports)  # type: ignore[arg-type]
    to_b, to_a = frame(B, A), frame(A, B)

    def rate(port, frame):
        bit_s, hops = switch.route(port, frame)
        assert hops == ()
        return bit_s

    assert rate(ports[0], to_b) == 2e6  # B not learned yet: the uplink
    switch.forward(ports[1], frame(BROADCAST, B))
    switch.forward(ports[0], frame(BROADCAST, A))
    assert rate(ports[0], to_b) == 2e6 and rate(ports[1], to_a) == 10e6
    assert switch.execute("down p0 3000000") == "ok"
    assert rate(ports[1], to_a) == 3e6  # p0's downlink
    assert rate(ports[1], frame(BROADCAST, B)) == 10e6  # broadcasts: the uplink
    assert switch.execute("pair p1 p0 1000000") == "ok"
    assert rate(ports[1], to_a) == 1e6
    assert switch.execute("pair p1 p0 0") == "ok" and switch.execute("down p0 0") == "ok"
    assert rate(ports[1], to_a) == 10e6


def test_later_hops_are_the_pairs_then_the_receivers_downlink() -> None:
    """impair-pair and impair-down add hops to the frames of a learned receiver; the
    senders that may meet them read ahead, their queues sized for the longest delay."""
    ports = [RatedPort("p0", 2e6), RatedPort("p1", 10e6), RatedPort("p2", 10e6)]
    switch = Switch(ports)  # type: ignore[arg-type]
    for port, mac in zip(ports, (A, B, C), strict=True):
        switch.forward(port, frame(BROADCAST, mac))
    assert switch.execute('impair-pair p1 p0 7 {"delay_ms": 40}') == "ok"
    rate, hops = switch.route(ports[1], frame(A, B))
    assert rate == 10e6 and [hop.max_delay_s for hop in hops] == [0.04]
    assert switch.route(ports[2], frame(A, C)) == (10e6, ())  # not that pair
    assert switch.route(ports[1], frame(BROADCAST, B)) == (10e6, ())
    assert [p.hop_delay_s for p in ports] == [0.0, 0.04, 0.0] and ports[1].resized == 1
    assert switch.execute('impair-down p0 3 {"delay_ms": 5, "loss_pct": 1}') == "ok"
    _, hops = switch.route(ports[1], frame(A, B))
    assert [hop.max_delay_s for hop in hops] == [0.04, 0.005]  # the pair's, then p0's downlink
    assert [p.hop_delay_s for p in ports] == pytest.approx([0.0, 0.045, 0.005])
    assert [p.hops for p in ports] == [False, True, True]
    assert switch.execute("impair-pair p1 p0 7 {}") == "ok"
    assert switch.execute("impair-down p0 3 {}") == "ok"
    assert [p.hops for p in ports] == [False] * 3 and switch.route(ports[1], frame(A, B))[1] == ()
    answer = switch.execute('impair-down p0 3 {"delay_ms": -1}')
    assert answer.startswith("error impair-down p0: delay_ms")


def test_each_copy_meets_the_later_hops_in_turn() -> None:
    port = Port("p0", 1e6, 50.0, 0.0)
    delayed, doubled = Impairments({"delay_ms": 40}, 1), Impairments({"duplicate_pct": 100}, 2)
    assert port._hop_delays([delayed, doubled], 0.0) == pytest.approx([0.04, 0.04])
    assert port.counters.duplicated == 1 and port.counters.lost == 0
    assert port._hop_delays([Impairments({"loss_pct": 100}, 3), delayed], 0.0) == []
    assert port.counters.lost == 1
    reordered = Impairments({"delay_ms": 40, "reorder_pct": 100}, 4)
    assert port._hop_delays([reordered], 0.0) == [0.0] and port.counters.reordered == 1


SUBNET = ipaddress.IPv4Network("10.214.3.0/24")


def test_serial_switch_names_and_addresses() -> None:
    switch = SerialSwitch("0123abcd", ["/proc/1/ns/net", "/var/run/netns/x"], SUBNET, 2.5)
    assert switch.netns == f"tb-0123abcd-{SERIAL_SUFFIX}" == "tb-0123abcd-sl"
    assert switch.netns_path == "/var/run/netns/tb-0123abcd-sl"
    assert [switch.port(r) for r in (0, 1)] == ["tb0123abcds0", "tb0123abcds1"]
    assert [switch.address(r) for r in (0, 1)] == ["10.214.3.1", "10.214.3.2"]
    assert switch.interface == "sl0"
    argv = switch.emulator_argv()
    assert argv[:3] == ["nsenter", "--net=/var/run/netns/tb-0123abcd-sl", sys.executable]
    ports = [f"tb0123abcds{rank}=2500000" for rank in (0, 1)]
    assert argv[3:] == ["-m", "testbed.link.serial.program", "serve", *ports]
    spinning = SerialSwitch("0123abcd", ["/x"], SUBNET, 1, program=ProgramOptions(spin_us=0))
    assert "--spin-us" in spinning.emulator_argv()


def test_serial_switch_refuses_bad_input() -> None:
    with pytest.raises(ShapingError, match="tag 'run-1'"):
        SerialSwitch("run-1", ["/x"], SUBNET, 1)
    with pytest.raises(ShapingError, match="255 devices do not fit"):
        SerialSwitch("0123abcd", ["/x"] * 255, SUBNET, 1)
    with pytest.raises(ShapingError, match="rate must be positive"):
        SerialSwitch("0123abcd", ["/x"], SUBNET, 0)
    switch = SerialSwitch("0123abcd", ["/x"], SUBNET, 1)
    with pytest.raises(ShapingError, match="too long"):
        switch.port(10_000)
    with pytest.raises(ShapingError, match="cannot set rank 3"):
        switch.set_rate(3, 5)
    with pytest.raises(ShapingError, match="is not running"):
        switch.set_rate(0, 5)
    switch.stop()  # nothing was started: nothing to do


def test_offloads_include_transmit_checksums() -> None:
    argv = in_netns("/proc/7/ns/net", offload_argv("sl0", checksums=True))
    assert argv[:4] == ["nsenter", "--net=/proc/7/ns/net", "ethtool", "-K"]
    assert " ".join(argv[4:]) == "sl0 gso off tso off gro off tx off"


def test_a_run_of_late_frames_counts_as_one_stall_of_its_first_frames_lateness():
    counters = PortCounters()
    lateness_s = (0.0001, 0.004, 0.003, 0.0009, 0.0002, 0.0015, 0.0001)
    for frame, late_s in enumerate(lateness_s):
        counters.record(1514, 0.0, late_s, due_s=100.0 + frame / 1000)
    stats = counters.as_dict()
    assert (stats["stalls"], stats["stalled_ms"]) == (2, 5.5)
    assert stats["stall_log"] == [[100.001, 4.0], [100.005, 1.5]]  # when each began, its ms
    assert stats["late_us_max"] == 4000.0
