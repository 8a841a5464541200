"""The shared medium under load: P devices sending bulk at once on one 20 Mbit/s cell, what
each port carried and Jain's fairness index over their shares.

`cell_of` builds the cell (namespaces on a `SerialSwitch` whose ports share one line, every
pair greeted first); `bulk_on_the_cell` is the measurement (every device to the next, 3 s of
steady traffic by the emulator's byte counters after 1 s). tests/integration/
test_cell_netns.py runs it with UDP at P = 2 and 4; `python -m bench.cell` at more device
counts and kinds of bulk.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from testbed.link.serial.switch import ProgramOptions, SerialSwitch

MBIT = 1_000_000
SUBNET = ipaddress.IPv4Network("10.214.79.0/24")  # the devices' addresses
CELL_MBIT = 20.0
WARM_S, WINDOW_S = 1.0, 3.0
PORT = 5321
# How bulk is sent: "udp" keeps a port's queue full; TCP with a congestion control ("cubic",
# Linux's default; "bbr", this machine's) shares the cell as that control shares a
# bottleneck: on a quiet machine cubic's Jain index read 0.99-1.00, BBR's 0.88-0.95, and a
# busy one (other jobs on both cores) once brought cubic to 0.96 (`python -m bench.cell`)
BULK = ("udp", "cubic", "bbr")


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


def cell_of(count: int, subnet: ipaddress.IPv4Network = SUBNET) -> Iterator[Cell]:
    """`count` namespaces on a switch (the C core) at CELL_MBIT, its medium shared; every pair
    greeted once (a UDP datagram), so that every MAC is learned and every ARP answered before
    anything is timed. Stops the switch and deletes the namespaces when closed."""
    tag = f"{(os.getpid() + count) & 0xFFFFFFFF:08x}"
    names = [f"tbcell-{os.getpid()}-{rank}" for rank in range(count)]
    switch = None
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
            subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=10)
        paths = [f"/var/run/netns/{name}" for name in names]
        program = ProgramOptions(core="c")
        switch = SerialSwitch(tag, paths, subnet, CELL_MBIT, program=program).start()
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

BLAST = """
import socket, sys, time
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
datagram, end = bytes(1472), time.time() + float(sys.argv[3])  # a full frame each
while time.time() < end:
    try:
        sock.sendto(datagram, (sys.argv[1], int(sys.argv[2])))
    except OSError:  # the device's queue is full: ENOBUFS
        time.sleep(0.0005)
"""


def bulk_on_the_cell(cell: Cell, bulk: str = "udp") -> dict[int, int]:
    """Every device sends bulk (one of BULK) to the next at once: each port's bytes over the
    window."""
    count, switch = len(cell.names), cell.switch
    started: list[subprocess.Popen[str]] = []
    try:
        for rank in range(count if bulk != "udp" else 0):
            address = [switch.address(rank), str(PORT)]
            receiver = subprocess.Popen(
                cell.exec_in(rank, RECEIVER, *address), stdout=subprocess.PIPE, text=True
            )
            started.append(receiver)
            assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
        seconds = str(WARM_S + WINDOW_S + 1.0)
        for rank in range(count):
            to = [switch.address((rank + 1) % count), str(PORT), seconds]
            script = BLAST if bulk == "udp" else SENDER
            started.append(subprocess.Popen(cell.exec_in(rank, script, *to, bulk)))
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


def mbit(carried_bytes: float) -> float:
    """Bytes carried over the window, as Mbit/s."""
    return carried_bytes * 8 / WINDOW_S / MBIT


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))
