"""Devices as processes on this host, each in its own network namespace (needs root, iproute2).

A run owns one *switch* namespace holding a Linux bridge, and one namespace per device. Each
device's `eth0` is one end of a veth pair whose other end is a port of the bridge. Neither the
bridge nor anything else of the run lives in the host namespace: there, Docker's br_netfilter
hook would send the bridged frames through the host's iptables FORWARD chain, whose policy
Docker sets to DROP. The bridge has no address and the devices no default route, so devices
reach each other and nothing else.

Names derive from a tag, the first 8 hex digits of the run id's SHA-1: namespaces
`tb-<tag>-sw` and `tb-<tag>-d<rank>` (under /var/run/netns, so `ip netns` lists them), the
bridge `tb<tag>` and its ports `tb<tag>h<rank>` (interface names fit in 15 characters).

Commands run through `ip netns exec`, in a process group of their own, pinned with `taskset`
when the CPU plan pins cores, and with a memory limit set by `prlimit --data` when prlimit is
available. RLIMIT_DATA bounds private writable memory (heap, anonymous maps, thread stacks);
unlike RLIMIT_AS it does not count shared libraries or address space reserved and never used,
which for a torch worker is hundreds of MB. Going over it makes allocations fail (MemoryError)
instead of waking an OOM killer. Fractional CPU allotments are not enforced (no cgroups here).

The run secret (`testbed.backends.base`) is one file, `run.key` of mode 0600, in a folder of
mode 0700 that `start()` makes outside the run directory (`tempfile.mkdtemp`, `testbed-<tag>-*`)
and `stop()` removes. The devices run as root on this host's file system, so one file serves
them all.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.backends.base import (
    SECRET_FILE_NAME,
    Backend,
    Device,
    DeviceSpec,
    ExecResult,
    Process,
    plan_cpus,
    write_secret,
)
from testbed.errors import DeviceError
from testbed.source import python_env

log = logging.getLogger(__name__)

NETNS_DIR = Path("/var/run/netns")
DEVICE_INTERFACE = "eth0"
IFNAME_MAX_CHARS = 15
MAX_DEVICES = 254  # hosts of one /24, the bridge takes no address
SUBNET_RANGE = (ipaddress.IPv4Address("10.200.0.0"), ipaddress.IPv4Address("10.254.255.255"))
KILL_WAIT_S = 5.0
NO_LINK_LOCAL = {"attrs": [("AF_INET6", {"attrs": [("IFLA_INET6_ADDR_GEN_MODE", 1)]})]}  # none

# the run's namespaces: its switch (sw), its devices (d<N>) and its serial link (sl, made by
# testbed.link.serial.switch on either backend); its bridge, the bridge's ports (h<N>) and the
# serial link's ports (s<N>)
NETNS_PATTERN = re.compile(r"^tb-(?P<tag>[0-9a-f]{8})-(?:sw|sl|d\d+)$")
LINK_PATTERN = re.compile(r"^tb(?P<tag>[0-9a-f]{8})(?P<port>[hs]\d+)?$")


def run_tag(run_id: str) -> str:
    """8 hex digits naming everything of a run, whatever characters the run id holds."""
    return hashlib.sha1(run_id.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class RunNames:
    """Names of a run's namespaces and interfaces."""

    tag: str

    @classmethod
    def for_run(cls, run_id: str) -> RunNames:
        return cls(run_tag(run_id))

    @property
    def switch_netns(self) -> str:
        return f"tb-{self.tag}-sw"

    @property
    def bridge(self) -> str:
        return f"tb{self.tag}"

    def device_netns(self, rank: int) -> str:
        return f"tb-{self.tag}-d{rank}"

    def port(self, rank: int) -> str:
        """The bridge's end of the veth pair of device `rank`."""
        name = f"tb{self.tag}h{rank}"
        if len(name) > IFNAME_MAX_CHARS:
            raise ValueError(f"rank {rank} makes the interface name {name!r} too long")
        return name


def choose_subnet(run_id: str, used: Iterable[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """The run's /24 in 10.200-10.254: starts where the run id's hash points, skips clashes.

    Networks of prefix length 0 (default routes) are ignored: they overlap everything.
    """
    first, last = int(SUBNET_RANGE[0]) >> 8, int(SUBNET_RANGE[1]) >> 8  # numbers of the /24s
    blocked: set[int] = set()
    for network in used:
        if network.prefixlen > 0:
            low = max(int(network.network_address) >> 8, first)
            high = min(int(network.broadcast_address) >> 8, last)
            blocked.update(range(low, high + 1))
    count = last - first + 1
    start = int(hashlib.sha1(run_id.encode()).hexdigest(), 16) % count
    for step in range(count):
        number = first + (start + step) % count
        if number not in blocked:
            return ipaddress.IPv4Network((number << 8, 24))
    raise DeviceError(f"no /24 in {SUBNET_RANGE[0]}-{SUBNET_RANGE[1]} is free of the host's routes")


def device_command(
    netns_name: str, argv: Sequence[str], cpuset: str | None = None, memory_mb: int | None = None
) -> list[str]:
    """The argument list that runs `argv` in a device's namespace, pinned and memory-limited."""
    command = ["ip", "netns", "exec", netns_name]
    if cpuset:
        command += ["taskset", "-c", cpuset]
    if memory_mb:
        limit_bytes = memory_mb * 2**20
        command += ["prlimit", f"--data={limit_bytes}:{limit_bytes}", "--"]
    return command + list(argv)


def root_problem() -> str | None:
    """Why this host cannot run the local backend, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and a bridge)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2)"
    return None


@contextlib.contextmanager
def _netlink(action: str) -> Iterator[None]:
    """Logs a netlink action at DEBUG and turns its failure into a DeviceError naming it."""
    from pyroute2 import NetlinkError

    log.debug("netlink: %s", action)
    try:
        yield
    except (OSError, NetlinkError) as error:
        raise DeviceError(f"local backend: {action} failed: {error}") from error


def host_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks the host namespace routes or holds addresses in (all tables)."""
    from pyroute2 import IPRoute

    networks = []
    with _netlink("read the host's routes and addresses"), IPRoute() as ipr:
        for route in ipr.get_routes(family=socket.AF_INET):
            destination = route.get("dst") or "0.0.0.0"
            networks.append(ipaddress.ip_network(f"{destination}/{route['dst_len']}", False))
        for address in ipr.get_addr(family=socket.AF_INET):
            networks.append(
                ipaddress.ip_network(f"{address.get('address')}/{address['prefixlen']}", False)
            )
    return networks


def _link_up(ipr: Any, where: str, ifname: str, **settings: Any) -> None:
    """Sets a link up (with `settings`, e.g. master) and without an IPv6 link-local address.

    Without link-local addresses the run's network carries only the experiment's traffic (no
    duplicate address detection, router or multicast listener messages), as in Docker's
    containers, where IPv6 is off.
    """
    with _netlink(f"{where}: {ifname}: no IPv6 link-local"):
        index = ipr.link_lookup(ifname=ifname)[0]
        ipr.link("set", index=index, IFLA_AF_SPEC=NO_LINK_LOCAL)
    with _netlink(f"{where}: {ifname}: up {settings or ''}"):
        ipr.link("set", index=index, state="up", **settings)


class LocalProcess(Process):
    """A command in its own process group; its output is read by a thread of ours."""

    def __init__(self, popen: subprocess.Popen[bytes], label: str):
        self.popen = popen
        super().__init__(label)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _collect(self) -> None:
        stdout, stderr = self.popen.communicate()
        self.result = ExecResult(
            self.popen.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace")
        )

    def kill(self) -> None:
        """SIGKILL to the whole group, also when its leader has already ended."""
        log.debug("kill -KILL -%d (%s)", self.popen.pid, self.label)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)


class LocalBackend(Backend):
    name = "local"
    python = sys.executable or "python3"  # devices run the host's interpreter and code

    def __init__(self, run_id: str, run_dir: Path):
        super().__init__(run_id, run_dir)
        self.names = RunNames.for_run(run_id)
        self.subnet: ipaddress.IPv4Network | None = None
        self.memory_mb: int | None = None
        self.processes: list[LocalProcess] = []
        self.namespaces: list[str] = []  # created by this backend, switch first
        self.private_dir: Path | None = None  # the run secret's folder, outside the run dir

    def start(self, spec: DeviceSpec) -> list[Device]:
        self.cpu_plan = plan_cpus(spec.count, spec.cpus)
        self._check_host(spec)
        self.memory_mb = spec.memory_mb if shutil.which("prlimit") else None
        if self.memory_mb is None:
            log.warning("no `prlimit`: devices of run %s get no memory limit", self.run_id)
        if not float(spec.cpus).is_integer():
            log.warning("local backend: %s CPUs per device are not enforced", spec.cpus)
        if self.cpu_plan.oversubscribed:
            log.warning(
                "run %s oversubscribes the host's %d cores", self.run_id, self.cpu_plan.host_cores
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log.debug("run %s: namespaces tb-%s-*", self.run_id, self.names.tag)
        try:
            self._deliver_secret(spec.count)
            self.subnet = choose_subnet(self.run_id, host_networks())
            self._create_switch()
            self.devices = [self._create_device(rank, spec) for rank in range(spec.count)]
        except BaseException:  # also Ctrl-C: leave nothing behind
            self.stop()
            raise
        return self.devices

    def _check_host(self, spec: DeviceSpec) -> None:
        """Raises DeviceError, before anything is created, when this run cannot start here."""
        problem = root_problem()
        if problem:
            raise DeviceError(f"the local backend {problem}; use --backend docker otherwise")
        if not 1 <= spec.count <= MAX_DEVICES:
            raise DeviceError(
                f"the local backend runs 1 to {MAX_DEVICES} devices, not {spec.count}"
            )
        assert self.cpu_plan is not None
        if any(self.cpu_plan.cpusets) and shutil.which("taskset") is None:
            raise DeviceError("the local backend needs util-linux's `taskset` to pin cores")
        names = [self.names.switch_netns] + [self.names.device_netns(r) for r in range(spec.count)]
        existing = [name for name in names if (NETNS_DIR / name).exists()]
        if existing:
            raise DeviceError(
                f"namespaces {existing} of run {self.run_id} already exist: another backend uses "
                "this run id, or a crashed run left them (`python -m testbed.clean`)"
            )

    def _deliver_secret(self, count: int) -> None:
        self.private_dir = Path(tempfile.mkdtemp(prefix=f"testbed-{self.names.tag}-"))
        path = write_secret(self.private_dir / SECRET_FILE_NAME, self.secret)
        log.debug("run secret: %s (mode 0600)", path)
        self.secret_files = {rank: str(path) for rank in range(count)}

    def _create_namespace(self, name: str) -> None:
        from pyroute2 import netns

        with _netlink(f"create namespace {name}"):
            netns.create(name)
        self.namespaces.append(name)

    def _create_switch(self) -> None:
        from pyroute2 import NetNS

        switch, bridge = self.names.switch_netns, self.names.bridge
        self._create_namespace(switch)
        with NetNS(switch, flags=0) as ipr:
            with _netlink(f"{switch}: add bridge {bridge}"):
                ipr.link("add", ifname=bridge, kind="bridge")
            _link_up(ipr, switch, bridge)

    def _create_device(self, rank: int, spec: DeviceSpec) -> Device:
        from pyroute2 import NetNS

        assert self.cpu_plan is not None and self.subnet is not None
        switch, port = self.names.switch_netns, self.names.port(rank)
        name = self.names.device_netns(rank)
        address = self.subnet[rank + 1]
        self._create_namespace(name)
        # The peer is created inside the device's namespace already named eth0: one netlink
        # message instead of create, move and rename, and no interface with a temporary name.
        with NetNS(switch, flags=0) as ipr:
            with _netlink(f"{switch}: add veth {port} <-> {name}:{DEVICE_INTERFACE}"):
                peer = {"ifname": DEVICE_INTERFACE, "net_ns_fd": name}
                ipr.link("add", ifname=port, kind="veth", peer=peer)
            bridge = ipr.link_lookup(ifname=self.names.bridge)[0]
            _link_up(ipr, switch, port, master=bridge)
        with NetNS(name, flags=0) as ipr:
            with _netlink(f"{name}: set lo up"):
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            eth0 = ipr.link_lookup(ifname=DEVICE_INTERFACE)[0]
            with _netlink(f"{name}: add {address}/{self.subnet.prefixlen} to {DEVICE_INTERFACE}"):
                ipr.addr("add", index=eth0, address=str(address), prefixlen=self.subnet.prefixlen)
            _link_up(ipr, name, DEVICE_INTERFACE)
        return Device(
            rank=rank,
            name=name,
            address=str(address),
            interface=DEVICE_INTERFACE,
            cpus=spec.cpus,
            threads=self.cpu_plan.threads,
            cpuset=self.cpu_plan.cpusets[rank],
            netns_path=str(NETNS_DIR / name),
        )

    def spawn(self, device: Device, argv: Sequence[str]) -> Process:
        if device.name not in self.namespaces:
            raise DeviceError(f"{device.name} is not a running device of run {self.run_id}")
        command = device_command(device.name, argv, device.cpuset, self.memory_mb)
        log.debug("spawn on %s: %s", device.name, command)
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=python_env(OMP_NUM_THREADS=str(device.threads)),
            start_new_session=True,
        )
        process = LocalProcess(popen, device.name)
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            try:
                process.wait(KILL_WAIT_S)
            except TimeoutError:
                log.warning("%s (pid %d) survived SIGKILL", process.label, process.pid)
        self.processes = []
        remove_namespaces(self.namespaces)
        self.namespaces = []
        if self.private_dir is not None:
            log.debug("rm -r %s", self.private_dir)
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir, self.secret_files = None, {}


def _pids_in(netns_path: Path) -> list[int]:
    """Processes whose network namespace is the one mounted at `netns_path`."""
    try:
        target = netns_path.stat()
    except OSError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            ns = (entry / "ns" / "net").stat()
            if (ns.st_dev, ns.st_ino) == (target.st_dev, target.st_ino):
                pids.append(int(entry.name))
    return pids


def _delete_links(netns_name: str | None, tag: str | None) -> list[str]:
    """Deletes the run's veths (with their peers) and bridges in a namespace (None: the host's)."""
    from pyroute2 import IPRoute, NetlinkError, NetNS

    removed = []
    try:
        with NetNS(netns_name, flags=0) if netns_name else IPRoute() as ipr:
            ours = []
            for link in ipr.get_links():
                match = LINK_PATTERN.match(link.get("ifname") or "")
                if match and tag in (None, match["tag"]):
                    ours.append((match["port"] is None, link.get("ifname"), link["index"]))
            # ports first: deleting a port's veth also deletes the device's eth0, its peer
            for _, ifname, index in sorted(ours):
                log.debug("netlink: %s: delete link %s", netns_name or "host", ifname)
                with contextlib.suppress(NetlinkError):
                    ipr.link("del", index=index)
                    removed.append(f"link {ifname}")
    except FileNotFoundError:
        pass  # the namespace is already gone
    return removed


def remove_namespaces(names: Sequence[str]) -> list[str]:
    """Kills what runs in the namespaces, deletes their links, unmounts them; returns what went."""
    from pyroute2 import netns

    removed = []
    for name in names:
        for pid in _pids_in(NETNS_DIR / name):
            log.debug("kill -KILL %d (left in %s)", pid, name)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                removed.append(f"process {pid}")
    for name in names:
        match = NETNS_PATTERN.match(name)
        if match and name.endswith(("-sw", "-sl")):
            removed += _delete_links(name, match["tag"])
    for name in reversed(names):  # devices before the switch
        log.debug("netlink: remove namespace %s", name)
        try:
            netns.remove(name)
            removed.append(f"namespace {name}")
        except FileNotFoundError:
            pass
        except OSError as error:
            log.warning("removing namespace %s: %s", name, error)
    return removed


def leftovers_by_tag() -> dict[str, list[str]]:
    """What runs left on this host, by run tag: their namespaces, and their links in the
    host's namespace."""
    from pyroute2 import IPRoute, netns

    found: dict[str, list[str]] = {}
    for name in sorted(netns.listnetns(str(NETNS_DIR))):
        if match := NETNS_PATTERN.match(name):
            found.setdefault(match["tag"], []).append(f"namespace {name}")
    with IPRoute() as ipr:
        for link in ipr.get_links():
            ifname = link.get("ifname") or ""
            if match := LINK_PATTERN.match(ifname):
                found.setdefault(match["tag"], []).append(f"link {ifname}")
    return found


def remove_leftovers(run_id: str | None = None, tag: str | None = None) -> list[str]:
    """Removes the namespaces, bridges and veths that a run (by id or tag), or every run, left
    behind. Returns what was removed (processes still running in those namespaces are killed).
    """
    from pyroute2 import netns

    tag = tag or (run_tag(run_id) if run_id else None)
    names = []
    for name in sorted(netns.listnetns(str(NETNS_DIR))):
        match = NETNS_PATTERN.match(name)
        if match and tag in (None, match["tag"]):
            names.append(name)
    switches = [name for name in names if name.endswith(("-sw", "-sl"))]
    removed = remove_namespaces(switches + [name for name in names if name not in switches])
    return removed + _delete_links(None, tag)
