"""SSH "boards" for what runs the backends that run on boards (ssh, enoslib): each board a
network namespace on this machine running Debian's sshd on its own address, joined by a bridge
(in a switch namespace) that the host reaches through a veth of its own. Their integration
tests (tests/integration/test_ssh_backend.py, test_enoslib_backend.py) and the benchmarks
`bench.scale` and `bench.board_channels` build them here.

The boards share this machine's file system, so each gets its own work directory: the code
and the run's files are really copied there, and workers run from that copy. Keys (host and
user) are generated per lab; known_hosts is filled with `ssh-keyscan`, as a user would.
Every sshd, namespace and veth is removed by `tear_down`, also when a test fails; whether
anything still runs on a board is read from /proc (processes in its namespace), not from the
code under test.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checks.errors import LabError
from testbed.backends.ssh.scripts import LAUNCHER
from testbed.kernel.addresses import choose_subnet, host_networks

SSHD = "/usr/sbin/sshd"
BOARD_INTERFACE = "lan0"  # no such interface on the host
SSHD_CONFIG = """\
ListenAddress {address}
Port 22
HostKey {host_key}
PidFile none
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxSessions 30
Subsystem sftp internal-sftp
"""


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=60)


def netns_pids(name: str) -> list[int]:
    """Processes whose network namespace is /var/run/netns/NAME."""
    try:
        target = os.stat(f"/var/run/netns/{name}")
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ns = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue
            if (ns.st_dev, ns.st_ino) == (target.st_dev, target.st_ino):
                pids.append(int(entry))
    return pids


@dataclass
class Lab:
    directory: Path
    tag: str
    addresses: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)  # switch first, then the boards
    sshd: list[subprocess.Popen] = field(default_factory=list)
    user_key: Path | None = None
    other_key: Path | None = None
    known_hosts: Path | None = None
    silent_address: str = ""  # in the boards' subnet, nobody there

    @property
    def host_link(self) -> str:
        return f"tbs{self.tag}h"

    def workdir(self, rank: int) -> Path:
        return self.directory / f"board-{rank}"

    def inventory(self, **changes: Any) -> dict[str, Any]:
        boards = [
            {
                "name": f"b{rank}",
                "address": address,
                "user": "root",
                "key_file": str(self.user_key),
                "python": sys.executable,
                "interface": BOARD_INTERFACE,
                "workdir": str(self.workdir(rank)),
            }
            for rank, address in enumerate(self.addresses)
        ]
        return {
            "known_hosts": str(self.known_hosts),
            "connect_timeout_s": 4,
            "boards": boards,
            **changes,
        }

    def leftovers(self) -> dict[str, list[str]]:
        """What runs on each board besides its sshd listener: `pid (parent pid) state: argv`
        per process (the launcher's argv shortened to its first line)."""
        found = {}
        for rank, name in enumerate(self.namespaces[1:]):
            daemon = self.sshd[rank].pid
            pids = [pid for pid in netns_pids(name) if pid != daemon]
            commands = []
            for pid in pids:
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                except (OSError, IndexError):
                    continue
                shown = argv.decode(errors="replace").replace(LAUNCHER, "LAUNCHER ")
                commands.append(f"{pid} ({stat[1]}) {stat[0]}: {shown}")
            if commands:
                found[f"b{rank}"] = commands
        return found

    def wait_until_clean(self, timeout_s: float = 10.0) -> dict[str, list[str]]:
        deadline = time.monotonic() + timeout_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left


def _keygen(path: Path) -> Path:
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path))
    return path


def _wait_for_port(address: str, port: int = 22, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def board_command(lab: Lab, argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own where root's ~/.bashrc is empty: a board has its
    own home, and this machine's may start tools (pyenv) in every shell that sshd runs, with
    locks that a test killing a board's processes would leave behind."""
    bashrc = Path.home() / ".bashrc"
    if not bashrc.exists():
        return argv
    empty = lab.directory / "bashrc"
    empty.write_text("")
    mount = f"mount --bind {shlex.quote(str(empty))} {shlex.quote(str(bashrc))}"
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'{mount} && exec "$@"',
        "board",
        *argv,
    ]


def build(lab: Lab, boards: int) -> None:
    subnet = choose_subnet(f"ssh-{lab.tag}", host_networks())
    switch = f"tbssh-{lab.tag}-sw"
    sh("ip", "netns", "add", switch)
    lab.namespaces.append(switch)
    sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", switch, "link", "set", "br0", "up")
    host_ip = f"{subnet[254]}/{subnet.prefixlen}"
    sh("ip", "link", "add", lab.host_link, "type", "veth", "peer", "name", "up0", "netns", switch)
    sh("ip", "-n", switch, "link", "set", "up0", "master", "br0", "up")
    sh("ip", "addr", "add", host_ip, "dev", lab.host_link)
    sh("ip", "link", "set", lab.host_link, "up")
    lab.silent_address = str(subnet[200])
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    lab.user_key, lab.other_key = _keygen(lab.directory / "user"), _keygen(lab.directory / "other")
    authorized = lab.directory / "authorized_keys"
    shutil.copyfile(f"{lab.user_key}.pub", authorized)
    for rank in range(boards):
        name, address = f"tbssh-{lab.tag}-b{rank}", str(subnet[rank + 1])
        sh("ip", "netns", "add", name)
        lab.namespaces.append(name)
        sh(
            "ip",
            "-n",
            switch,
            "link",
            "add",
            f"p{rank}",
            "type",
            "veth",
            "peer",
            "name",
            BOARD_INTERFACE,
            "netns",
            name,
        )
        sh("ip", "-n", switch, "link", "set", f"p{rank}", "master", "br0", "up")
        sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ip", "-n", name, "addr", "add", f"{address}/{subnet.prefixlen}", "dev", BOARD_INTERFACE)
        sh("ip", "-n", name, "link", "set", BOARD_INTERFACE, "up")
        config = lab.directory / f"sshd-{rank}.conf"
        config.write_text(
            SSHD_CONFIG.format(
                address=address,
                authorized_keys=authorized,
                host_key=_keygen(lab.directory / f"host-{rank}"),
            )
        )
        log = open(lab.directory / f"sshd-{rank}.log", "w")  # noqa: SIM115 - closed with sshd
        sshd = ["ip", "netns", "exec", name, SSHD, "-D", "-e", "-f", str(config)]
        lab.sshd.append(
            subprocess.Popen(
                board_command(lab, sshd),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        lab.addresses.append(address)
    for address in lab.addresses:
        _wait_for_port(address)
    lab.known_hosts = lab.directory / "known_hosts"
    for address in lab.addresses:  # as the error messages tell a user to do
        scanned = sh("ssh-keyscan", "-t", "ed25519", "-p", "22", address).stdout
        with open(lab.known_hosts, "a") as stream:
            stream.write(scanned)


def tear_down(lab: Lab) -> None:
    for process in lab.sshd:
        process.kill()
        process.wait(10)
    for name in lab.namespaces:
        for pid in netns_pids(name):
            os.kill(pid, signal.SIGKILL)
    for name in reversed(lab.namespaces):
        sh("ip", "netns", "del", name, check=False)
    sh("ip", "link", "del", lab.host_link, check=False)


@contextlib.contextmanager
def ssh_lab(directory: Path, boards: int) -> Iterator[Lab]:
    """A lab of `boards` SSH boards, removed (sshd, namespaces, veth) whatever happens."""
    if shutil.which(SSHD) is None or shutil.which("ssh-keygen") is None:
        raise LabError("SSH boards need Debian's openssh-server (apt-get install openssh-server)")
    lab = Lab(directory, uuid.uuid4().hex[:6])
    try:
        build(lab, boards)
        yield lab
    finally:
        tear_down(lab)
    assert not any(lab.tag in line for line in sh("ip", "netns", "list").stdout.splitlines())


def remote_run_dirs(lab: Lab) -> list[Path]:
    return [p for rank in range(len(lab.addresses)) for p in lab.workdir(rank).glob("runs/*")]


def board_qdiscs(lab: Lab) -> list[str]:
    return [
        sh("ip", "netns", "exec", name, "tc", "qdisc", "show", "dev", BOARD_INTERFACE).stdout
        for name in lab.namespaces[1:]
    ]
