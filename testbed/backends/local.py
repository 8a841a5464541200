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
their own, inside the device's control groups (`testbed.kernel.cgroups`, named like its
namespace): its pinned cores (cpuset) when the CPU plan pins cores, else a CPU quota of its
allotment (cpu), its memory limit (memory: the kernel's OOM killer ends a worker that goes
over, as in a container), and a freezer for a timeline's pauses. A process joins the groups
between fork and exec, so nothing it allocates is charged elsewhere.

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
import signal
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
from testbed.experiment.devices_section import MAX_DEVICES
from testbed.kernel import cgroups
from testbed.kernel.addresses import choose_subnet, host_networks
from testbed.kernel.interfaces import Veth, link_up, veth_into
from testbed.kernel.names import RunNames, netns_tag
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


def root_problem() -> str | None:
    """Why this host cannot run the local backend, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and a bridge)"
    if (why := cgroups.available()) is not None:
        return f"needs control groups ({why})"
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

    def terminate(self) -> None:
        kill_group(self.popen.pid, self.label, signal.SIGTERM)


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
        found = leftovers_by_tag()
        for name in cgroups.group_names():
            tag = netns_tag(name)  # a device's groups are named like its namespace
            if tag is not None:
                found.setdefault(tag, []).append(f"cgroup {name}")
        return [Leftovers(tag, None, tuple(items)) for tag, items in found.items()]

    @classmethod
    def remove(cls, leftovers: Leftovers) -> list[str]:
        groups = [i.removeprefix("cgroup ") for i in leftovers.items if i.startswith("cgroup ")]
        for name in groups:
            cgroups.DeviceGroups(name).remove()
        return remove_leftovers(tag=leftovers.tag) + [f"cgroup {name}" for name in groups]

    def __init__(self, run_id: str, run_dir: Path):
        super().__init__(run_id, run_dir)
        self.names = RunNames.for_run(run_id)
        self.subnet: ipaddress.IPv4Network | None = None
        self.groups: dict[int, cgroups.DeviceGroups] = {}  # by rank
        self.processes: list[LocalProcess] = []
        self.namespaces: list[str] = []  # created by this backend, switch first
        self.private_dir: Path | None = None  # the run secret's folder, outside the run dir

    def start(self, spec: DeviceSpec) -> list[Device]:
        self.cpu_plan = plan_cpus(spec.count, spec.all_cpus)
        self._check_host(spec)
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
        veth_into(Veth(switch, port, device, DEVICE_INTERFACE, address, bridge), WHO, DeviceError)
        cpuset, cpus = self.cpu_plan.cpusets[rank], spec.cpus_of(rank)
        quota = None if cpuset else min(cpus, self.cpu_plan.host_cores)
        self.groups[rank] = cgroups.DeviceGroups(name)  # kept for stop() from here on
        self.groups[rank].create(cpuset, quota, spec.memory_of(rank))
        return Device(
            rank=rank,
            name=name,
            address=str(address.ip),
            interface=DEVICE_INTERFACE,
            cpus=cpus,
            threads=self.cpu_plan.threads[rank],
            cpuset=cpuset,
            netns_path=device,
        )

    def spawn(self, device: Device, argv: Sequence[str]) -> Process:
        if device.name not in self.namespaces:
            raise DeviceError(f"{device.name} is not a running device of run {self.run_id}")
        popen = start_group(
            in_netns(netns_path(device.name), argv),
            device.name,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=python_env(OMP_NUM_THREADS=str(device.threads)),
            preexec_fn=self.groups[device.rank].join,
        )
        process = LocalProcess(popen, device.name)
        self.processes.append(process)
        return process

    def pause(self, device: Device) -> None:
        self.groups[device.rank].freeze()

    def resume(self, device: Device) -> None:
        self.groups[device.rank].thaw()

    def out_of_memory(self, device: Device) -> bool:
        groups = self.groups.get(device.rank)
        return groups is not None and groups.oom_kills() > 0

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            try:
                process.wait(KILL_WAIT_S)
            except TimeoutError:
                log.warning("%s (pid %d) survived SIGKILL", process.label, process.pid)
        self.processes = []
        for groups in self.groups.values():
            groups.remove()
        self.groups = {}
        remove_namespaces(self.namespaces)
        self.namespaces = []
        if self.private_dir is not None:
            log.debug("rm -r %s", self.private_dir)
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir, self.secret_files = None, {}
