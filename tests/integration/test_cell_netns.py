"""The shared medium for real: P device namespaces on one `SerialSwitch` whose ports share one
line, the cell (testbed.link.serial.program, "Shared medium").

- Bulk: every device sends bulk TCP (cubic) to the next at once on a 20 Mbit/s cell. Every
  frame, data or acknowledgement, counts against the cell: what all ports carried over 3 s of steady
  traffic (the emulator's byte counters, read at both ends of the window) is 20 Mbit/s within
  1 %, and Jain's fairness index over the ports is at least 0.98. At P = 2 and 4 here; at 8 in
  `bench/cell.py`.
- One frame: by the receivers' kernel receive timestamps, a lone UDP frame on an idle cell
  takes its wire time, and two devices' frames sent at the same moment take one and two
  frame times (on dedicated lines, one each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from testbed.link.serial.switch import SerialSwitch
from tests.integration.conftest import SUBNET, namespaces

pytestmark = pytest.mark.netns

MBIT = 1_000_000
CELL_MBIT = 20.0
WARM_S, WINDOW_S = 1.0, 3.0
PORT = 5321
# Linux's default congestion control. This machine's is BBR, whose flows share the cell
# less fairly (Jain 0.88 at P = 2, 0.95 at 4 measured), while the cell itself gives each of
# P saturating UDP senders its share within 0.2 %: that is BBR's, not the medium's
CONGESTION = "cubic"
FRAME_PAYLOAD = 1000  # a UDP datagram: 1042-byte frames (Ethernet 14, IP 20, UDP 8)
FRAME_BYTES = FRAME_PAYLOAD + 42
SLOW_MBIT = 1.0  # a frame time of 8.3 ms, far above the senders' start-up difference


@dataclass(frozen=True)
class Cell:
    names: list[str]
    switch: SerialSwitch

    def exec_in(self, rank: int, script: str, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[rank], sys.executable, "-c", script, *args]


GREET = """
import socket, sys, time
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for peer in sys.argv[1:]:
    sock.sendto(b"hello", (peer, 9))
time.sleep(0.1)
"""


def cell_of(count: int) -> Iterator[Cell]:
    """`count` namespaces on a switch (the C core) at CELL_MBIT, its medium shared; every pair
    greeted once (a UDP datagram), so that every MAC is learned and every ARP answered before
    a test times."""
    tag = f"{(os.getpid() + count) & 0xFFFFFFFF:08x}"
    names = [f"tbcell-{os.getpid()}-{rank}" for rank in range(count)]
    switch = None
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
            subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=10)
        paths = [f"/var/run/netns/{name}" for name in names]
        switch = SerialSwitch(tag, paths, SUBNET, rate_mbit=CELL_MBIT, core="c").start()
        switch.set_medium(True)
        cell = Cell(names, switch)
        for rank in range(count):
            peers = [switch.address(peer) for peer in range(count) if peer != rank]
            subprocess.run(cell.exec_in(rank, GREET, *peers), check=True, timeout=10)
        time.sleep(0.2)  # the last answers (ARP's, ICMP's) cross
        yield cell
    finally:
        if switch is not None:
            switch.stop()
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        assert not set(names) & namespaces(), "device namespaces left behind"


@pytest.fixture
def cell2(root: None) -> Iterator[Cell]:
    yield from cell_of(2)


@pytest.fixture
def cell3(root: None) -> Iterator[Cell]:
    yield from cell_of(3)


@pytest.fixture
def cell4(root: None) -> Iterator[Cell]:
    yield from cell_of(4)


RECEIVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn, _ = server.accept()
buffer = bytearray(1 << 16)
try:
    while conn.recv_into(buffer):
        pass
except ConnectionResetError:  # its sender is killed at the end
    pass
"""

SENDER = """
import socket, sys, time
conn = socket.socket()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, sys.argv[4].encode())
conn.settimeout(15)
conn.connect((sys.argv[1], int(sys.argv[2])))
chunk, end = bytes(1 << 16), time.time() + float(sys.argv[3])
while time.time() < end:
    conn.send(chunk)
"""


def bulk_on_the_cell(cell: Cell) -> dict[int, int]:
    """Every device sends bulk to the next at once: each port's bytes over the window."""
    count, switch = len(cell.names), cell.switch
    started: list[subprocess.Popen[str]] = []
    try:
        for rank in range(count):
            address = [switch.address(rank), str(PORT)]
            receiver = subprocess.Popen(
                cell.exec_in(rank, RECEIVER, *address), stdout=subprocess.PIPE, text=True
            )
            started.append(receiver)
            assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
        seconds = str(WARM_S + WINDOW_S + 1.0)
        for rank in range(count):
            to = [switch.address((rank + 1) % count), str(PORT), seconds, CONGESTION]
            started.append(subprocess.Popen(cell.exec_in(rank, SENDER, *to)))
        time.sleep(WARM_S)
        before, began = switch.stats(), time.time()
        time.sleep(WINDOW_S)
        after, ended = switch.stats(), time.time()
        scale = WINDOW_S / (ended - began)  # the answers' own latency is not the cell's
        return {
            rank: round((after[rank]["bytes"] - before[rank]["bytes"]) * scale)
            for rank in range(count)
        }
    finally:
        for process in started:
            process.kill()
            process.wait()


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


@pytest.mark.parametrize("count", [2, 4])
def test_devices_sending_at_once_share_the_cell_fairly(
    request: pytest.FixtureRequest, count: int
) -> None:
    cell = request.getfixturevalue(f"cell{count}")
    carried = bulk_on_the_cell(cell)
    total_mbit = sum(carried.values()) * 8 / WINDOW_S / MBIT
    fairness = jain(list(carried.values()))
    stats = cell.switch.stats()
    print(f"\nP = {count}: {total_mbit:.3f} Mbit/s in all, Jain {fairness:.4f}, ports {carried}")
    assert total_mbit == pytest.approx(CELL_MBIT, rel=0.01), stats
    assert fairness >= 0.98, carried


ONE_FRAME_RECEIVER = """
import json, socket, struct, sys
SO_TIMESTAMPNS = 35
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
sock.bind((sys.argv[1], int(sys.argv[2])))
sock.settimeout(10)
print("ready", flush=True)
arrivals = []
for _ in range(int(sys.argv[3])):
    data, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(16))
    seconds, nanoseconds = struct.unpack("qq", ancillary[0][2][:16])
    arrivals.append(seconds + nanoseconds / 1e9)
print(json.dumps(arrivals))
"""

ONE_FRAME_SENDER = """
import socket, sys, time
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.connect((sys.argv[1], int(sys.argv[2])))
payload, at = bytes(int(sys.argv[3])), float(sys.argv[4])
while time.time() < at:
    pass
sock.send(payload)
"""


def frames_at_once(cell: Cell, senders: list[int], receiver: int) -> list[float]:
    """Each sender's one UDP frame to `receiver`, all sent at one moment: the times they took
    (kernel receive timestamp less that moment), sorted."""
    address = [cell.switch.address(receiver), str(PORT)]
    listening = subprocess.Popen(
        cell.exec_in(receiver, ONE_FRAME_RECEIVER, *address, str(len(senders))),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listening.stdout is not None and listening.stdout.readline().strip() == "ready"
        moment = time.time() + 0.5
        sending = [
            subprocess.Popen(
                cell.exec_in(rank, ONE_FRAME_SENDER, *address, str(FRAME_PAYLOAD), repr(moment))
            )
            for rank in senders
        ]
        for process in sending:
            assert process.wait(10) == 0
        out, _ = listening.communicate(timeout=10)
    finally:
        if listening.poll() is None:
            listening.kill()
            listening.wait()
    return sorted(arrival - moment for arrival in json.loads(out))


def test_a_lone_frame_takes_its_wire_time_and_two_at_once_one_and_two(cell3: Cell) -> None:
    switch = cell3.switch
    for rank in range(3):
        switch.set_rate(rank, SLOW_MBIT)
    frame_s = FRAME_BYTES * 8 / (SLOW_MBIT * MBIT)
    lone = [frames_at_once(cell3, [0], 2)[0] for _ in range(3)]
    shared = frames_at_once(cell3, [0, 1], 2)
    switch.set_medium(False)
    dedicated = frames_at_once(cell3, [0, 1], 2)
    print(f"\nframe {1e3 * frame_s:.2f} ms: lone {lone}, shared {shared}, dedicated {dedicated}")
    slack_s = 1.5e-3  # the senders' start and the path: a few hundred us each, here
    for taken in lone:
        assert frame_s <= taken < frame_s + slack_s
    assert frame_s <= shared[0] < frame_s + slack_s
    assert 2 * frame_s <= shared[1] < 2 * frame_s + slack_s
    assert all(frame_s <= taken < frame_s + slack_s for taken in dedicated)
