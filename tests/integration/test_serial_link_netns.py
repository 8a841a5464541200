"""The serial link for real: two device namespaces joined by a `SerialSwitch`.

What is judged, all by the receiver's kernel receive timestamps (SO_TIMESTAMPNS), so that a
receiver the scheduler delays does not skew it:

- An isolated 200-byte TCP message at 1 Mbit/s takes its wire time, (200 + 66) x 8 / rate (66:
  Ethernet, IP and TCP headers with timestamps), where tbf lets it through at once: never less
  (the emulator cannot send a frame before its last bit would have left), and the median within
  1.3 x wire + 0.3 ms. Latency = arrival of the last byte - the sender's time.time() before
  `sendall`, on one CLOCK_REALTIME.
- A bulk transfer, timed after its first tenth of the bytes (TCP's start-up), runs within 1 %
  of rate x MSS / 1514 (the payload share of full frames), without retransmissions.
- `set_rate` changes what a 15 KB message takes, down and up.
- `stop()` leaves no namespace, link or process behind.

The switch runs its C core here (a build that fails fails the tests); the Python loop is
judged in test_impairments_python_netns.

Device `a` is given to the switch as /var/run/netns/<name> (the local backend's kind of path),
device `b` as /proc/<pid>/ns/net of a process holding it (a container's kind).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from testbed.link.serial.switch import SerialSwitch
from testbed.link.wire import FULL_FRAME_BYTES, tcp_message_wire_s
from testbed.source import python_env
from tests.conftest import stolen_s
from tests.integration.conftest import SUBNET, Devices, namespaces

pytestmark = pytest.mark.netns
SWITCH_CORE = "c"  # the default loop (test_impairments_python_netns: the Python one)

PORT = 5311
MBIT = 1_000_000
BULK_S = 2.0
RATE_TOLERANCE = 0.01
MAX_STALLED_SHARE = 0.05  # of the bulk's steady time: more, and the machine is unfit to measure

TIMESTAMPS = """
import socket, struct
SO_TIMESTAMPNS = 35  # the asm-generic value (x86-64, arm64); the socket module lacks it
def arrival_s(ancillary):
    for level, kind, data in ancillary:
        if (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMPNS):
            seconds, nanoseconds = struct.unpack("qq", data[:16])
            return seconds + nanoseconds / 1e9
def server(address, port):
    server = socket.create_server((address, int(port)))
    server.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)  # inherited by the connection
    server.settimeout(15)
    print("ready", flush=True)
    conn, _ = server.accept()
    conn.settimeout(15)
    return conn
"""

MESSAGE_RECEIVER = (
    TIMESTAMPS
    + """
import json, sys
conn = server(sys.argv[1], sys.argv[2])
size, arrivals = int(sys.argv[3]), []
buffer = memoryview(bytearray(size))
for _ in range(int(sys.argv[4])):
    got = 0
    while got < size:
        n, ancillary, _, _ = conn.recvmsg_into([buffer[got:]], socket.CMSG_SPACE(16))
        assert n, "connection closed early"
        got, stamp = got + n, arrival_s(ancillary)
    arrivals.append(stamp)
print(json.dumps(arrivals))
"""
)

MESSAGE_SENDER = """
import json, socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=15)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
payload, sent = bytes(int(sys.argv[3])), []
for _ in range(int(sys.argv[4])):
    time.sleep(float(sys.argv[5]))
    sent.append(time.time())
    conn.sendall(payload)
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
print(json.dumps(sent))
"""

BULK_RECEIVER = (
    TIMESTAMPS
    + """
import json, sys
from devices.probe import receive_timed
conn = server(sys.argv[1], sys.argv[2])
timing = receive_timed(conn, kernel_stamps=True)
print(json.dumps({"steady_bytes": timing.steady_bytes, "steady_s": timing.steady_s}))
"""
)

BULK_SENDER = """
import json, socket, sys
def retransmissions():
    lines = [line.split() for line in open("/proc/net/snmp").read().splitlines()]
    header, values = (line[1:] for line in lines if line[0] == "Tcp:")
    return int(dict(zip(header, values))["RetransSegs"])
before = retransmissions()
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=15)
left, chunk = int(sys.argv[3]), bytes(1 << 16)
while left > 0:
    left -= conn.send(chunk[: min(left, len(chunk))])
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
mss = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
print(json.dumps({"mss": mss, "retransmissions": retransmissions() - before}))
"""


def run_pair(devices: Devices, receiver: list[str], sender: list[str]) -> tuple[str, str]:
    """A receiver script in b, then a sender script in a; their stdout."""
    exec_in = [["ip", "netns", "exec", name, sys.executable, "-c"] for name in devices.names]
    rx = subprocess.Popen(
        [*exec_in[1], *receiver],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),  # BULK_RECEIVER imports devices.probe
    )
    try:
        assert rx.stdout is not None
        assert rx.stdout.readline().strip() == "ready", rx.communicate()[1]
        tx = subprocess.run([*exec_in[0], *sender], capture_output=True, text=True, timeout=60)
        out, err = rx.communicate(timeout=30)
        assert rx.returncode == 0, f"receiver: {err}"
        assert tx.returncode == 0, f"sender: {tx.stderr}"
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()
    return out, tx.stdout


def message_times_s(
    devices: Devices, switch: SerialSwitch, size: int, count: int, gap_s: float
) -> list[tuple[float, float]]:
    """`count` messages of `size` bytes from a to b, `gap_s` apart: (sent, received) of each,
    by time.time() and the kernel's receive timestamp of its last byte."""
    to = [switch.address(1), str(PORT), str(size), str(count)]
    received, sent = run_pair(devices, [MESSAGE_RECEIVER, *to], [MESSAGE_SENDER, *to, str(gap_s)])
    return list(zip(json.loads(sent), json.loads(received), strict=True))


def message_latencies_s(
    devices: Devices, switch: SerialSwitch, size: int, count: int, gap_s: float
) -> list[float]:
    return [r - s for s, r in message_times_s(devices, switch, size, count, gap_s)]


def test_an_isolated_message_takes_its_wire_time(devices: Devices, switch: SerialSwitch) -> None:
    latencies_s = message_latencies_s(devices, switch, size=200, count=30, gap_s=0.04)
    wire_s = tcp_message_wire_s(200, 1 * MBIT)
    assert wire_s == pytest.approx(266 * 8 / 1e6)
    median_s = statistics.median(latencies_s)
    print(f"\n200 B at 1 Mbit/s: wire {wire_s * 1e3:.3f} ms, median {median_s * 1e3:.3f} ms")
    assert min(latencies_s) >= wire_s
    assert median_s <= 1.3 * wire_s + 0.3e-3


@pytest.mark.slow
@pytest.mark.parametrize("rate_mbit", [1, 20])
def test_bulk_runs_at_the_rate(devices: Devices, switch: SerialSwitch, rate_mbit: float) -> None:
    for rank in (0, 1):
        switch.set_rate(rank, rate_mbit)  # the switch started at 1 Mbit/s
    payload_bytes = int(rate_mbit * MBIT / 8 * BULK_S)
    to = [switch.address(1), str(PORT)]
    stolen_before_s = stolen_s()
    received, sent = run_pair(devices, [BULK_RECEIVER, *to], [BULK_SENDER, *to, str(payload_bytes)])
    stolen = stolen_s() - stolen_before_s
    result = {**json.loads(received), **json.loads(sent)}

    expected_mbit = rate_mbit * result["mss"] / FULL_FRAME_BYTES
    steady_bits = result["steady_bytes"] * 8
    achieved_mbit = steady_bits / result["steady_s"] / MBIT
    both = switch.stats()
    stats = both[0]
    # The machine sometimes does not run the emulator for 1-13 ms (kernel work; a VM's vCPU
    # run by its host for another guest: /proc/stat's steal, 40-190 ms in 3 s on a busy day
    # here), and the flow's link loses about that much. The switch counts those stalls; the
    # rate must hold while it ran, and the stalls the host's steal does not account for must
    # stay rare.
    stalled_s = sum(port["stalled_ms"] for port in both.values()) / 1e3
    running_mbit = steady_bits / (result["steady_s"] - stalled_s) / MBIT
    print(
        f"\n{rate_mbit} Mbit/s: payload {achieved_mbit:.4f} Mbit/s ({running_mbit:.4f} without "
        f"{1e3 * stalled_s:.1f} ms of stalls; {1e3 * stolen:.0f} ms stolen by the host), "
        f"expected {expected_mbit:.4f}"
    )
    assert stalled_s <= MAX_STALLED_SHARE * result["steady_s"] + stolen, (result, both)
    assert running_mbit >= expected_mbit * (1 - RATE_TOLERANCE), (result, both)
    assert achieved_mbit <= expected_mbit * (1 + RATE_TOLERANCE), (result, both)
    assert result["retransmissions"] == 0
    assert stats["rate_bit_s"] == rate_mbit * MBIT
    assert stats["drops"] == 0
    assert stats["bytes"] >= payload_bytes * FULL_FRAME_BYTES / result["mss"]


def test_set_rate_changes_a_message_time(devices: Devices, switch: SerialSwitch) -> None:
    """The machine only ever makes a message late (a stall of the switch, the sender or the
    receiver; CI once saw a median 26% late while its host stole the CPU): none may be early,
    and the lower quartile must be the wire time."""
    size = 15_000  # 11 segments
    for rate_mbit in (20, 2):
        for rank in (0, 1):
            switch.set_rate(rank, rate_mbit)
        wire_s = tcp_message_wire_s(size, rate_mbit * MBIT)
        latencies_s = message_latencies_s(devices, switch, size, count=12, gap_s=3 * wire_s + 0.02)
        low_s = statistics.quantiles(latencies_s, n=4)[0]
        print(f"\n15 KB, {rate_mbit} Mbit/s: wire {wire_s:.5f} s, lower quartile {low_s:.5f} s")
        assert min(latencies_s) >= wire_s
        assert low_s == pytest.approx(wire_s, rel=0.05, abs=0.3e-3)


def test_stop_leaves_nothing_behind(devices: Devices) -> None:
    serial = SerialSwitch(f"{os.getpid() & 0xFFFFFFFF:08x}", devices.paths, SUBNET, rate_mbit=5)
    serial.start()
    assert serial.process is not None
    pid = serial.process.pid
    assert serial.netns in namespaces()
    serial.stop()
    serial.stop()  # idempotent
    assert serial.netns not in namespaces()
    assert not Path(f"/proc/{pid}").exists(), "the emulator survived stop()"
    for name in devices.names:
        links = subprocess.run(
            ["ip", "-n", name, "-o", "link", "show"], capture_output=True, text=True, timeout=10
        ).stdout
        assert "sl0" not in links, links
    host_links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    assert f"tb{serial.tag}s" not in host_links.stdout


def test_a_stopped_emulator_logs_a_stall_when_and_as_long_as_it_was(
    devices: Devices, switch: SerialSwitch
) -> None:
    """SIGSTOP stands for a machine that does not run the emulator (a VM's vCPU held)."""
    for rank in (0, 1):
        switch.set_rate(rank, 5)
    assert switch.process is not None
    pid, stopped = switch.process.pid, {}

    def stop_for(after_s: float, length_s: float) -> None:
        time.sleep(after_s)
        stopped["start"] = time.time()
        os.kill(pid, signal.SIGSTOP)
        time.sleep(length_s)
        os.kill(pid, signal.SIGCONT)
        stopped["end"] = time.time()

    stopper = threading.Thread(target=stop_for, args=(0.8, 0.05))  # mid-transfer
    stopper.start()
    to = [switch.address(1), str(PORT)]
    run_pair(devices, [BULK_RECEIVER, *to], [BULK_SENDER, *to, str(int(5 * MBIT / 8 * 2))])
    stopper.join()
    stalls = [entry for port in switch.stats().values() for entry in port["stall_log"]]
    # the frame that was due while it stood still left when it went on: late by the rest of it
    assert any(
        stopped["start"] - 0.005 <= start <= stopped["end"] and ms >= 40 for start, ms in stalls
    ), (stopped, stalls)
