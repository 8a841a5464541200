"""What TCP's settings change for small messages over a lossy link, before any is recommended.

Run as root from the repository root: `python -m bench.tcp_settings` (about 3 minutes). Two
network namespaces joined by the serial switch (its Python loop, which draws netem's
impairments) at `--rate` Mbit/s with `--delay-ms` one way and `--loss-pct` random loss on both
directions (sweep-loss's 10 Mbit/s, 5 ms, 1%); `--count` messages of `--size` bytes (a Trace-b
message at its finest level is one frame), `--gap-ms` apart, TCP_NODELAY, one connection per
setting. A setting is a route attribute on both namespaces' route to the other
(`ip route replace ... rto_min 20ms`, `quickack 1`): the settings are taken in turn, every
round, `--rounds` times. Printed per setting: the one-way latency's median, p95, p99 and
maximum, and how many messages took more than 50 ms, by the receiver's kernel timestamps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Iterator, Sequence

from bench.serial_link_check import SUBNET, Bed, _ip, _namespaces, _pair

SETTINGS = {
    "default": [],
    "rto_min 20ms": ["rto_min", "20ms"],
    "quickack": ["quickack", "1"],
    "rto_min 20ms + quickack": ["rto_min", "20ms", "quickack", "1"],
}
SLOW_MS = 50.0


@contextlib.contextmanager
def lossy_bed(args: argparse.Namespace) -> Iterator[tuple[Bed, object]]:
    from testbed.link.serial.switch import ProgramOptions, SerialSwitch

    with _namespaces(f"tbtcp-{os.getpid()}") as names:
        paths = [f"/var/run/netns/{name}" for name in names]
        tag = f"{os.getpid() & 0xFFFFFFFF:08x}"
        program = ProgramOptions(core="python")
        with SerialSwitch(tag, paths, SUBNET, args.rate, program=program) as switch:
            impairments = {"delay_ms": args.delay_ms, "loss_pct": args.loss_pct}
            for rank in (0, 1):
                switch.impair(rank, impairments, 2026 + rank)
            addresses = (switch.address(0), switch.address(1))
            yield Bed("serial", names, addresses, lambda rate: None), switch


def set_route(bed: Bed, interface: str, words: list[str]) -> None:
    """Both namespaces' route to the switch's subnet, with `words` as its attributes."""
    subnet = str(SUBNET)
    for name, address in zip(bed.names, bed.addresses, strict=True):
        route = [subnet, "dev", interface, "proto", "kernel", "scope", "link", "src", address]
        _ip("-n", name, "route", "replace", *route, *words)


def latencies_ms(bed: Bed, args: argparse.Namespace) -> list[float]:
    received, sent = _pair(
        bed,
        ("_receive-messages", bed.addresses[1], args.size, args.count),
        ("_send-messages", bed.addresses[1], args.size, args.count, args.gap_ms / 1e3),
    )
    return [1e3 * (r - s) for r, s in zip(json.loads(received), json.loads(sent), strict=True)]


def quantile(values: list[float], share: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[round(share * 1000) - 1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tcp_settings", description=__doc__)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--loss-pct", type=float, default=1.0)
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--gap-ms", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    measured: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with lossy_bed(args) as (bed, switch):
        for _ in range(args.rounds):
            for name, words in SETTINGS.items():
                set_route(bed, switch.interface, words)
                measured[name] += latencies_ms(bed, args)
    print(
        f"\n{args.size} B messages {args.gap_ms:g} ms apart at {args.rate:g} Mbit/s, "
        f"{args.delay_ms:g} ms one way, {args.loss_pct:g}% loss both ways, "
        f"{args.rounds} x {args.count} per setting"
    )
    print("| setting | median ms | p95 | p99 | max | over 50 ms |\n|---|---|---|---|---|---|")
    for name, values in measured.items():
        slow = sum(value > SLOW_MS for value in values)
        print(
            f"| {name} | {statistics.median(values):.2f} | {quantile(values, 0.95):.2f} | "
            f"{quantile(values, 0.99):.2f} | {max(values):.1f} | {slow} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
