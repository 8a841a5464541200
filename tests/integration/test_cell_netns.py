"""The shared medium for real: P device namespaces on one `SerialSwitch` whose ports share one
line, the cell (testbed.link.serial.program, "Shared medium").

- Bulk: every device sends bulk to the next at once on a 20 Mbit/s cell. Every frame, data
  or acknowledgement, counts against the cell: what all ports carried over 3 s of steady
  traffic (the emulator's byte counters, read at both ends of the window) is 20 Mbit/s within
  1 %, and Jain's fairness index over the ports is at least 0.98. Here at P = 2 and 4 with
  senders that keep their port's queue full (UDP), which judges the medium's turns alone: TCP
  adds its congestion control's own fairness (`python -m bench.cell` measures it, and P = 8).
- One frame: by the receivers' kernel receive timestamps, a lone UDP frame on an idle cell
  takes its wire time, and two devices' frames sent at the same moment take one and two
  frame times (on dedicated lines, one each).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import pytest

from checks.cell import CELL_MBIT, MBIT, PORT, Cell, bulk_on_the_cell, cell_of, jain, mbit
from tests.integration.conftest import SUBNET, namespaces

pytestmark = pytest.mark.netns

FRAME_PAYLOAD = 1000  # a UDP datagram: 1042-byte frames (Ethernet 14, IP 20, UDP 8)
FRAME_BYTES = FRAME_PAYLOAD + 42
SLOW_MBIT = 1.0  # a frame time of 8.3 ms, far above the senders' start-up difference
SLACK_S = 0.5e-3  # beyond its wire time, what a frame may take: the path, the wake-ups


def cell_for_a_test(count: int) -> Iterator[Cell]:
    cells = cell_of(count, SUBNET)
    cell = next(cells)
    try:
        yield cell
    finally:
        cells.close()
    assert not set(cell.names) & namespaces(), "device namespaces left behind"


@pytest.fixture
def cell2(root: None) -> Iterator[Cell]:
    yield from cell_for_a_test(2)


@pytest.fixture
def cell3(root: None) -> Iterator[Cell]:
    yield from cell_for_a_test(3)


@pytest.fixture
def cell4(root: None) -> Iterator[Cell]:
    yield from cell_for_a_test(4)


@pytest.mark.parametrize("count", [2, 4])
def test_devices_sending_at_once_share_the_cell_fairly(
    request: pytest.FixtureRequest, count: int
) -> None:
    cell = request.getfixturevalue(f"cell{count}")
    carried = bulk_on_the_cell(cell)
    total_mbit = mbit(sum(carried.values()))
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
arrivals = {}
for _ in range(int(sys.argv[3])):
    data, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(16))
    seconds, nanoseconds = struct.unpack("qq", ancillary[0][2][:16])
    arrivals[data[0]] = seconds + nanoseconds / 1e9
print(json.dumps(arrivals))
"""

# The datagram's first byte names its sender; its departure is the kernel's transmit
# timestamp (SO_TIMESTAMPING, software: taken as the veth takes the frame, after the qdisc).
# A sender sleeps until every frame is due before it exits: two interpreters shutting down on
# the two cores just as the emulator's threads wake to forward made a frame 0.5 ms late in CI.
ONE_FRAME_SENDER = """
import socket, struct, sys, time
SO_TIMESTAMPING, TX_SOFTWARE, SOFTWARE, TSONLY = 37, 1 << 1, 1 << 4, 1 << 11
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, TX_SOFTWARE | SOFTWARE | TSONLY)
sock.connect((sys.argv[1], int(sys.argv[2])))
payload, at = bytes([int(sys.argv[5])]) + bytes(int(sys.argv[3]) - 1), float(sys.argv[4])
time.sleep(max(0.0, at - 0.002 - time.time()))  # then spin: on time, without a core held
while time.time() < at:
    pass
sock.send(payload)
for _ in range(1000):
    try:
        _, ancillary, _, _ = sock.recvmsg(1, 1024, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
    except BlockingIOError:
        time.sleep(0.001)
        continue
    for level, kind, data in ancillary:
        if (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMPING):
            seconds, nanoseconds = struct.unpack("qq", data[:16])
            print(seconds + nanoseconds / 1e9, flush=True)
            time.sleep(max(0.0, at + 0.1 - time.time()))  # exit after the frames are due
            sys.exit(0)
sys.exit("no transmit timestamp")
"""


def frames_at_once(cell: Cell, senders: list[int], receiver: int) -> list[tuple[float, float]]:
    """Each sender's one UDP frame to `receiver`, all sent at one moment: (its departure, its
    arrival) by the kernel's transmit and receive timestamps, by arrival."""
    address = [cell.switch.address(receiver), str(PORT)]
    listening = subprocess.Popen(
        cell.exec_in(receiver, ONE_FRAME_RECEIVER, *address, str(len(senders))),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listening.stdout is not None and listening.stdout.readline().strip() == "ready"
        moment = repr(time.time() + 0.5)
        sending = {
            rank: subprocess.Popen(
                cell.exec_in(
                    rank, ONE_FRAME_SENDER, *address, str(FRAME_PAYLOAD), moment, str(rank)
                ),
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in senders
        }
        departures = {
            rank: float(process.communicate(timeout=10)[0]) for rank, process in sending.items()
        }
        out, _ = listening.communicate(timeout=10)
    finally:
        if listening.poll() is None:
            listening.kill()
            listening.wait()
    arrivals = {int(rank): at for rank, at in json.loads(out).items()}
    return sorted(((departures[rank], arrivals[rank]) for rank in senders), key=lambda f: f[1])


def test_a_lone_frame_takes_its_wire_time_and_two_at_once_one_and_two(cell3: Cell) -> None:
    """By the senders' kernel transmit timestamps and the receiver's receive timestamps: a lone
    frame takes its wire time; of two frames sent together (their senders' departures within
    half a frame time: the machine may start one late), the second arrives two frame times
    after the first left on the cell, and one frame time after its own on dedicated lines."""
    switch = cell3.switch
    for rank in range(3):
        switch.set_rate(rank, SLOW_MBIT)
    frame_s = FRAME_BYTES * 8 / (SLOW_MBIT * MBIT)
    lone = [
        arrival - departure
        for ((departure, arrival),) in (frames_at_once(cell3, [0], 2) for _ in range(3))
    ]
    shared = [frames_at_once(cell3, [0, 1], 2) for _ in range(3)]
    switch.set_medium(False)
    dedicated = [frames_at_once(cell3, [0, 1], 2) for _ in range(3)]
    print(f"\nframe {1e3 * frame_s:.2f} ms: lone {lone}, shared {shared}, dedicated {dedicated}")
    assert all(frame_s <= taken < frame_s + SLACK_S for taken in lone), lone
    together = [pair for pair in shared if abs(pair[0][0] - pair[1][0]) < frame_s / 2]
    assert len(together) >= 2, shared  # the machine started most pairs together
    for (first_left, first), (_, second) in together:
        assert frame_s <= first - first_left < frame_s + SLACK_S, shared
        assert 2 * frame_s <= second - first_left < 2 * frame_s + SLACK_S, shared
    for pair in dedicated:
        assert all(frame_s <= arrival - left < frame_s + SLACK_S for left, arrival in pair), pair


def test_impairments_follow_the_air_and_a_rate_change_holds_for_the_whole_cell(
    cell3: Cell,
) -> None:
    """A delay comes after the air: a frame takes its wire time and the delay; a new rate (a
    trace's step: every port's) is the cell's. Each from the first frame after the change,
    although the port's thread was already waiting for it (unimpaired, then impaired)."""
    switch = cell3.switch
    for rank in range(3):
        switch.set_rate(rank, SLOW_MBIT)
        switch.impair(rank, {"delay_ms": 20.0}, seed=rank)
    frame_s = FRAME_BYTES * 8 / (SLOW_MBIT * MBIT)
    delayed = [arrival - left for left, arrival in frames_at_once(cell3, [0], 2)]
    for rank in range(3):
        switch.impair(rank, {}, seed=0)
        switch.set_rate(rank, 2 * SLOW_MBIT)
    faster = [arrival - left for left, arrival in frames_at_once(cell3, [0], 2)]
    print(f"\ndelayed {delayed}, at twice the rate {faster}")
    assert frame_s + 0.02 <= delayed[0] < frame_s + 0.02 + SLACK_S
    assert frame_s / 2 <= faster[0] < frame_s / 2 + SLACK_S
