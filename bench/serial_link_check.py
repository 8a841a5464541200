"""tbf against the serial link emulator: isolated-message latency and bulk rate, side by side.

Run as root from the repository root: `python -m bench.serial_link_check` (about 2 minutes;
`--help` for rates, sizes, counts, shapers). Two network namespaces, a sender `a` and a
receiver `b`, joined by one of:

- `tbf`: a veth pair, with `testbed.link.token_bucket.profile_plan` and
  `testbed.kernel.netlink.apply` (profile `ideal`, the project's two-frame bucket) on a's end,
  as the project shapes devices today;
- `serial+tbf`: `testbed.link.serial.switch.SerialSwitch` (its default, backpressure on: tbf at the
  rate on each device's `sl0` in front of the emulator), both ports at the rate;
- `serial`: the same switch without the tbf (the emulator alone);

each serial shaper once per `--cores` (the emulator's per-frame loop: c, python).

Messages: `--count` isolated TCP messages of each size (TCP_NODELAY, one connection, spaced
well past their wire time); latency = the receiver's kernel receive timestamp (SO_TIMESTAMPNS)
of the message's last byte - the sender's `time.time()` just before `sendall`. Wire time: the
payload plus 66 bytes of headers per segment of 1448 (`tcp_message_wire_s`). Bulk: `--bulk-s`
seconds of traffic at the rate; the TCP payload rate after the first tenth of the bytes, by the
receiver's kernel timestamps, over rate x 1448 / 1514; the sender namespace's TCP
retransmissions. Emulator columns (sender's port, over the bulk transfer): queue drops, CPU
(utime + stime of all its threads from /proc/<pid>/stat over the transfer's wall time, in % of
one core; system time in brackets), mean time a frame waited behind earlier ones, mean
lateness of its departure against its schedule, and its stalls (frames more than 1 ms late:
the machine did not run the emulator) with their total length.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devices.clock import ANCILLARY_BYTES, SO_TIMESTAMPNS_OLD, kernel_timestamp_ns
from devices.probe import receive_timed
from testbed.link.wire import (
    FULL_FRAME_BYTES,
    TCP_FRAME_HEADER_BYTES,
    TCP_MSS_BYTES,
    tcp_message_wire_s,
)
from testbed.source import python_env

PORT = 5301
SUBNET = ipaddress.IPv4Network("10.214.9.0/24")
CLOCK_TICKS_S = os.sysconf("SC_CLK_TCK")


# Endpoints (run inside the namespaces) ---------------------------------------------------------


def kernel_timestamp_s(ancillary: list[tuple[int, int, bytes]]) -> float | None:
    stamp_ns = kernel_timestamp_ns(ancillary)
    return None if stamp_ns is None else stamp_ns / 1e9


def _server(address: str) -> socket.socket:
    server = socket.create_server((address, PORT))
    server.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS_OLD, 1)  # inherited by the connection
    server.settimeout(30)
    print("ready", flush=True)
    return server


def receive_messages(address: str, size: int, count: int) -> None:
    """Prints the kernel arrival time of each message's last byte (JSON list)."""
    conn, _ = _server(address).accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer, arrivals = memoryview(bytearray(size)), []
    for _ in range(count):
        got, stamp = 0, None
        while got < size:
            n, ancillary, _, _ = conn.recvmsg_into([buffer[got:]], ANCILLARY_BYTES)
            if not n:
                raise SystemExit(f"connection closed after {len(arrivals)} messages")
            got, stamp = got + n, kernel_timestamp_s(ancillary) or stamp
        arrivals.append(stamp)
    print(json.dumps(arrivals))


def send_messages(address: str, size: int, count: int, gap_s: float) -> None:
    """Prints the send time of each message (JSON list)."""
    conn = socket.create_connection((address, PORT), timeout=30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, sent = bytes(size), []
    for _ in range(count):
        time.sleep(gap_s)
        sent.append(time.time())
        conn.sendall(payload)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
    print(json.dumps(sent))


def receive_bulk(address: str) -> None:
    """Prints bytes and seconds between the first tenth of the bytes and the last byte."""
    conn, _ = _server(address).accept()
    timing = receive_timed(conn, kernel_stamps=True)
    steady = {"steady_bytes": timing.steady_bytes, "steady_s": timing.steady_s}
    print(json.dumps({"bytes": timing.total_bytes, **steady}))


def send_bulk(address: str, payload_bytes: int) -> None:
    """Sends `payload_bytes`; prints the MSS and this namespace's TCP retransmissions."""
    before = _retransmissions()
    conn = socket.create_connection((address, PORT), timeout=30)
    left, chunk = payload_bytes, bytes(1 << 16)
    while left > 0:
        left -= conn.send(chunk[: min(left, len(chunk))])
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
    mss = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
    print(json.dumps({"mss": mss, "retransmissions": _retransmissions() - before}))


def _retransmissions() -> int:
    lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines()]
    header, values = (line[1:] for line in lines if line[0] == "Tcp:")
    return int(dict(zip(header, values, strict=True))["RetransSegs"])


# Beds: two namespaces joined by tbf or by the serial switch ------------------------------------


@dataclass
class Bed:
    shaper: str
    names: tuple[str, str]
    addresses: tuple[str, str]
    set_rate: Callable[[float], None]
    emulator_pid: int | None = None
    stats: Callable[[], dict] | None = None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@contextlib.contextmanager
def _namespaces(prefix: str, count: int = 2) -> Iterator[tuple[str, ...]]:
    names = tuple(f"{prefix}-{chr(ord('a') + index)}" for index in range(count))
    try:
        for name in names:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


@contextlib.contextmanager
def tbf_bed(prefix: str) -> Iterator[Bed]:
    from testbed.experiment.profiles import load_profile
    from testbed.kernel.netlink import apply
    from testbed.link.token_bucket import profile_plan

    with _namespaces(prefix) as names:
        _ip(
            "-n",
            names[0],
            "link",
            "add",
            "tbba",
            "type",
            "veth",
            "peer",
            "name",
            "tbbb",
            "netns",
            names[1],
        )
        addresses = (str(SUBNET[1]), str(SUBNET[2]))
        for name, interface, address in zip(names, ("tbba", "tbbb"), addresses, strict=True):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", name, "link", "set", interface, "up")

        def set_rate(rate_mbit: float) -> None:
            apply(
                f"/var/run/netns/{names[0]}", "tbba", profile_plan(load_profile("ideal"), rate_mbit)
            )

        yield Bed("tbf", names, addresses, set_rate)


@contextlib.contextmanager
def serial_bed(
    prefix: str, args: argparse.Namespace, backpressure: bool, core: str
) -> Iterator[Bed]:
    from testbed.link.serial.switch import ProgramOptions, SerialSwitch

    with _namespaces(prefix) as names:
        paths = [f"/var/run/netns/{name}" for name in names]
        tag = f"{os.getpid() & 0xFFFFFFFF:08x}"
        program = ProgramOptions(spin_us=args.spin_us, queue_ms=args.queue_ms, core=core)
        switch = SerialSwitch(tag, paths, SUBNET, 1, backpressure, program)
        with switch:

            def set_rate(rate_mbit: float) -> None:
                for rank in (0, 1):
                    switch.set_rate(rank, rate_mbit)

            assert switch.process is not None
            shaper = f"{'serial+tbf' if backpressure else 'serial'} ({core})"
            addresses = (switch.address(0), switch.address(1))
            yield Bed(shaper, names, addresses, set_rate, switch.process.pid, switch.stats)


def many_ports(
    count: int,
    rate_mbit: float,
    seconds: float,
    core: str | None = None,
    impairments: dict[str, Any] | None = None,
) -> list[dict[str, float]]:
    """`count` devices on one serial switch (its per-frame loop `core`: c, python, or the
    program's default; every uplink with `impairments`, netem's parameters), each sending
    bulk at `rate_mbit` to the next at the same time: per port, the TCP payload rate / target
    (what the line leaves its data beside the ACKs it carries for the flow its device
    receives) and the emulator's stalls."""
    from testbed.link.serial.switch import ProgramOptions, SerialSwitch

    with _namespaces(f"tbmany-{os.getpid()}", count) as names:
        paths = [f"/var/run/netns/{name}" for name in names]
        tag = f"{os.getpid() & 0xFFFFFFFF:08x}"
        with SerialSwitch(tag, paths, SUBNET, 1, program=ProgramOptions(core=core)) as switch:
            for rank in range(count):
                switch.set_rate(rank, rate_mbit)
                if impairments:
                    switch.impair(rank, impairments, seed=rank)
            before = switch.stats()
            env = python_env()
            targets = [(rank + 1) % count for rank in range(count)]
            receivers = [
                subprocess.Popen(
                    _endpoint(names[t], "_receive-bulk", switch.address(t)),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                for t in targets
            ]
            for receiver in receivers:
                assert receiver.stdout is not None
                if receiver.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"receiver: {receiver.communicate()[1]}")
            payload = str(int(rate_mbit * 1e6 / 8 * seconds))
            senders = [
                subprocess.Popen(
                    _endpoint(names[rank], "_send-bulk", switch.address(t), payload),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                for rank, t in enumerate(targets)
            ]
            results = []
            for sender, receiver in zip(senders, receivers, strict=True):
                sent, _ = sender.communicate(timeout=seconds * 4 + 60)
                got, _ = receiver.communicate(timeout=60)
                results.append({**json.loads(got), **json.loads(sent)})
            after = switch.stats()
    rows = []
    for rank, result in enumerate(results):
        payload_mbit = result["steady_bytes"] * 8 / result["steady_s"] / 1e6
        window = _window(before[rank], after[rank])
        # a port's line carries its device's data and the ACKs of the flow it receives (2-4%
        # of the line at one ACK per one or two segments): the data gets the rest
        frames = after[rank]["frames"] - before[rank]["frames"]
        line_bytes = after[rank]["bytes"] - before[rank]["bytes"]
        data_frames = (line_bytes - TCP_FRAME_HEADER_BYTES * frames) / (
            FULL_FRAME_BYTES - TCP_FRAME_HEADER_BYTES
        )
        data_share = data_frames * FULL_FRAME_BYTES / line_bytes
        target_mbit = rate_mbit * data_share * result["mss"] / FULL_FRAME_BYTES
        rows.append(
            {
                "ratio": payload_mbit / target_mbit,
                "data_share": data_share,
                "stalls": window["stalls"],
                "stalled_ms": window["stalled_ms"],
                "drops": window["drops"],
            }
        )
    return rows


# Measuring ------------------------------------------------------------------------------------


def _endpoint(netns: str, *args: object) -> list[str]:
    return ["ip", "netns", "exec", netns, sys.executable, "-m", "bench.serial_link_check"] + [
        str(arg) for arg in args
    ]


def _pair(bed: Bed, receiver: Sequence[object], sender: Sequence[object]) -> tuple[str, str]:
    """Runs a receiver in b and a sender in a; returns their stdout."""
    env = python_env()
    rx = subprocess.Popen(
        _endpoint(bed.names[1], *receiver),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert rx.stdout is not None
        if rx.stdout.readline().strip() != "ready":
            raise RuntimeError(f"receiver: {rx.communicate()[1]}")
        tx = subprocess.run(
            _endpoint(bed.names[0], *sender), capture_output=True, text=True, timeout=120, env=env
        )
        out, err = rx.communicate(timeout=60)
        if rx.returncode or tx.returncode:
            raise RuntimeError(f"receiver: {err} sender: {tx.stderr}")
        return out, tx.stdout
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait()


def message_latencies_s(bed: Bed, size: int, count: int, rate_mbit: float) -> list[float]:
    gap_s = max(0.04, 2.5 * tcp_message_wire_s(size, rate_mbit * 1e6) + 0.02)
    out_rx, out_tx = _pair(
        bed,
        ("_receive-messages", bed.addresses[1], size, count),
        ("_send-messages", bed.addresses[1], size, count, gap_s),
    )
    return [r - s for r, s in zip(json.loads(out_rx), json.loads(out_tx), strict=True)]


def _cpu_s(pid: int | None) -> tuple[float, float]:
    """A process's (user, system) CPU seconds so far, all threads."""
    if pid is None:
        return 0.0, 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS_S, int(fields[12]) / CLOCK_TICKS_S


def bulk(bed: Bed, rate_mbit: float, seconds: float) -> dict[str, float]:
    payload_bytes = int(rate_mbit * 1e6 / 8 * seconds)
    cpu_before, wall_before = _cpu_s(bed.emulator_pid), time.time()
    out_rx, out_tx = _pair(
        bed, ("_receive-bulk", bed.addresses[1]), ("_send-bulk", bed.addresses[1], payload_bytes)
    )
    cpu_after, wall_s = _cpu_s(bed.emulator_pid), time.time() - wall_before
    user_s, system_s = (after - before for after, before in zip(cpu_after, cpu_before, strict=True))
    result = {**json.loads(out_rx), **json.loads(out_tx)}
    payload_mbit = result["steady_bytes"] * 8 / result["steady_s"] / 1e6
    expected_mbit = rate_mbit * result["mss"] / FULL_FRAME_BYTES
    return {
        "ratio": payload_mbit / expected_mbit,
        "retransmissions": result["retransmissions"],
        "cpu_pct": 100 * (user_s + system_s) / wall_s,
        "system_pct": 100 * system_s / wall_s,
    }


def _spread(values_ms: list[float]) -> str:
    deciles = statistics.quantiles(values_ms, n=10)
    return f"{deciles[0]:.3f}-{deciles[-1]:.3f}"


def _window(before: dict, after: dict) -> dict[str, float]:
    """The emulator's sender-port counters over a window: drops and mean timings."""
    frames = after["frames"] - before["frames"]

    def mean_us(key: str) -> float:
        return (after[key] * after["frames"] - before[key] * before["frames"]) / max(frames, 1)

    return {
        "drops": after["drops"] - before["drops"],
        "queued_us": mean_us("queued_us_mean"),
        "late_us": mean_us("late_us_mean"),
        "stalls": after["stalls"] - before["stalls"],
        "stalled_ms": after["stalled_ms"] - before["stalled_ms"],
    }


def message_rows(bed: Bed, rate_mbit: float, args: argparse.Namespace) -> list[str]:
    rows = []
    for size in args.sizes:
        latencies_ms = [1000 * v for v in message_latencies_s(bed, size, args.count, rate_mbit)]
        wire_ms = 1000 * tcp_message_wire_s(size, rate_mbit * 1e6)
        median_ms = statistics.median(latencies_ms)
        rows.append(
            f"| {bed.shaper} | {rate_mbit:g} | {size} | {wire_ms:.3f} | {median_ms:.3f} | "
            f"{_spread(latencies_ms)} | {median_ms / wire_ms:.3f} |"
        )
    return rows


def bulk_row(bed: Bed, rate_mbit: float, args: argparse.Namespace) -> str:
    before = bed.stats()[0] if bed.stats else None
    result = bulk(bed, rate_mbit, args.bulk_s)
    row = f"| {bed.shaper} | {rate_mbit:g} | {result['ratio']:.4f} | {result['retransmissions']} |"
    if before is None or bed.stats is None:
        return row + " | | | |"
    window = _window(before, bed.stats()[0])
    return row + (
        f" {window['drops']} | {result['cpu_pct']:.1f} ({result['system_pct']:.1f}) | "
        f"{window['queued_us']:.0f} / {window['late_us']:.0f} | "
        f"{window['stalls']} ({window['stalled_ms']:.1f}) |"
    )


def run_bed(bed: Bed, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    messages, bulks = [], []
    for rate_mbit in args.rates:
        bed.set_rate(rate_mbit)
        messages += message_rows(bed, rate_mbit, args)
        bulks.append(bulk_row(bed, rate_mbit, args))
        print("\n".join(messages[-len(args.sizes) :] + bulks[-1:]), flush=True)
    return messages, bulks


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serial_link_check", description=__doc__)
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 2, 5, 10, 20])
    parser.add_argument("--sizes", type=int, nargs="+", default=[14, 200, 15000])
    parser.add_argument("--count", type=int, default=20, help="messages per size and rate")
    parser.add_argument("--bulk-s", type=float, default=2.0)
    parser.add_argument(
        "--shapers",
        nargs="+",
        default=["tbf", "serial+tbf", "serial"],
        choices=["tbf", "serial+tbf", "serial"],
    )
    parser.add_argument(
        "--cores",
        nargs="+",
        default=["c", "python"],
        choices=["c", "python"],
        help="the serial shapers' per-frame loops, each a bed of its own",
    )
    parser.add_argument("--spin-us", type=float, default=None, help="the emulator's --spin-us")
    parser.add_argument("--queue-ms", type=float, default=None, help="the emulator's --queue-ms")
    return parser.parse_args(argv)


ENDPOINTS = {
    "_receive-messages": lambda a: receive_messages(a[0], int(a[1]), int(a[2])),
    "_send-messages": lambda a: send_messages(a[0], int(a[1]), int(a[2]), float(a[3])),
    "_receive-bulk": lambda a: receive_bulk(a[0]),
    "_send-bulk": lambda a: send_bulk(a[0], int(a[1])),
}


MESSAGE_HEADER = [
    "| shaper | Mbit/s | message bytes | wire ms | median ms | p10-p90 ms | median / wire |",
    "|" + " --- |" * 7,
]
BULK_HEADER = [
    "| shaper | Mbit/s | bulk / target | TCP retransmissions | emulator drops "
    "| emulator CPU % of a core (system) | emulator queued / late us, mean "
    "| emulator stalls (ms) |",
    "|" + " --- |" * 8,
]


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ENDPOINTS:
        ENDPOINTS[argv[0]](argv[1:])
        return 0
    args = parse_args(argv)
    messages, bulks = list(MESSAGE_HEADER), list(BULK_HEADER)
    prefix = f"tbbench-{os.getpid()}"
    beds: list[Callable[[], contextlib.AbstractContextManager[Bed]]] = []
    for shaper in args.shapers:
        if shaper == "tbf":
            beds.append(lambda: tbf_bed(prefix))
        for core in [] if shaper == "tbf" else args.cores:
            backpressure = shaper == "serial+tbf"
            beds.append(lambda b=backpressure, c=core: serial_bed(prefix, args, b, c))
    for bed in beds:
        with bed() as ready:
            rows = run_bed(ready, args)
        messages += rows[0]
        bulks += rows[1]
    print("\n" + "\n".join(messages) + "\n\n" + "\n".join(bulks))
    target = f"rate x {TCP_MSS_BYTES}/{FULL_FRAME_BYTES}"
    print(f"\n(bulk / target: TCP payload rate after the first tenth / ({target}))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
