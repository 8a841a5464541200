"""The throughput probe between two local processes over loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def probe(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "devices.probe", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(*args: str) -> tuple[int, str, str]:
    process = probe(*args)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, stdout, stderr


@pytest.mark.parametrize(
    "amount", [["--bytes", "20000000"], ["--seconds", "0.3"]], ids=["bytes", "seconds"]
)
def test_probe_reports_the_receivers_rate(amount):
    port = free_port()
    server = probe(
        "serve", "--host", "127.0.0.1", "--port", str(port), "--once", "--timeout-s", "20"
    )
    try:
        status, stdout, stderr = run("send", "--to", f"127.0.0.1:{port}", *amount)
        server_out, _ = server.communicate(timeout=TIMEOUT_S)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert status == 0, stderr
    (line,) = stdout.splitlines()
    result = json.loads(line)
    assert {
        "mbit_per_s",
        "bytes",
        "seconds",
        "sender_bytes",
        "sender_seconds",
        "sender_mbit_per_s",
        "to",
    } <= set(result)
    assert result["mbit_per_s"] > 0 and result["seconds"] > 0
    assert result["bytes"] == result["sender_bytes"]
    if amount[0] == "--bytes":
        assert result["bytes"] == 20_000_000
    # the sender prints the receiver's figure, which the server printed too
    received = json.loads(server_out.splitlines()[0])
    assert received["mbit_per_s"] == result["mbit_per_s"]
    assert received["from"].startswith("127.0.0.1:")
    assert result["mbit_per_s"] == pytest.approx(
        8 * result["bytes"] / result["seconds"] / 1e6, rel=0.5
    )


def test_probe_without_a_receiver_fails_with_one_line():
    status, stdout, stderr = run(
        "send", "--to", f"127.0.0.1:{free_port()}", "--bytes", "10", "--connect-timeout-s", "0.5"
    )
    assert status == 1 and stdout == ""
    assert stderr.startswith("probe: the probe receiver at 127.0.0.1:")
    assert stderr.count("\n") == 1


def test_rate_is_timed_after_the_first_tenth_of_the_bytes():
    """A burst (the first tenth at once, then a pause) stays out of the figure: the clock
    starts at the chunk that completes the first tenth."""
    import struct

    from devices.probe import receive_all
    from testbed.link.probe import WIRE_PER_PAYLOAD, probe_bytes

    sender, receiver = socket.socketpair()

    thread = _sending(sender, struct.pack("!Q", 1000) + bytes(100))
    with receiver:
        result = receive_all(receiver)
    thread.join()
    assert result["bytes"] == 1000
    assert result["seconds"] == pytest.approx(0.6, abs=0.15)
    assert result["mbit_per_s"] == pytest.approx(8 * 900 / result["seconds"] / 1e6)
    # a probe's byte count is `seconds` of traffic at the target rate, headers included
    assert 8 * probe_bytes(10, 0.5) * WIRE_PER_PAYLOAD / 10e6 == pytest.approx(0.5, rel=1e-5)


def test_the_bulk_receiver_times_after_a_tenth_of_what_came_by_the_kernels_stamps():
    """Without a byte count, the clock starts at the chunk that completes a tenth of all that
    came; by the kernel's receive timestamps (loopback TCP), the steady part is the 0.6 s
    between the first chunk and the last. Less than the skipped bytes is no steady part, and
    a chunk without its stamp is refused by name."""
    import time

    from devices.clock import enable_rx_timestamps
    from devices.probe import BulkTiming, ProbeError, receive_timed

    with socket.create_server(("127.0.0.1", 0)) as server:
        assert enable_rx_timestamps(server)  # inherited by the connection
        # the kernel turns its receive timestamps on a moment later (a deferred static key):
        # segments that come before carry none
        time.sleep(0.2)
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()

    thread = _sending(sender, bytes(100))
    with receiver:
        timing = receive_timed(receiver, kernel_stamps=True)
    thread.join()
    assert (timing.total_bytes, timing.steady_bytes) == (1000, 900)
    assert timing.steady_s == pytest.approx(0.6, abs=0.15)
    assert timing.mbit_per_s == pytest.approx(8 * 900 / timing.steady_s / 1e6)
    left, right = socket.socketpair()
    with left, right:
        left.sendall(bytes(10))
        left.shutdown(socket.SHUT_WR)
        assert receive_timed(right, skip_bytes=11) == BulkTiming(10, 0, 0.0)
    left, right = socket.socketpair()
    with left, right:
        left.sendall(bytes(10))
        with pytest.raises(ProbeError, match="without its kernel receive timestamp"):
            receive_timed(right, kernel_stamps=True)


def test_probe_listens_on_its_address_only():
    """The receiver binds the address it is given: one the host does not hold (TEST-NET-1)
    is refused in one line, and a receiver on 127.0.0.1 is not reachable at 127.0.0.2."""
    status, stdout, stderr = run("serve", "--host", "192.0.2.1", "--port", str(free_port()))
    assert status == 1 and stdout == ""
    assert stderr.startswith("probe: cannot listen on 192.0.2.1:") and stderr.count("\n") == 1
    port = free_port()
    server = probe("serve", "--host", "127.0.0.1", "--port", str(port), "--timeout-s", "20")
    try:
        reached, _, stderr = run("send", "--to", f"127.0.0.1:{port}", "--bytes", "10")
        assert reached == 0, stderr  # the receiver is up
        status, _, stderr = run(
            "send", "--to", f"127.0.0.2:{port}", "--bytes", "10", "--connect-timeout-s", "1"
        )
    finally:
        server.kill()
        server.communicate()
    assert status == 1 and "did not accept a connection" in stderr


def _sending(sender: socket.socket, first: bytes) -> threading.Thread:
    """A thread that sends `first`, then 400 and 500 bytes 0.3 s apart, and closes."""

    def send() -> None:
        sender.sendall(first)
        for size in (400, 500):
            time.sleep(0.3)
            sender.sendall(bytes(size))
        sender.close()

    thread = threading.Thread(target=send)
    thread.start()
    return thread
