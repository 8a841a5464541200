"""One board's SSH session: connecting to it, commands on it, files over SFTP.

`connect` opens the connection with the board's host key checked against the inventory's
known_hosts file (never auto-accepted unless `accept_new_host_keys` says so) and key
authentication only; every refusal becomes a DeviceError that names the board and says what
to do. A `BoardSession` holds the connection and what the backend learnt on the board; it runs
commands (argument lists quoted into the one shell line SSH carries, see `shell_line`) as
`SshProcess`es, whose output a thread of ours reads, and copies files with SFTP.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import posixpath
import select
import shlex
import stat
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.backends.base import ExecResult, Process
from testbed.backends.ssh.inventory import Board, Inventory
from testbed.backends.ssh.scripts import BATCH, KILL_GROUP
from testbed.errors import DeviceError

log = logging.getLogger(__name__)

EXTRA_PATH = "/usr/sbin:/sbin"  # tc, ip and ethtool live there; a user's PATH may lack it
CHECK_TIMEOUT_S = 60.0
KILL_WAIT_S = 5.0
CHUNK_BYTES = 1 << 16


# Command lines and host keys (unit-tested) ----------------------------------------------


def with_sudo(argv: Sequence[str], sudo: bool) -> list[str]:
    """`argv`, run through `sudo -n` (never prompting) when the board's user is not root."""
    return ["sudo", "-n", *argv] if sudo else list(argv)


def shell_line(argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] = ()) -> str:
    """The one line SSH hands to the board's shell: `argv` quoted, sbin on PATH, in `cwd`."""
    line = f'export PATH="$PATH:{EXTRA_PATH}"; '
    if cwd is not None:
        line += f"cd {shlex.quote(cwd)} && "
    settings = [f"{key}={value}" for key, value in dict(env).items()]
    return line + "exec " + shlex.join((["env", *settings] if settings else []) + list(argv))


def host_key_advice(board: Board, known_hosts: str, changed: bool = False) -> str:
    """How to (re)record a board's host key, once its fingerprint has been checked."""
    scan = f"`ssh-keyscan -p {board.port} {board.address} >> {known_hosts}`"
    if not changed:
        return f"check its fingerprint, then add it with {scan} (or set accept_new_host_keys: true)"
    entry = board.address if board.port == 22 else f"[{board.address}]:{board.port}"
    forget = f"`ssh-keygen -R '{entry}' -f {known_hosts}`"
    return f"if that is expected, check the new fingerprint, then run {forget} and {scan}"


# Processes ------------------------------------------------------------------------------


class SshProcess(Process):
    """A command on a board's SSH channel; its output is read by a thread of ours.

    With `launched`, the first stdout line is the launcher's pid (= its process group).
    """

    def __init__(self, session: BoardSession, channel: Any, label: str, launched: bool):
        self.session, self.channel = session, channel
        self.pid: int | None = None
        self.pid_known = threading.Event()
        if not launched:
            self.pid_known.set()
        super().__init__(label)

    def _collect(self) -> None:
        out, err, channel = bytearray(), bytearray(), self.channel
        with contextlib.suppress(Exception):  # a lost connection ends the command
            while not (channel.closed or channel.eof_received) or channel.recv_ready():
                select.select([channel], [], [], 0.5)
                while channel.recv_ready():
                    out += channel.recv(CHUNK_BYTES)
                while channel.recv_stderr_ready():
                    err += channel.recv_stderr(CHUNK_BYTES)
                if not self.pid_known.is_set() and b"\n" in out:
                    line, _, rest = bytes(out).partition(b"\n")
                    self.pid = int(line) if line.strip().isdigit() else None
                    out = bytearray(rest)
                    self.pid_known.set()
            while channel.recv_stderr_ready():
                err += channel.recv_stderr(CHUNK_BYTES)
            channel.status_event.wait(KILL_WAIT_S)
        code = channel.exit_status if channel.status_event.is_set() else -1
        self.pid_known.set()
        self.result = ExecResult(code, out.decode(errors="replace"), err.decode(errors="replace"))
        channel.close()

    def kill(self) -> None:
        """SIGKILL to the command's process group on the board; closes the channel."""
        if not self.thread.is_alive():
            return
        self.pid_known.wait(KILL_WAIT_S)
        if self.pid is not None:
            log.debug("%s: kill -KILL -%d (%s)", self.session.board.name, self.pid, self.label)
            with contextlib.suppress(Exception):
                argv = [self.session.board.python, "-c", KILL_GROUP, str(self.pid)]
                self.session.execute(argv, timeout_s=KILL_WAIT_S)
        self.channel.close()  # the launcher kills its group on EOF, should the kill be lost
        self.thread.join(KILL_WAIT_S)


# One board ------------------------------------------------------------------------------


class _UnknownHostKey(Exception):
    pass


@dataclass
class BoardSession:
    """What the backend holds for one board: its connection and what it learnt there."""

    rank: int
    board: Board
    client: Any = None
    sftp: Any = None
    facts: dict[str, Any] = field(default_factory=dict)
    workdir: str = ""
    code_dir: str = ""
    run_dir: str = ""
    uploaded: list[str] = field(default_factory=list)  # what this backend copied there
    present: dict[str, str] = field(default_factory=dict)  # run files there: name -> digest
    support: dict[str, bool] | None = None
    link_settings: dict[str, Any] | None = None  # the interface's before the first shaping

    @property
    def sudo(self) -> bool:
        return self.facts.get("uid", 0) != 0

    def open(self, command: str) -> Any:
        log.debug("%s: ssh %s", self.board.name, command)
        channel = self.client.get_transport().open_session()
        channel.exec_command(command)
        return channel

    def start(self, argv: Sequence[str], launched: bool = False, **where: Any) -> SshProcess:
        return SshProcess(self, self.open(shell_line(argv, **where)), self.board.name, launched)

    def execute(self, argv: Sequence[str], timeout_s: float = CHECK_TIMEOUT_S, **where: Any):
        """Runs a short command to its end; DeviceError when it does not end in time."""
        process = self.start(argv, **where)
        try:
            return process.wait(timeout_s)
        except TimeoutError:
            process.channel.close()
            raise DeviceError(
                f"{self.board.label}: `{shlex.join(argv)[:120]}` did not end in {timeout_s:g} s"
            ) from None

    def python_json(self, script: str, *args: str, **where: Any) -> Any:
        """Runs a Python script of ours on the board; its last stdout line, as JSON."""
        result = self.execute([self.board.python, "-c", script, *args], **where)
        if not result.ok:
            raise DeviceError(f"{self.board.label}: {self.board.python} failed: {result.tail(3)}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    def batch(self, commands: Sequence[Sequence[str]], sudo: bool = False) -> list[ExecResult]:
        """Runs commands one after the other in one SSH round trip (each runs, whatever the
        others did); their results in order."""
        commands = [with_sudo(argv, sudo and self.sudo) for argv in commands]
        for argv in commands:
            log.debug("%s: %s", self.board.name, shlex.join(argv))
        if len(commands) == 1:  # no interpreter to start on the board (a rate change's path)
            return [self.execute(commands[0])]
        results = self.python_json(BATCH, json.dumps(commands))
        return [ExecResult(*result) for result in results]

    def read_text(self, path: str) -> str | None:
        try:
            with self.sftp.open(path) as stream:
                return stream.read().decode()
        except OSError:
            return None

    def makedirs(self, path: str) -> None:
        current = "/"
        for part in path.strip("/").split("/"):
            current = posixpath.join(current, part)
            try:
                self.sftp.stat(current)
            except OSError:
                self.sftp.mkdir(current)

    def put(self, data: bytes | Path, path: str) -> None:
        """Uploads to `path.part`, then renames: a reader never sees half a file."""
        log.debug("%s: sftp put %s", self.board.name, path)
        self.makedirs(posixpath.dirname(path))
        partial = f"{path}.part"
        if isinstance(data, bytes):
            self.sftp.putfo(io.BytesIO(data), partial)
        else:
            self.sftp.put(str(data), partial)
        self.sftp.posix_rename(partial, path)

    def get_tree(self, remote: str, local: Path) -> int:
        """Copies a remote folder's files into `local`; returns how many."""
        count = 0
        for entry in self.sftp.listdir_attr(remote):
            source, target = posixpath.join(remote, entry.filename), local / entry.filename
            if stat.S_ISDIR(entry.st_mode or 0):
                count += self.get_tree(source, target)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                self.sftp.get(source, str(target))
                count += 1
        return count


# Connecting -----------------------------------------------------------------------------


def connect(session: BoardSession, inventory: Inventory) -> None:
    """Opens the SSH connection and SFTP; DeviceError naming the board on any refusal."""
    import paramiko

    board, known_hosts = session.board, inventory.known_hosts
    client = paramiko.SSHClient()
    if Path(known_hosts).is_file():
        client.load_host_keys(known_hosts)
    elif not inventory.accept_new_host_keys:
        raise DeviceError(
            f"{board.label}: the known_hosts file {known_hosts} does not exist; "
            + host_key_advice(board, known_hosts)
        )
    client.set_missing_host_key_policy(_HostKeyPolicy(inventory))
    timeout = inventory.connect_timeout_s
    key_file = board.key_file
    if key_file is not None and not Path(key_file).is_file():
        raise DeviceError(f"{board.label}: key file {key_file} not found")
    log.debug("ssh %s@%s -p %d (key %s)", board.user, board.address, board.port, key_file)
    try:
        client.connect(
            board.address,
            port=board.port,
            username=board.user,
            key_filename=key_file,
            allow_agent=key_file is None,
            look_for_keys=key_file is None,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
        )
    except BaseException as error:
        client.close()
        if not isinstance(error, Exception):
            raise
        raise DeviceError(_connect_problem(board, known_hosts, error)) from error
    transport = client.get_transport()
    transport.set_keepalive(15)
    session.client, session.sftp = client, client.open_sftp()
    session.sftp.get_channel().settimeout(120)


def _connect_problem(board: Board, known_hosts: str, error: Exception) -> str:
    import paramiko

    if isinstance(error, _UnknownHostKey):
        advice = host_key_advice(board, known_hosts)
        return f"{board.label}: its host key ({error}) is not in {known_hosts}; {advice}"
    if isinstance(error, paramiko.BadHostKeyException):
        return (
            f"{board.label}: its host key has CHANGED since it was recorded in {known_hosts} "
            f"(now {_describe_key(error.key)}): the board was reinstalled, or another machine "
            "answers at its address; " + host_key_advice(board, known_hosts, changed=True)
        )
    if isinstance(error, paramiko.PasswordRequiredException):
        return (
            f"{board.label}: key file {board.key_file} is encrypted: load it into ssh-agent "
            "and leave key_file out (passphrases are never kept in files)"
        )
    if isinstance(error, paramiko.AuthenticationException):
        key = board.key_file or "ssh-agent / ~/.ssh keys"
        return (
            f"{board.label}: the board refused user {board.user} with key {key} ({error}); "
            f"authorize the key there (`ssh-copy-id -i KEY.pub -p {board.port} "
            f"{board.user}@{board.address}`), or correct the board's user and key_file"
        )
    if isinstance(error, paramiko.ssh_exception.NoValidConnectionsError):
        reasons = sorted(
            {os.strerror(e.errno) if e.errno else str(e) for e in error.errors.values()}
        )
        return f"{board.label}: does not answer on port {board.port} ({'; '.join(reasons)})"
    if isinstance(error, TimeoutError):
        return f"{board.label}: does not answer on port {board.port} (timed out)"
    return f"{board.label}: SSH connection failed: {type(error).__name__}: {error}"


class _HostKeyPolicy:  # a paramiko.MissingHostKeyPolicy (imported lazily)
    """Unknown host keys: refused, or (accept_new_host_keys) added to the known_hosts file."""

    def __init__(self, inventory: Inventory):
        self.inventory = inventory

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        described = _describe_key(key)
        if not self.inventory.accept_new_host_keys:
            raise _UnknownHostKey(described)
        log.warning(
            "adding the host key of %s (%s) to %s", hostname, described, self.inventory.known_hosts
        )
        client.get_host_keys().add(hostname, key.get_name(), key)
        path = Path(self.inventory.known_hosts)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as stream:
            stream.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def _describe_key(key: Any) -> str:
    """As OpenSSH shows a host key: `ssh-ed25519 SHA256:...`."""
    import base64

    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"
