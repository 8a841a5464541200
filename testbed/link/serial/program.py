"""A userspace serial link: a switch that clocks every frame out at its port's rate.

A token bucket (tbf) lets a frame through at once while its bucket holds tokens, so after an
idle gap a 200-byte message crosses a 1 Mbit/s link in 0.05 ms, where its wire time is 2.1 ms.
A serial line clocks every bit out at the rate, and this kernel has no netem. This program
(stdlib only) runs as root in a "switch" network namespace that holds one veth end, a *port*,
per device; `testbed.link.serial.switch` builds the namespace and starts it.

A port knows its rate, when its line is free again, its impairments (netem's: delay, jitter,
loss, duplication, reordering; `testbed.link.serial.netem_draws`) and its counters; the
switch knows which source MAC was seen on which port. No FCS, preamble or inter-frame gap.

Decisions:

- A port's rate applies to the frames its device sends (its uplink), as tbf on the device's
  egress does; a clocked-out frame goes to the destination port at once. A port may also have
  a downlink rate, and a pair of ports a rate of its own: a frame is then clocked out once, at
  the least of its sender's uplink, its receiver's downlink and its pair's rate (one serial
  line between the two; the receiver's port learned from earlier frames). A downlink is thus
  not shared between senders: two devices sending to one at once each get its downlink rate
  (the tbf emulator's ifb does share it). Broadcasts and frames to unlearned ports take the
  uplink rate. Frames are counted as
  AF_PACKET reads them, Ethernet header included, no FCS: the bytes tbf counts.
- Schedule (`testbed.link.wire.departure_s`): start = max(kernel arrival time, scheduled
  end of the port's previous frame), end = start + wire time; the frame is sent at `end`.
  Arrivals are the kernel's receive timestamps (SO_TIMESTAMPNS_NEW, else SO_TIMESTAMPNS), and
  the previous end is the *scheduled* one, so this program's time per frame never adds up:
  bulk runs at the rate however late single frames leave (after a stall, frames leave back to
  back until on schedule). A timestamp missing or more than `TIMESTAMP_SANITY_S` from
  `time.time()` (both CLOCK_REALTIME) is replaced by `time.time()`, with one warning.
- Stalls: a frame that leaves more than `STALL_S` late was held up by the machine (a VM's
  vCPU held by its host, kernel work), not by a wake-up; SCHED_FIFO cannot prevent those.
  The counters keep the stalls, their length and when each began (`stalls`, `stalled_ms`,
  `stall_log`: [start s, ms] by time.time(), the last STALL_LOG of them): under load here,
  about one 5 ms stall per CPU every few seconds, once 12.6 ms. A TCP flow keeps only a
  millisecond or two of frames queued, so its link loses about a stall's length each time.
- Waiting (`wait_until`): a port's thread sleeps until a frame's departure. A sleeping
  thread wakes 20-65 us late here: 20 us while its CPU runs a small loop, 40-65 us after
  the CPU ran code that evicts its caches, as a device's matrix products do (a FIFO thread
  sleeping 1 ms on a CPU running a 768x768 float32 product: median 60 us, p90 66; a
  32x32 one: 24 us; an idle CPU: 30-45 us; this VM's vCPUs wake through a hypervisor, whose
  page walks are long when cold). With `--spin-us`, the C core's default `CORE_SPIN_US`,
  the thread wakes that long before a frame that ends a message is due and polls the
  clock from there: the last segment of a TCP write (PSH set), or a frame other than TCP
  that found its line free. Other frames sleep their wait out: a bare ACK moves no
  message's latency, and a segment inside a write is followed by the next on the line,
  whose schedule does not depend on when this one left. The polled time is taken from the
  device whose CPUs the port's thread runs on, at most `spin_us` per message, about 0.5%
  of ViT-B/16's compute per inference at 80 us (docs/benchmarks.md: measured 2026-12-03, no
  change in compute within the noise, and the path cost per small message from
  0.07-0.13 ms to 0.04-0.06). The Python loop's polling (`--core python`) yields the GIL
  between polls and covers frames that found their line free; it is off by default there
  (it raised compute 3-6% when measured on 2026-12-01).
- Queue: frames wait, with their timestamps, in the packet socket's receive buffer while the
  port's thread sleeps. Its size (`wire.queue_frames`) is tbf's, `--queue-ms` at the rate
  (the link profile's `queue_latency_ms` on the host's clock: times the dilation) plus two
  frames, but at least `MIN_QUEUE_FRAMES` so that TCP's initial window fits; times
  `TRUESIZE_BYTES`, the kernel memory a queued full frame costs (measured: 2280 B for a TCP
  segment), it is set by SO_RCVBUFFORCE and resized with the rate. Frames the kernel drops
  when it is full are the queue's drops (PACKET_STATISTICS); unlike tbf's, TCP sees them as
  losses (see `testbed.link.serial.switch` for the tbf in front that avoids them).
- Frames this program sends do not loop back to its sockets (PACKET_IGNORE_OUTGOING; where it
  is missing, PACKET_OUTGOING frames are skipped).
- Later hops (`testbed.link.paths`): a frame for a learned receiver then meets the pair's
  impairments and the receiver's downlink's, each drawn on its own (`impair-pair`,
  `impair-down`; the downlink's generator, which every sender draws from, under a lock).
  Their delays come after the line: the frame is clocked out at its rate as before, then
  sent that much later, so a frame for a far receiver does not hold up the next frame for a
  near one (the port reads ahead, as with reordering). A hop's loss drops the frame after
  its line time, a hop's duplicate leaves twice without more line time, and a hop's reorder
  skips that hop's delay.
- Forwarding: source MAC -> port is learned; broadcast, multicast and unknown destinations are
  flooded to every other port; a frame for the port it came from is dropped.
- Core (`--core`): the per-frame loop runs in C where it builds (`core.c`, netem's draws in
  `impair.c`, built with the machine's gcc on first use: `testbed.link.serial.core`), one
  thread per port with the interpreter's lock released, the same schedule, the same
  counters and the same draws from the same seeds (a unit test compares them frame by
  frame); the Python loop below runs with `--core python`, or where the C core cannot be
  built (`auto`, the default, says so in a warning). Measured with make bench: see
  docs/benchmarks.md.
- Shared medium (`medium shared AIRTIME_US`, a Wi-Fi cell): every frame any port receives, data or
  acknowledgement, takes one line, the cell's, one frame at a time. A frame's slot starts
  at the later of its arrival and the end of the last slot any port took, and lasts
  AIRTIME_US (preamble, MAC and channel access) plus its wire time at its
  sender's rate. Arbitration: a port takes its next slot only once its previous one has
  ended (its thread sleeps until then, its next frame waiting in its queue), so while P
  stations have frames waiting, each gets every P-th slot: turns frame by frame, first
  come first served among those waiting. That is what 802.11's DCF gives in the long run
  (every station the same chance at each transmission opportunity, whatever its frames'
  length: a station at a lower rate takes more airtime per frame, the "performance anomaly"
  of Heusse et al., INFOCOM 2003), without its random backoff, collisions and their retries:
  a collision costs airtime that a profile's overhead can stand for, and the backoff would
  make single frames' times random, which the delay's jitter already can. Impairments come
  after the air: a lost frame took its airtime, a delay or jitter follows the air (and does
  not reorder: a copy leaves no earlier than the port's previous delayed one), a reordered
  copy skips its delay, a duplicate takes no second slot. Downlink and pair rates are not
  defined on a cell (the testbed refuses them). Only the C core schedules it: the Python
  loop refuses `medium shared`. A station's queue waits while the others take their
  turns, so on a cell it is `--queue-ms` times the port count.
- SCHED_FIFO when permitted (else a warning) and a 50 us GIL switch interval, so that one
  port's thread does not hold up another's frame.

Protocol: `python -m testbed.link.serial.program serve PORT=RATE_BIT_S ...` prints `ready` once
every port is open, then answers one line on stdout per command line on stdin: `rate PORT BIT_S` ->
`ok`; `down PORT BIT_S` (0: unshaped) -> `ok`; `pair SRC DST BIT_S` (0: none) -> `ok`;
`impair PORT SEED JSON` (netem's parameters, `testbed.experiment.netem_parameters`), `impair-down
PORT SEED JSON`, `impair-pair SRC DST SEED JSON` -> `ok`;
`medium shared AIRTIME_US` or `medium dedicated 0` -> `ok`; `stats` -> JSON {port:
`Port.stats()`}; anything else -> `error <why>`. EOF ends it.
`testbed.link.serial.protocol` parses the command line and the commands.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from testbed.errors import ShapingError
from testbed.link.serial.core import impairments as core_impairments
from testbed.link.serial.core import load as load_core
from testbed.link.serial.netem_draws import Impairments
from testbed.link.serial.port import DEFAULT_SPIN_US, Port
from testbed.link.serial.protocol import parse_command, parse_port, parse_port_cpus
from testbed.link.wire import QUEUE_MS

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 50e-6
CORE_SPIN_US = 80.0  # the C core's --spin-us: a cold wake-up here is 40-65 us late (Waiting)
FIFO_PRIORITY = 10  # above every normal task, below the kernel's threaded interrupts (50)


class Switch:
    """The ports and the learned MAC table; forwards clocked-out frames."""

    def __init__(self, ports: Sequence[Port], core: Any = None):
        self.ports = {port.name: port for port in ports}
        self.core = core  # the C core (testbed.link.serial.core), else the Python loop
        self.learned: dict[bytes, Port] = {}
        self.pair_bit_s: dict[tuple[str, str], float] = {}  # (sending, receiving port)
        self.pair_impairments: dict[tuple[str, str], Impairments] = {}

    def route(self, ingress: Port, frame: Any) -> tuple[float, tuple[Impairments, ...]]:
        """A frame's rate, the least of the sender's uplink, the receiver's downlink and their
        pair's, and the later hops it meets, the pair's then the downlink's; the uplink alone
        for a broadcast or a receiver not learned yet."""
        destination = bytes(frame[:6])
        egress = None if destination[0] & 1 else self.learned.get(destination)
        if egress is None:
            return ingress.rate_bit_s, ()
        key = (ingress.name, egress.name)
        rate_bit_s = ingress.rate_bit_s
        if egress.down_bit_s is not None or self.pair_bit_s:
            limits = (rate_bit_s, egress.down_bit_s, self.pair_bit_s.get(key))
            rate_bit_s = min(limit for limit in limits if limit is not None)
        if not ingress.hops:
            return rate_bit_s, ()
        hops = (self.pair_impairments.get(key), egress.down_impairments)
        return rate_bit_s, tuple(hop for hop in hops if hop is not None)

    def impair_hop(self, command: Any) -> None:
        """A downlink's or a pair's impairments (none: parameters that impair nothing), then
        every port's longest later hop, for its queue and its reading ahead."""
        impairments = Impairments(command.parameters, command.seed)
        hop = impairments if impairments.impairing else None
        handle = None if hop is None or self.core is None else core_impairments(self.core, hop)
        names = list(self.ports)
        if command.name == "impair-down":
            self.ports[command.port].down_impairments = hop
            if self.core is not None:
                self.core.serial_impair_down(names.index(command.port), handle)
        else:
            if hop is None:
                self.pair_impairments.pop((command.port, command.target), None)
            else:
                self.pair_impairments[(command.port, command.target)] = hop
            if self.core is not None:
                source, target = names.index(command.port), names.index(command.target)
                self.core.serial_impair_pair(source, target, handle)
        for port in self.ports.values():
            downs = [p.down_impairments for p in self.ports.values() if p is not port]
            pairs = [i for (source, _), i in self.pair_impairments.items() if source == port.name]
            longest = max((d.max_delay_s for d in downs if d is not None), default=0.0)
            hop_delay_s = longest + max((i.max_delay_s for i in pairs), default=0.0)
            port.hops = bool(pairs) or any(d is not None for d in downs)
            if hop_delay_s != port.hop_delay_s:
                port.hop_delay_s = hop_delay_s
                port._size_queue()
            port.tell_core()

    def set_medium(self, shared: bool, airtime_us: float) -> str:
        """One line for every port's frames from the next frame on, or a line each; each
        port's queue `queue_ms` times the port count on the cell (see Shared medium)."""
        if shared and self.core is None:
            return (
                "error medium shared: the shared medium is scheduled by the C core (core.c); "
                "this switch runs the Python loop"
            )
        if self.core is not None and self.core.serial_medium(shared, round(1e3 * airtime_us)):
            return f"error medium: the C core refuses airtime {airtime_us} us"
        share = len(self.ports) if shared else 1
        try:
            for port in self.ports.values():
                port.queue_share = share
                port._size_queue()
        except OSError as error:
            return f"error medium: resizing the queues failed: {error}"
        return "ok"

    def forward(self, ingress: Port, frame: bytes) -> None:
        destination, source = frame[:6], frame[6:12]
        if self.learned.get(source) is not ingress:
            self.learned[source] = ingress
            log.debug("learned %s on %s", source.hex(":"), ingress.name)
        egress = None if destination[0] & 1 else self.learned.get(destination)
        if egress is ingress:
            return
        for port in [egress] if egress else self.ports.values():
            if port is not ingress:
                port.transmit(frame)

    def start(self) -> None:
        for port in self.ports.values():
            port.open()
        if self.core is not None:
            self.core.serial_init(len(self.ports))
            for index, port in enumerate(self.ports.values()):
                assert port.sock is not None
                port.core, port.index = self.core, index
                self.core.serial_port(index, port.sock.fileno(), port.rate_bit_s)
                port.tell_core()
        for port in self.ports.values():
            threading.Thread(target=self._serve, args=(port,), name=port.name, daemon=True).start()

    def _serve(self, port: Port) -> None:
        try:
            if self.core is not None:
                port.serve_in_core()
            port.serve(self.forward, self.route)
        except BaseException:
            log.exception("port %s failed; the serial link stops", port.name)
            sys.stderr.flush()
            os._exit(3)  # a switch with a dead port must not look alive

    def execute(self, line: str) -> str:
        """Runs one stdin command; returns the answer line."""
        try:
            command = parse_command(line, self.ports)
        except ShapingError as error:
            return f"error {error}"
        if command.name == "stats":
            return json.dumps({name: port.stats() for name, port in self.ports.items()})
        if command.name == "medium":
            return self.set_medium(command.medium == "shared", command.airtime_us or 0.0)
        assert command.port is not None
        if command.name.startswith("impair"):
            assert command.parameters is not None and command.seed is not None
            try:
                if command.name == "impair":
                    self.ports[command.port].impair(command.parameters, command.seed)
                else:
                    self.impair_hop(command)
            except (OSError, ValueError) as error:  # a table missing, resizing the queue
                return f"error {command.name} {command.port}: {error}"
            return "ok"
        if command.name == "down":
            self.ports[command.port].set_down(command.rate_bit_s)
            return "ok"
        if command.name == "pair":
            assert command.target is not None
            key = (command.port, command.target)
            if command.rate_bit_s is None:
                self.pair_bit_s.pop(key, None)
            else:
                self.pair_bit_s[key] = command.rate_bit_s
            if self.core is not None:
                names = list(self.ports)
                rate = command.rate_bit_s or 0.0
                self.core.serial_pair(names.index(command.port), names.index(command.target), rate)
            return "ok"
        assert command.rate_bit_s is not None
        try:
            self.ports[command.port].set_rate(command.rate_bit_s)
        except OSError as error:
            return f"error rate {command.port}: resizing the queue failed: {error}"
        return "ok"


def use_realtime_scheduling(priority: int = FIFO_PRIORITY) -> bool:
    """SCHED_FIFO for this thread and the threads it starts; a warning when not permitted."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError) as error:
        log.warning("no SCHED_FIFO (%s): frames may leave late when the CPUs are busy", error)
        return False
    return True


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.link.serial.program", description=__doc__
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the switch on the given ports")
    serve.add_argument("ports", nargs="+", metavar="PORT=RATE_BIT_S")
    serve.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help=f"poll the end of a message's wait (default: {CORE_SPIN_US:g} on the C core, "
        f"{DEFAULT_SPIN_US:g} on the Python loop)",
    )
    serve.add_argument(
        "--core",
        choices=("auto", "c", "python"),
        default="auto",
        help="the per-frame loop: C, Python, or C where it builds",
    )
    serve.add_argument("--queue-ms", type=float, default=QUEUE_MS)
    serve.add_argument(
        "--cpus",
        action="append",
        default=[],
        metavar="PORT=CPULIST",
        help="run the port's thread on these CPUs (those of the device that sends into it)",
    )
    serve.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG")
    args = parser.parse_args(argv)
    try:
        args.ports = [parse_port(text) for text in args.ports]
    except ShapingError as error:
        parser.error(str(error))
    names = [name for name, _ in args.ports]
    if len(set(names)) != len(names):
        parser.error(f"a port is given twice: {names}")
    if (args.spin_us is not None and args.spin_us < 0) or args.queue_ms <= 0:
        parser.error("--spin-us must be >= 0 and --queue-ms > 0")
    try:
        args.cpus = dict(parse_port_cpus(text, names) for text in args.cpus)
    except ShapingError as error:
        parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="serial_link %(levelname)s: %(message)s",
    )
    use_realtime_scheduling()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    library = None
    if args.core != "python":
        library = load_core()
        if library is None and args.core == "c":
            log.error("--core c: the C core cannot be built or loaded")
            return 1
    spin_us = args.spin_us
    if spin_us is None:
        spin_us = DEFAULT_SPIN_US if library is None else CORE_SPIN_US
    ports = [
        Port(name, rate, args.queue_ms, spin_us / 1e6, args.cpus.get(name))
        for name, rate in args.ports
    ]
    if library is not None:
        library.serial_spin(round(1e3 * spin_us))
    switch = Switch(ports, library)
    try:
        switch.start()
    except (OSError, ShapingError) as error:
        log.error("cannot open the ports %s: %s", [port.name for port in ports], error)
        return 1
    print("ready", flush=True)
    for line in iter(sys.stdin.readline, ""):
        if line.strip():
            print(switch.execute(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
