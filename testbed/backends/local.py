"""Devices as processes on this host, each in its own network namespace (needs root, iproute2).

A run owns one *switch* namespace holding a Linux bridge, and one namespace per device. Each
device's `eth0` is one end of a veth pair whose other end is a port of the bridge. Neither the
bridge nor anything else of the run lives in the host namespace: there, Docker's br_netfilter
hook would send the bridged frames through the host's iptables FORWARD chain, whose policy
Docker sets to DROP. The bridge has no address and the devices no default route, so devices
reach each other and nothing else.

Names derive from the run's tag (`testbed.kernel.names`): namespaces `tb-<tag>-sw` and
`tb-<tag>-d<rank>`, the bridge `tb<tag>` and its ports `tb<tag>h<rank>`.

Commands run through `nsenter --net` (`testbed.kernel.netns.in_netns`), in a process group of
their own, pinned with `taskset` when the CPU plan pins cores, and with a memory limit set by
`prlimit --data` when prlimit is available. RLIMIT_DATA bounds private writable memory (heap,
anonymous maps, thread stacks); unlike RLIMIT_AS it does not count shared libraries or address
space reserved and never used, which for a torch worker is hundreds of MB. Going over it makes
allocations fail (MemoryError) instead of waking an OOM killer. Fractional CPU allotments are
not enforced (no cgroups here).

The run secret (`testbed.backends.base`) is one file, `run.key` of mode 0600, in a folder of
mode 0700 that `start()` makes outside the run directory (`tempfile.mkdtemp`, `testbed-<tag>-*`)
and `stop()` removes. The devices run as root on this host's file system, so one file serves
them all.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from testbed.backends.base import (
    SECRET_FILE_NAME,
    Backend,
    Device,
    DeviceSpec,
    ExecResult,
    Leftovers,
    Process,
    plan_cpus,
    write_secret,
)
from testbed.errors import DeviceError
from testbed.experiment.schema import MAX_DEVICES
from testbed.kernel.addresses import choose_subnet, host_networks
from testbed.kernel.interfaces import link_up, veth_into
from testbed.kernel.names import RunNames
from testbed.kernel.netns import (
    NETNS_DIR,
    create_netns,
    in_netns,
    iproute,
    leftovers_by_tag,
    netlink_step,
    netns_path,
    remove_leftovers,
    remove_namespaces,
)
from testbed.kernel.processes import kill_group, start_group
from testbed.source import python_env

log = logging.getLogger(__name__)

DEVICE_INTERFACE = "eth0"
KILL_WAIT_S = 5.0
WHO = "local backend"


def device_command(
    netns: str, argv: Sequence[str], cpuset: str | None = None, memory_mb: int | None = None
) -> list[str]:
    """The argument list that runs `argv` in a device's namespace (its path), pinned and
    memory-limited."""
    command = []
    if cpuset:
        command += ["taskset", "-c", cpuset]
    if memory_mb:
        limit_bytes = memory_mb * 2**20
        command += ["prlimit", f"--data={limit_bytes}:{limit_bytes}", "--"]
    return in_netns(netns, command + list(argv))


def root_problem() -> str | None:
    """Why this host cannot run the local backend, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and a bridge)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2)"
    if shutil.which("nsenter") is None:
        return "needs util-linux's `nsenter` (apt-get install util-linux)"
    return None


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
        kill_group(self.popen.pid, self.label)


class LocalBackend(Backend):
    name = "local"
    in_auto = True  # where no Docker engine answers
    python = sys.executable or "python3"  # devices run the host's interpreter and code

    @classmethod
    def leftovers(cls, run_dirs: Mapping[str, Path]) -> list[Leftovers]:
        """As root: every run's namespaces and links on this host (`tb-<tag>-*`, the serial
        link's too), by the tag their names carry."""
        if os.geteuid() != 0:
            return []
        return [Leftovers(tag, None, tuple(items)) for tag, items in leftovers_by_tag().items()]

    @classmethod
    def remove(cls, leftovers: Leftovers) -> list[str]:
        return remove_leftovers(tag=leftovers.tag)

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
            self.subnet = choose_subnet(self.run_id, host_networks(WHO))
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
        create_netns(name, WHO, DeviceError)
        self.namespaces.append(name)

    def _create_switch(self) -> None:
        switch, bridge = self.names.switch_netns, self.names.bridge
        self._create_namespace(switch)
        with iproute(netns_path(switch), WHO, DeviceError) as ipr:
            with netlink_step(f"{switch}: add bridge {bridge}", WHO, DeviceError):
                ipr.link("add", ifname=bridge, kind="bridge")
            link_up(ipr, switch, bridge, WHO, DeviceError)

    def _create_device(self, rank: int, spec: DeviceSpec) -> Device:
        assert self.cpu_plan is not None and self.subnet is not None
        name = self.names.device_netns(rank)
        address = ipaddress.IPv4Interface((self.subnet[rank + 1], self.subnet.prefixlen))
        self._create_namespace(name)
        switch, device = netns_path(self.names.switch_netns), netns_path(name)
        port, bridge = self.names.port(rank), self.names.bridge
        veth_into(switch, port, device, DEVICE_INTERFACE, address, WHO, DeviceError, bridge)
        return Device(
            rank=rank,
            name=name,
            address=str(address.ip),
            interface=DEVICE_INTERFACE,
            cpus=spec.cpus,
            threads=self.cpu_plan.threads,
            cpuset=self.cpu_plan.cpusets[rank],
            netns_path=device,
        )

    def spawn(self, device: Device, argv: Sequence[str]) -> Process:
        if device.name not in self.namespaces:
            raise DeviceError(f"{device.name} is not a running device of run {self.run_id}")
        command = device_command(netns_path(device.name), argv, device.cpuset, self.memory_mb)
        popen = start_group(
            command,
            device.name,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=python_env(OMP_NUM_THREADS=str(device.threads)),
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
