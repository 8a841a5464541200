"""A run's serial switch: the namespace, the veth pairs and the emulator that joins devices.

`SerialSwitch` builds what `testbed.link.serial.program` (the emulator program) needs and owns it
until `stop()`: a network namespace `tb-<tag>-sl` (`testbed.kernel.names`), and per device a
veth pair whose switch end `tb<tag>s<rank>` lives there and whose device end `sl0` is created
directly inside the device's namespace (`testbed.kernel.interfaces.veth_into`), addressed
`subnet[rank + 1]`. Each device thus gets a
second interface, next to whatever network its backend gave it, on which every frame it sends
is clocked out at its rate. Devices' namespaces are given as paths (`/proc/<pid>/ns/net` of a
container, `/var/run/netns/<name>` of the local backend); the veth's peer is created in an fd
of that path.

Both ends are up without IPv6 link-local addresses (only the experiment's traffic crosses
the link) and with offloads off, transmit checksums included: the emulator copies frames
through packet sockets, and a frame whose checksum the sender left to the hardware arrives
corrupt (measured: with `tx on`, no TCP handshake completes). So a missing `ethtool` is an
error here, not a warning. Device ends get `gso_max_segs 1` (see `testbed.kernel.shaping.gso_argv`).

Backpressure (on by default): each `sl0` also gets the project's tbf (`testbed.kernel.tbf`) at
the port's rate, or an htb with a class per peer that the device reaches slower than its
uplink (the peer's downlink or the pair's rate, `set_rates`). The emulator alone is a remote
bottleneck with a drop-tail queue, which TCP learns of only by losses. Measured with 2 s bulk
transfers at 1-20 Mbit/s (BBR): its start-up overflowed the 32-frame queue (47-69
retransmissions per transfer; at 5 and 10 Mbit/s the rate read 2.8 % off, the losses falling
in the measured window) and frames waited 0.28 s on average at 1 Mbit/s; a 128-frame queue
lost less but made that wait 0.5 s. With tbf in front, TCP sees a full queue as local
congestion, as on a device whose own uplink is the slow link: no retransmissions, bulk within
0.01 %. tbf's bucket lets at most two frames through early, and the emulator still clocks out
every frame (the frame tbf keeps ahead waits one frame time in the emulator's queue); isolated
messages take the same time with and without it. tbf's queue holds what the port's does
(`testbed.link.wire.queue_held_ms`: the program's `--queue-ms` at the rate, at least
`MIN_QUEUE_FRAMES`): with 50 ms alone, at 0.41 Mbit/s it held three frames, and ten devices
each sending to nine peers at once (Voltage at P = 10) lost a third of their frames in it,
until the kernel's TCP gave up on a connection (`Connection timed out`).

The emulator runs as `nsenter --net=/var/run/netns/tb-<tag>-sl <python> -m
testbed.link.serial.program serve ...` in a process group of its own; `set_rate` and `stats`
talk to it over its stdin and stdout. `stop()` closes its stdin (it exits at EOF), kills it if
it lingers, deletes the veths (which takes the devices' `sl0` with them) and the namespace; it
is idempotent.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from testbed.errors import ShapingError
from testbed.kernel.interfaces import Veth, offload_argv, veth_into
from testbed.kernel.names import TAG_PATTERN, RunNames
from testbed.kernel.netns import create_netns, in_netns, iproute, netlink_step, netns_path
from testbed.kernel.processes import kill_group, run_checked, start_group
from testbed.link.wire import QUEUE_MS, queue_held_ms
from testbed.source import python_env
from testbed.units import BIT_PER_MBIT

log = logging.getLogger(__name__)

DEVICE_INTERFACE = "sl0"
WHO = "serial switch"
READY_TIMEOUT_S = 15.0
ANSWER_TIMEOUT_S = 5.0
EXIT_WAIT_S = 3.0


@dataclass(frozen=True)
class ProgramOptions:
    """How the emulator program runs, beside its ports (None: the program's default)."""

    spin_us: float | None = None  # its --spin-us
    queue_ms: float | None = None  # its --queue-ms
    core: str | None = None  # its --core: auto, c or python (python where it draws impairments)
    # per device, the CPUs it is pinned to ("0", "2-3"), or None: the port that device sends
    # into is served on those CPUs, so that a frame wakes the emulator on the CPU that sent it
    # (no inter-processor wake-up)
    cpusets: Sequence[str | None] | None = None

    def argv(self, ports: Sequence[str]) -> list[str]:
        """The options on the program's command line; `ports`: the ports by device rank."""
        argv = []
        if self.spin_us is not None:
            argv += ["--spin-us", str(self.spin_us)]
        if self.queue_ms is not None:
            argv += ["--queue-ms", str(self.queue_ms)]
        if self.core is not None:
            argv += ["--core", self.core]
        cpusets = self.cpusets or [None] * len(ports)
        for port, cpuset in zip(ports, cpusets, strict=True):
            if cpuset:
                argv += ["--cpus", f"{port}={cpuset}"]
        return argv


class SerialSwitch:
    """Devices joined by `testbed.link.serial.program`: each device's frames leave at its rate."""

    interface = DEVICE_INTERFACE

    def __init__(
        self,
        tag: str,
        device_netns: Sequence[str],
        subnet: ipaddress.IPv4Network,
        rate_mbit: float,
        backpressure: bool = True,
        program: ProgramOptions | None = None,
    ):
        """
        Args:
            tag: the run's 8 hex digits (`testbed.kernel.names.run_tag`).
            device_netns: each device's network namespace path, in rank order.
            subnet: the /24 (or larger) that numbers the devices: rank r gets host r + 1.
            rate_mbit: every port's initial rate (10^6 bit/s of Ethernet frames).
            backpressure: also put tbf at the rate on each `sl0` (see the module docstring).
            program: how the emulator program runs (None: its defaults).
        """
        if not TAG_PATTERN.match(tag):
            raise ShapingError(f"serial switch: tag {tag!r} is not 8 lowercase hex digits")
        if not device_netns or len(device_netns) > subnet.num_addresses - 2:
            raise ShapingError(f"serial switch: {len(device_netns)} devices do not fit {subnet}")
        if rate_mbit <= 0:
            raise ShapingError(f"serial switch: rate must be positive, got {rate_mbit} mbit")
        self.tag, self.subnet, self.backpressure = tag, subnet, backpressure
        self.program = program or ProgramOptions()
        self.device_netns = list(device_netns)
        self.rates_mbit = [float(rate_mbit)] * len(device_netns)
        self.downlinks_mbit: list[float | None] = [None] * len(device_netns)
        self.pairs_mbit: dict[tuple[int, int], float] = {}
        self._backpressured: dict[int, tuple[int, ...]] = {}  # rank: its sl0's capped peers
        self.names = RunNames(tag)
        self.netns = self.names.serial_netns
        self.process: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._created_netns = False

    @property
    def netns_path(self) -> str:
        return netns_path(self.netns)

    def port(self, rank: int) -> str:
        """The switch's end of device `rank`'s veth pair."""
        return self.names.serial_port(rank)

    def address(self, rank: int) -> str:
        """Device `rank`'s IPv4 address on `sl0`."""
        return str(self.subnet[rank + 1])

    # Building -----------------------------------------------------------------------------

    def start(self) -> SerialSwitch:
        """Creates the namespace and veths, starts the emulator and waits for its `ready`."""
        if shutil.which("ethtool") is None or shutil.which("nsenter") is None:
            raise ShapingError("serial switch needs `ethtool` and `nsenter` to turn offloads off")
        if Path(self.netns_path).exists():
            raise ShapingError(
                f"namespace {self.netns} already exists: another run uses tag {self.tag}, "
                "or a crashed run left it (`python -m testbed.clean`)"
            )
        try:
            self._create_namespace()
            for rank in self.ranks:
                self._connect(rank)
                self._shape(rank)
            self._start_emulator()
        except BaseException:  # also Ctrl-C: leave nothing behind
            self.stop()
            raise
        return self

    def _create_namespace(self) -> None:
        create_netns(self.netns, WHO, ShapingError)
        self._created_netns = True

    def _connect(self, rank: int) -> None:
        """One veth pair: the port here, `sl0` created inside the device's namespace."""
        port, device = self.port(rank), self.device_netns[rank]
        address = ipaddress.IPv4Interface((self.address(rank), self.subnet.prefixlen))
        veth = Veth(self.netns_path, port, device, DEVICE_INTERFACE, address)
        veth_into(veth, WHO, ShapingError, gso_max_segs=1)
        where = f"{self.netns}: veth {port} <-> {device}:{DEVICE_INTERFACE}"
        for netns, interface in ((self.netns_path, port), (device, DEVICE_INTERFACE)):
            argv = in_netns(netns, offload_argv(interface, checksums=True))
            run_checked(argv, where, "offloads off")

    def emulator_argv(self) -> list[str]:
        """The command that runs the emulator in the switch namespace."""
        argv = [sys.executable, "-m", "testbed.link.serial.program"]
        argv += ["serve"] + [f"{self.port(r)}={self._bit_s(r)}" for r in self.ranks]
        argv += self.program.argv([self.port(r) for r in self.ranks])
        return in_netns(self.netns_path, argv)

    def _start_emulator(self) -> None:
        self.process = start_group(
            self.emulator_argv(),
            "the serial link",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=python_env(),
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        _pump(self.process.stdout, self._lines.put, end=lambda: self._lines.put(None))
        _pump(self.process.stderr, self._stderr.append)
        self._expect("ready", READY_TIMEOUT_S, "starting")

    def _bit_s(self, rank: int) -> int:
        return round(self.rates_mbit[rank] * BIT_PER_MBIT)

    @property
    def ranks(self) -> range:
        return range(len(self.device_netns))

    def _shape(self, rank: int) -> None:
        """With backpressure: tbf at the port's rate on the device's `sl0`, attached the
        first time and changed in place afterwards (never unshaped in between). Peers that
        the device reaches slower than its uplink (their downlink, a pair's rate) get an htb
        class each at that rate instead (`testbed.kernel.htb`), so TCP sees every bottleneck of
        the emulator as local congestion."""
        if not self.backpressure:
            return
        from testbed.kernel.netlink import apply, change
        from testbed.kernel.shaping import ShapingPlan
        from testbed.kernel.tbf import tbf_params

        rate_mbit = self.rates_mbit[rank]
        caps = {peer: (self.address(peer), cap) for peer, cap in self.peer_caps(rank).items()}
        queue_ms = queue_held_ms(rate_mbit * BIT_PER_MBIT, self.program.queue_ms or QUEUE_MS)
        tbf = tbf_params(rate_mbit, queue_latency_ms=queue_ms)
        plan = ShapingPlan("serial-backpressure", rate_mbit, tbf)
        if caps:
            from testbed.kernel.htb import htb_params

            htb = htb_params(rate_mbit, caps, queue_ms)
            plan = ShapingPlan(plan.profile_name, rate_mbit, tbf, htb=htb)
        layout = tuple(sorted(caps))
        if self._backpressured.get(rank) == layout:
            change(self.device_netns[rank], DEVICE_INTERFACE, plan)
        else:
            apply(self.device_netns[rank], DEVICE_INTERFACE, plan)
            self._backpressured[rank] = layout

    def peer_caps(self, rank: int) -> dict[int, float]:
        """Peers `rank` sends to slower than its uplink, and that rate (Mbit/s)."""
        uplink, caps = self.rates_mbit[rank], {}
        for peer in self.ranks:
            limits = [self.downlinks_mbit[peer], self.pairs_mbit.get((rank, peer))]
            slowest = min([limit for limit in limits if limit is not None], default=uplink)
            if peer != rank and slowest < uplink:
                caps[peer] = slowest
        return caps

    # Talking to the emulator --------------------------------------------------------------

    def _expect(self, prefix: str, timeout_s: float, action: str) -> str:
        """The emulator's next line, which must start with `prefix`."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            line = f"no answer within {timeout_s:g} s"
        if line is None or not line.startswith(prefix):
            if line is None:
                line = f"it exited (status {self._exit_status()})"
            stderr = "".join(self._stderr[-20:]).strip() or "(empty)"
            raise ShapingError(
                f"serial link in namespace {self.netns}: {action} failed: {line.strip()}; "
                f"its stderr: {stderr}"
            )
        return line

    def exited(self) -> int | None:
        """The emulator's exit status if it has exited (None while it runs or before start)."""
        return None if self.process is None else self.process.poll()

    def _exit_status(self) -> int | None:
        """The emulator's exit status once its output has ended (None if it lingers)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.process.wait(EXIT_WAIT_S) if self.process else None
        return None

    def _ask(self, command: str, prefix: str, action: str) -> str:
        if self.process is None or self.process.stdin is None:
            raise ShapingError(f"serial link in namespace {self.netns} is not running ({action})")
        log.debug("%s: serial link <- %s", self.netns, command)
        try:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        except OSError as error:
            raise ShapingError(f"serial link in {self.netns}: {action} failed: {error}") from None
        return self._expect(prefix, ANSWER_TIMEOUT_S, action)

    def set_rate(self, rank: int, rate_mbit: float) -> None:
        """Device `rank`'s frames leave at `rate_mbit` from now on."""
        if rank not in self.ranks or rate_mbit <= 0:
            raise ShapingError(f"serial switch: cannot set rank {rank} to {rate_mbit} mbit")
        bit_s = round(rate_mbit * BIT_PER_MBIT)
        self._ask(f"rate {self.port(rank)} {bit_s}", "ok", f"set rank {rank} to {rate_mbit} mbit")
        self.rates_mbit[rank] = float(rate_mbit)
        self._shape(rank)

    def set_rates(
        self,
        uplink_mbit: Sequence[float],
        downlink_mbit: Sequence[float | None],
        pair_mbit: dict[tuple[int, int], float],
    ) -> None:
        """Every port's uplink and downlink (None: unshaped) and the pairs' rates (those not
        given removed), then each device's backpressure: changed in place while its layout
        (which peers have a class) stays, else attached anew."""

        def bits(rate: float | None) -> int:
            return 0 if rate is None else round(rate * BIT_PER_MBIT)

        for rank in self.ranks:
            port, up, down = self.port(rank), uplink_mbit[rank], downlink_mbit[rank]
            self._ask(f"rate {port} {bits(up)}", "ok", f"set rank {rank} to {up} mbit")
            if down is not None or self.downlinks_mbit[rank] is not None:
                self._ask(f"down {port} {bits(down)}", "ok", f"set rank {rank}'s downlink")
        for source, target in {*self.pairs_mbit, *pair_mbit}:
            rate = pair_mbit.get((source, target))
            command = f"pair {self.port(source)} {self.port(target)} {bits(rate)}"
            self._ask(command, "ok", f"set pair {source}->{target}")
        self.rates_mbit = [float(rate) for rate in uplink_mbit]
        self.downlinks_mbit = list(downlink_mbit)
        self.pairs_mbit = dict(pair_mbit)
        for rank in self.ranks:
            self._shape(rank)

    def set_medium(self, shared: bool, airtime_us: float = 0.0) -> None:
        """Every device's frames on one line from now on (a cell: `shared`, each frame with
        `airtime_us` besides its wire time), or a line each (program.py, Shared medium)."""
        medium = "shared" if shared else "dedicated"
        self._ask(f"medium {medium} {airtime_us:g}", "ok", f"set the medium {medium}")

    def impair(
        self,
        rank: int,
        parameters: dict[str, Any],
        seed: int,
        hop: str = "up",
        target: int | None = None,
    ) -> None:
        """netem's impairments (testbed.experiment.netem_parameters) from now on, drawn from
        `seed`, on the frames device `rank` sends (`hop` "up"), receives ("down"), or sends
        to `target` ("pair"; testbed.link.paths)."""
        for each in (rank, target):
            if each is not None and each not in self.ranks:
                raise ShapingError(f"serial switch: no rank {each} to impair")
        text = json.dumps(parameters)
        if hop == "pair":
            assert target is not None
            command = f"impair-pair {self.port(rank)} {self.port(target)} {seed} {text}"
            where = f"impair pair {rank}->{target}"
        else:
            command = f"impair{'-down' if hop == 'down' else ''} {self.port(rank)} {seed} {text}"
            where = f"impair rank {rank}'s {hop}link"
        self._ask(command, "ok", where)

    def stats(self) -> dict[int, dict[str, Any]]:
        """Per rank: frames and bytes its device sent, queue drops, rate, lateness."""
        by_port = json.loads(self._ask("stats", "{", "read statistics"))
        return {rank: by_port[self.port(rank)] for rank in self.ranks}

    # Stopping -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ends the emulator, deletes the veths and the namespace. Idempotent."""
        self._stop_emulator()
        if self._created_netns:
            self._delete_ports()
            from pyroute2 import netns

            log.debug("netlink: remove namespace %s", self.netns)
            with contextlib.suppress(FileNotFoundError):
                netns.remove(self.netns)
            self._created_netns = False

    def _stop_emulator(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            assert process.stdin is not None
            process.stdin.close()  # EOF: the emulator exits
        try:
            process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("serial link (pid %d) ignored EOF; killing it", process.pid)
            kill_group(process.pid, "the serial link")
            process.wait(EXIT_WAIT_S)

    def _delete_ports(self) -> None:
        """Deletes the switch ends; each takes its device's `sl0` with it."""
        try:
            with iproute(self.netns_path, WHO, ShapingError) as ipr:
                for rank in self.ranks:
                    for index in ipr.link_lookup(ifname=self.port(rank)):
                        with netlink_step(
                            f"{self.netns}: delete {self.port(rank)}", WHO, ShapingError
                        ):
                            ipr.link("del", index=index)
        except ShapingError as error:
            log.warning("%s", error)

    def __enter__(self) -> SerialSwitch:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


# Helpers --------------------------------------------------------------------------------------


def _pump(stream: IO[str], put: Any, end: Any = None) -> None:
    """A daemon thread that hands each line of `stream` to `put`, then calls `end`."""

    def pump() -> None:
        for line in stream:
            put(line)
        if end is not None:
            end()

    threading.Thread(target=pump, name="serial-link-pipe", daemon=True).start()
