"""Devices on real boards over SSH (paramiko): the backend connects, checks, deploys, runs.

The backend creates no devices: the inventory (`testbed.inventory`) lists the boards, and the
first P of them, in order, are ranks 0..P-1. `start()` goes through them phase by phase, so
that a cheap failure (an unknown host key, a refused key, a board that does not answer) comes
before any slow work, and every error names its board:

1. connect: host keys checked against the inventory's known_hosts file, never auto-accepted
   unless `accept_new_host_keys` says so; key authentication only.
2. check: the board's Python and what the worker imports (torch against the project's pin),
   iproute2's `tc`, and `sudo -n` when the user is not root (shaping needs it).
3. deploy: a source archive of tracevq/, devices/, testbed/ and pyproject.toml, uploaded over
   SFTP into `<workdir>/code/<digest>/` unless that digest is already there; the run's files
   the workers read (bundles) into `<workdir>/runs/<run id>/`, each skipped when the board's
   copy has the same SHA-256. Then the deployed worker must import (`tracevq`, `devices`).
4. clock: each board's monotonic clock against ours by ping-pong over one SSH channel; the
   offsets (and between boards) go to `ssh-boards.json` in the run directory.

Commands are argument lists; each is quoted (`shlex`) into the one shell line SSH carries.
Every command that `spawn` starts runs under a small Python launcher on the board that makes
its own process group, reports its pid, and kills the group when its SSH channel closes, so a
lost controller leaves no worker behind; `kill` sends SIGKILL to the group. Workers run in
the board's run directory: `device_path` gives paths relative to it, and `collect` copies a
worker's output folder back. Shaping renders `testbed.shaping`'s plan as `tc` commands (with
`sudo -n` when not root); `stop` kills what runs, removes the qdiscs, restores the interface's
offload settings and deletes the run directory, on every board, on success, error and Ctrl-C.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import logging
import os
import posixpath
import re
import select
import shlex
import stat
import tarfile
import threading
import time
import tomllib
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed import shaping
from testbed.backends.base import Backend, CpuPlan, Device, DeviceSpec, ExecResult, Process
from testbed.errors import ConfigError, DeviceError, ShapingError, TestbedError
from testbed.inventory import Board, Inventory

log = logging.getLogger(__name__)

SOURCE_ROOT = Path(__file__).resolve().parents[2]
DEPLOYED = ("tracevq", "devices", "testbed", "pyproject.toml")
EXTRA_PATH = "/usr/sbin:/sbin"  # tc, ip and ethtool live there; a user's PATH may lack it
CHECK_TIMEOUT_S = 60.0
KILL_WAIT_S = 5.0
CLOCK_ROUNDS = 8
CHUNK_BYTES = 1 << 16
WORKER_MODULES = {"torch": "torch", "numpy": "numpy", "yaml": "pyyaml", "pydantic": "pydantic"}
DEPLOYED_MODULES = ("torch", "tracevq", "devices.worker", "devices.probe")
OFFLOADS = {"generic-segmentation-offload": "gso", "tcp-segmentation-offload": "tso",
            "generic-receive-offload": "gro"}  # fmt: skip
PROBES = {  # as testbed.shaping probes them
    "tbf": ["root", "handle", "1:", "tbf", "rate", "1mbit", "burst", "8000", "limit", "16000"],
    "htb": ["root", "handle", "1:", "htb", "default", "0"],
    "netem": ["root", "handle", "1:", "netem", "delay", "1ms"],
    "ingress": ["ingress"],
}
SUDO_REFUSED = re.compile(  # sudo's own refusals (with -n), not the failures of what it runs
    r"sudo: a (password|terminal) is required|is not allowed to (execute|run sudo)"
    r"|is not in the sudoers file|sudo: (command )?not found"
)

# Runs `argv` in a process group of its own (pid == pgid, printed first), and kills that group
# when stdin reaches EOF, which happens when the SSH channel closes.
LAUNCHER = """
import os, signal, subprocess, sys, threading
try:
    os.setsid()
except OSError:
    pass
print(os.getpid(), flush=True)
try:
    child = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
except OSError as error:
    print(f"{sys.argv[1]}: {error.strerror}", file=sys.stderr)
    sys.exit(127)
def orphaned():
    while os.read(0, 4096):
        pass
    os.killpg(0, signal.SIGKILL)
threading.Thread(target=orphaned, daemon=True).start()
code = child.wait()
os._exit(code if code >= 0 else 128 - code)
"""
CHECK = """
import json, os, platform, subprocess, sys
from importlib import util
def run(*argv):
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
        return [done.returncode, done.stdout.decode(errors="replace").strip()]
    except (OSError, subprocess.SubprocessError) as error:
        return [127, str(error)]
def version(distribution):
    try:
        from importlib import metadata
        return metadata.version(distribution)
    except Exception:
        return ""
uid = os.getuid()
print(json.dumps({
    "python": platform.python_version(), "executable": sys.executable, "uid": uid,
    "machine": platform.machine(), "kernel": platform.release(),
    "cores": len(os.sched_getaffinity(0)),
    "modules": {m: version(d) for m, d in json.loads(sys.argv[1]).items() if util.find_spec(m)},
    "tc": run("tc", "-V"), "ethtool": run("ethtool", "--version"),
    "sudo": {tool: run("sudo", "-n", "-l", tool) for tool in ("tc", "ip")} if uid else {},
}))
"""
VERIFY = """
import importlib, json, sys
found, missing = {}, {}
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
        found[name] = [str(getattr(module, "__version__", "")), module.__file__]
    except Exception as error:
        missing[name] = f"{type(error).__name__}: {error}"
print(json.dumps({"modules": found, "missing": missing}))
"""
BATCH = """
import json, subprocess, sys
results = []
for argv in json.loads(sys.argv[1]):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        results.append([done.returncode, done.stdout, done.stderr])
    except (OSError, subprocess.SubprocessError) as error:
        results.append([127, "", f"{argv[0]}: {error}"])
print(json.dumps(results))
"""
HASHES = """
import hashlib, json, sys
def digest(path):
    try:
        with open(path, "rb") as stream:
            return hashlib.file_digest(stream, "sha256").hexdigest()
    except OSError:
        return None
print(json.dumps({path: digest(path) for path in sys.argv[1:]}))
"""
INSTALL = """
import os, shutil, sys, tarfile, tempfile
archive, target, digest = sys.argv[1:4]
marker = os.path.join(target, "DIGEST")
if os.path.isdir(target) and not (os.path.isfile(marker) and open(marker).read() == digest):
    shutil.rmtree(target)
staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(target))
with tarfile.open(archive) as tar:
    tar.extractall(staging, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
with open(os.path.join(staging, "DIGEST"), "w") as stream:
    stream.write(digest)
try:
    os.rename(staging, target)
except OSError:  # another run installed the same code meanwhile
    shutil.rmtree(staging)
os.remove(archive)
"""
CLOCK = """
import sys, time
for line in sys.stdin:
    print(repr(time.perf_counter()), flush=True)
"""
KILL_GROUP = """
import os, signal, sys
try:
    os.killpg(int(sys.argv[1]), signal.SIGKILL)
except ProcessLookupError:
    pass
"""
REMOVE_TREE = "import shutil, sys; shutil.rmtree(sys.argv[1], ignore_errors=True)"


# Pure helpers (unit-tested) ---------------------------------------------------------------


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


def sudo_refused(stderr: str) -> bool:
    """Whether a command failed because `sudo -n` would not run it (not because of tc)."""
    return bool(SUDO_REFUSED.search(stderr))


def uploads_needed(local: Mapping[str, str], remote: Mapping[str, str | None]) -> list[str]:
    """Names whose board copy is missing or differs (by SHA-256) from ours, in our order."""
    return [name for name, digest in local.items() if remote.get(name) != digest]


def code_is_current(marker: str | None, digest: str) -> bool:
    """Whether a deployed code directory's DIGEST file says it holds this archive."""
    return marker is not None and marker.strip() == digest


def source_files(root: Path = SOURCE_ROOT) -> list[Path]:
    """The files of the deployed project, sorted, without byte-code caches."""
    files = []
    for name in DEPLOYED:
        path = root / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for candidate in candidates:
            parts = candidate.relative_to(root).parts
            if candidate.is_file() and "__pycache__" not in parts and candidate.suffix != ".pyc":
                files.append(candidate)
    return files


def source_archive(root: Path = SOURCE_ROOT) -> tuple[bytes, str]:
    """A reproducible .tar.gz of the project (same files, same bytes) and its SHA-256."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped:
        with tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in source_files(root):
                data = path.read_bytes()
                info = tarfile.TarInfo(path.relative_to(root).as_posix())
                info.size, info.mtime = len(data), 0
                info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
                tar.addfile(info, io.BytesIO(data))
    archive = buffer.getvalue()
    return archive, hashlib.sha256(archive).hexdigest()


def project_requirements(root: Path = SOURCE_ROOT) -> tuple[tuple[int, int], str | None]:
    """(lowest Python, torch's pinned version or None) from pyproject.toml."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    match = re.search(r">=\s*(\d+)\.(\d+)", project.get("requires-python", ""))
    python = (int(match[1]), int(match[2])) if match else (3, 0)
    pins = [d.split("==", 1)[1] for d in project["dependencies"] if d.startswith("torch==")]
    return python, (pins[0].strip() if pins else None)


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


def _connect(session: BoardSession, inventory: Inventory) -> None:
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
            board.address, port=board.port, username=board.user, key_filename=key_file,
            allow_agent=key_file is None, look_for_keys=key_file is None, timeout=timeout,
            banner_timeout=timeout, auth_timeout=timeout,
        )  # fmt: skip
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
        log.warning("adding the host key of %s (%s) to %s", hostname, described,
                    self.inventory.known_hosts)  # fmt: skip
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


# The backend ----------------------------------------------------------------------------


class SshBackend(Backend):
    name = "ssh"
    python = "python3"  # as argv[0] of a command, it stands for each board's own interpreter

    def __init__(self, run_id: str, run_dir: Path, inventory: Inventory | None):
        super().__init__(run_id, run_dir)
        if inventory is None:
            raise ConfigError(
                "the ssh backend needs an inventory of boards: add `inventory: boards.yaml` "
                "(or an inline mapping) to the experiment"
            )
        self.inventory = inventory
        self.sessions: list[BoardSession] = []
        self.processes: list[SshProcess] = []
        self.shaped: set[int] = set()
        self.archive: tuple[bytes, str] | None = None
        self.local_digests: dict[Path, tuple[int, int, str]] = {}
        self.run_name = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)

    def start(self, spec: DeviceSpec) -> list[Device]:
        boards = self.inventory.boards
        if spec.count > len(boards):
            raise ConfigError(
                f"the experiment asks for {spec.count} devices; the inventory lists "
                f"{len(boards)} boards ({', '.join(b.name for b in boards)})"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log.info("ssh backend: boards keep their own memory (%d MB not enforced)", spec.memory_mb)
        self.sessions = [BoardSession(rank, boards[rank]) for rank in range(spec.count)]
        try:
            self._each(lambda session: _connect(session, self.inventory))
            self._each(self._check)
            self.archive = self.archive or source_archive()
            self._each(self._deploy)
            self._sync_run_files(sorted(p for p in self.run_dir.glob("bundles/*") if p.is_file()))
            self._each(self._clock)
            self.devices = [self._device(session, spec) for session in self.sessions]
            self._write_facts()
        except BaseException:  # also Ctrl-C: leave nothing behind on any board
            self.stop()
            raise
        return self.devices

    def _each(self, action: Callable[[BoardSession], None]) -> None:
        """Runs `action` on every board at once; one DeviceError naming every board that
        failed (rank order), or the first other exception as it is."""
        with ThreadPoolExecutor(len(self.sessions), thread_name_prefix="board") as pool:
            futures = [pool.submit(action, session) for session in self.sessions]
        errors = [error for future in futures if (error := future.exception()) is not None]
        for error in errors:
            if not isinstance(error, TestbedError):
                raise error
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise DeviceError("; ".join(str(error) for error in errors))

    def _device(self, session: BoardSession, spec: DeviceSpec) -> Device:
        board, cores = session.board, session.facts["cores"]
        cpus = board.cpus or spec.cpus
        threads = max(1, int(cpus))
        if threads > cores:
            log.warning("%s: %d threads on %d cores", board.label, threads, cores)
        self.cpu_plan = CpuPlan(
            [s.board.cpuset for s in self.sessions],
            oversubscribed=bool(self.cpu_plan and self.cpu_plan.oversubscribed) or threads > cores,
            host_cores=min(s.facts["cores"] for s in self.sessions),
            threads=threads,
        )
        return Device(
            rank=session.rank, name=board.name, address=board.peer_address,
            interface=board.interface, cpus=cpus, threads=threads, cpuset=board.cpuset,
        )  # fmt: skip

    # checks and deployment

    def _check(self, session: BoardSession) -> None:
        """The board's Python, what the worker imports, tc, and sudo when not root."""
        board = session.board
        python_min, torch_pin = project_requirements()
        result = session.execute([board.python, "-c", CHECK, json.dumps(WORKER_MODULES)])
        if not result.ok:
            raise DeviceError(
                f"{board.label}: python '{board.python}' does not run there ({result.tail(1)}); "
                f"set boards[{session.rank}].python in the inventory to an interpreter with torch"
            )
        facts = session.facts = json.loads(result.stdout.strip().splitlines()[-1])
        if tuple(int(part) for part in facts["python"].split(".")[:2]) < python_min:
            raise DeviceError(
                f"{board.label}: {board.python} is Python {facts['python']}; the worker needs "
                f"Python >= {'.'.join(map(str, python_min))}"
            )
        missing = [WORKER_MODULES[m] for m in WORKER_MODULES if m not in facts["modules"]]
        if missing:
            wanted = [f"torch=={torch_pin}" if name == "torch" else name for name in missing]
            raise DeviceError(
                f"{board.label}: {board.python} (Python {facts['python']}) lacks "
                f"{', '.join(missing)}, which the worker needs: pip install {' '.join(wanted)}"
            )
        torch_version = facts["modules"]["torch"]
        if torch_pin and torch_version.split("+")[0] != torch_pin:
            log.warning("%s has torch %s, the project pins %s: logits may differ",
                        board.label, torch_version, torch_pin)  # fmt: skip
        self._check_tools(session)

    def _check_tools(self, session: BoardSession) -> None:
        board, facts = session.board, session.facts
        if facts["tc"][0] != 0:
            raise DeviceError(f"{board.label}: iproute2's `tc` is missing ({facts['tc'][1]})")
        if facts["ethtool"][0] != 0:
            log.warning("%s: no ethtool: offloads stay on when shaping", board.label)
        for tool, (code, output) in facts["sudo"].items():
            if code != 0:
                raise DeviceError(
                    f"{board.label}: user {board.user} may not run `sudo -n {tool}` "
                    f"({output or 'refused'}); " + _sudo_advice(board)
                )

    def _deploy(self, session: BoardSession) -> None:
        """The project's code (unless that digest is there) and the per-run directory."""
        board = session.board
        home = session.sftp.normalize(".")
        workdir = home + board.workdir[1:] if board.workdir.startswith("~") else board.workdir
        session.workdir = posixpath.normpath(posixpath.join(home, workdir))
        assert self.archive is not None
        archive, digest = self.archive
        session.code_dir = posixpath.join(session.workdir, "code", digest[:16])
        session.run_dir = posixpath.join(session.workdir, "runs", self.run_name)
        session.makedirs(session.run_dir)
        if code_is_current(session.read_text(posixpath.join(session.code_dir, "DIGEST")), digest):
            log.debug("%s: code %s already there", board.name, digest[:16])
        else:
            upload = f"{session.code_dir}-{uuid.uuid4().hex[:8]}.tar.gz"
            session.put(archive, upload)
            session.uploaded.append(f"code/{digest[:16]}")
            install = [board.python, "-c", INSTALL, upload, session.code_dir, digest]
            result = session.execute(install)
            if not result.ok:
                raise DeviceError(f"{board.label}: unpacking the code failed: {result.tail(3)}")
        found = session.python_json(VERIFY, *DEPLOYED_MODULES, env=self._env(session))
        if found["missing"]:
            raise DeviceError(
                f"{board.label}: the deployed worker does not import with {board.python}: "
                + "; ".join(found["missing"].values())
            )
        session.facts.update(code_digest=digest, imports=found["modules"])

    def _env(self, session: BoardSession, threads: int | None = None) -> dict[str, str]:
        env = {"PYTHONPATH": session.code_dir}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        return env

    def _local_digest(self, path: Path) -> str:
        info = path.stat()
        known = self.local_digests.get(path)
        if known is None or known[:2] != (info.st_mtime_ns, info.st_size):
            with open(path, "rb") as stream:
                digest = hashlib.file_digest(stream, "sha256").hexdigest()
            known = self.local_digests[path] = (info.st_mtime_ns, info.st_size, digest)
        return known[2]

    def _sync_run_files(self, paths: Sequence[Path]) -> None:
        """Copies run-directory files to every board, skipping copies with our SHA-256."""
        local = {self.device_path_of(p): self._local_digest(p) for p in paths}
        for session in self.sessions:
            unknown = {n: d for n, d in local.items() if session.present.get(n) != d}
            if not unknown:
                continue
            remote_paths = [posixpath.join(session.run_dir, n) for n in unknown]
            digests = session.python_json(HASHES, *remote_paths)
            remote = {n: digests[r] for n, r in zip(unknown, remote_paths, strict=True)}
            for name in uploads_needed(unknown, remote):
                session.put(self.run_dir / name, posixpath.join(session.run_dir, name))
                session.uploaded.append(name)
            session.present.update(unknown)

    def _clock(self, session: BoardSession) -> None:
        """The board's perf_counter minus ours, from the round trip with the smallest RTT."""
        channel = session.open(shell_line([session.board.python, "-u", "-c", CLOCK]))
        stream = channel.makefile("rb")
        best_rtt, offset = float("inf"), 0.0
        try:
            channel.settimeout(CHECK_TIMEOUT_S)
            for _ in range(CLOCK_ROUNDS):
                sent = time.perf_counter()
                channel.sendall(b"\n")
                theirs = float(stream.readline())
                back = time.perf_counter()
                if back - sent < best_rtt:
                    best_rtt, offset = back - sent, theirs - (sent + back) / 2
        except (OSError, ValueError) as error:
            raise DeviceError(f"{session.board.label}: clock ping-pong failed: {error}") from None
        finally:
            channel.close()
        session.facts.update(clock_offset_s=offset, clock_uncertainty_s=best_rtt / 2)

    @property
    def clock_offsets_s(self) -> dict[int, float]:
        """Each board's monotonic clock minus rank 0's (give or take both uncertainties)."""
        base = self.sessions[0].facts["clock_offset_s"]
        return {s.rank: s.facts["clock_offset_s"] - base for s in self.sessions}

    def _write_facts(self) -> None:
        facts = {
            "clock_offsets_s": self.clock_offsets_s,
            "boards": [
                {"rank": s.rank, "name": s.board.name, "address": s.board.address,
                 "run_dir": s.run_dir, "uploaded": s.uploaded, **s.facts}
                for s in self.sessions
            ],
        }  # fmt: skip
        (self.run_dir / "ssh-boards.json").write_text(json.dumps(facts, indent=2, default=str))

    # running commands

    def device_path_of(self, host_path: Path) -> str:
        """A run-directory path relative to the run directory (as each board has it)."""
        try:
            relative = Path(host_path).resolve().relative_to(self.run_dir)
        except ValueError:
            raise DeviceError(
                f"{host_path} is not in the run directory {self.run_dir}: boards see only that"
            ) from None
        return relative.as_posix() or "."

    def device_path(self, host_path: Path) -> str:
        """Relative to the board's run directory, where commands run. A file is copied to
        every board first, unless a copy with the same SHA-256 is there."""
        path = Path(host_path)
        if path.is_file():
            self._sync_run_files([path])
        return self.device_path_of(path)

    def _session(self, device: Device) -> BoardSession:
        if not 0 <= device.rank < len(self.sessions) or self.sessions[device.rank].client is None:
            raise DeviceError(f"{device.name} is not a connected board of run {self.run_id}")
        return self.sessions[device.rank]

    def spawn(self, device: Device, argv: Sequence[str]) -> Process:
        session = self._session(device)
        argv = list(argv)
        if argv and argv[0] == self.python:
            argv[0] = session.board.python
        if device.cpuset:
            argv = ["taskset", "-c", device.cpuset, *argv]
        process = session.start(
            [session.board.python, "-c", LAUNCHER, *argv],
            launched=True,
            cwd=session.run_dir,
            env=self._env(session, device.threads),
        )
        self.processes.append(process)
        return process

    def collect(self, device: Device, host_path: Path) -> None:
        """Copies the board's copy of a run-directory folder back into `host_path`."""
        session = self._session(device)
        remote = posixpath.join(session.run_dir, self.device_path_of(host_path))
        try:
            count = session.get_tree(remote, Path(host_path))
        except FileNotFoundError:
            log.debug("%s: nothing to collect at %s", device.name, remote)
            return
        except OSError as error:
            raise DeviceError(f"{session.board.label}: copying {remote} failed: {error}") from None
        log.debug("%s: collected %d files of %s", device.name, count, remote)

    # shaping

    def _admin(self, session: BoardSession, commands: list[list[str]]) -> list[ExecResult]:
        """iproute2/ethtool commands as root (`sudo -n` when not root), in one round trip."""
        results = session.batch(commands, sudo=True)
        for argv, result in zip(commands, results, strict=True):
            if not result.ok and sudo_refused(result.stderr):
                raise ShapingError(
                    f"{session.board.label}: `sudo -n {shlex.join(argv)}` was refused "
                    f"({result.tail(1)}); " + _sudo_advice(session.board)
                )
        return results

    def qdisc_support(self) -> dict[str, bool]:
        """What every board's kernel can attach (a qdisc counts when all boards have it)."""
        for session in self.sessions:
            if session.support is None:
                session.support = self._probe_qdiscs(session)
        kinds = shaping.PROBED_QDISCS
        return {kind: all(s.support and s.support[kind] for s in self.sessions) for kind in kinds}

    def _probe_qdiscs(self, session: BoardSession) -> dict[str, bool]:
        """Each qdisc tried once on loopback of a throwaway network namespace on the board."""
        name = f"tbprobe-{uuid.uuid4().hex[:8]}"
        tc = ["tc", "-n", name, "qdisc"]
        commands = [["ip", "netns", "add", name]]
        for spec in PROBES.values():
            commands += [[*tc, "add", "dev", "lo", *spec], [*tc, "del", "dev", "lo", spec[0]]]
        results = self._admin(session, [*commands, ["ip", "netns", "del", name]])
        if not results[0].ok:
            raise ShapingError(
                f"{session.board.label}: cannot probe qdiscs (ip netns add): {results[0].tail(1)}"
            )
        found = {kind: results[1 + 2 * i].ok for i, kind in enumerate(PROBES)}
        log.info("%s: qdisc support %s", session.board.name, found)
        return found

    def shape(self, device: Device, plan: shaping.ShapingPlan) -> None:
        """The plan as `tc` commands on the board, after gso_max_segs 1 and offloads off."""
        session = self._session(device)
        shaping.check_support(plan, self.qdisc_support())
        interface = device.interface
        if session.link_settings is None:
            session.link_settings = self._link_settings(session, interface)
        self.shaped.add(device.rank)
        commands = [shaping.gso_argv(interface), shaping.offload_argv(interface)]
        commands += [shaping.clear_argv(interface), *shaping.tc_argv(interface, plan)]
        results = self._admin(session, commands)
        if not results[1].ok:
            log.warning("%s: offloads left on: %s", session.board.label, results[1].tail(1))
        must = [0, *range(3, len(commands))]  # [1] offloads may fail; [2] clears, maybe nothing
        for argv, result in ((commands[i], results[i]) for i in must):
            if not result.ok:
                self._admin(session, [shaping.clear_argv(interface)])  # no half-shaped link
                raise ShapingError(
                    f"{session.board.label}: `{shlex.join(argv)}` failed: {result.tail(2)}"
                )

    def _link_settings(self, session: BoardSession, interface: str) -> dict[str, Any]:
        """The interface's gso_max_segs and offloads, which `stop` restores."""
        shown, features = session.batch(
            [["ip", "-d", "-j", "link", "show", "dev", interface], ["ethtool", "-k", interface]]
        )
        if not shown.ok:
            raise ShapingError(f"{session.board.label}: no interface {interface}: {shown.tail(1)}")
        settings: dict[str, Any] = {"gso_max_segs": json.loads(shown.stdout)[0]["gso_max_segs"]}
        for line in features.stdout.splitlines() if features.ok else []:
            key, _, value = line.partition(":")
            if key.strip() in OFFLOADS and "[fixed]" not in value:
                settings[OFFLOADS[key.strip()]] = value.split()[0]
        return settings

    def qdisc_stats(self, device: Device) -> str:
        session = self._session(device)
        result = session.execute(["tc", "-s", "qdisc", "show", "dev", device.interface])
        if not result.ok:
            raise ShapingError(f"{session.board.label}: reading qdisc statistics: {result.tail(1)}")
        return result.stdout

    def _unshape(self, session: BoardSession) -> None:
        """Removes the root qdisc; puts gso_max_segs and offloads back as they were."""
        interface, settings = session.board.interface, session.link_settings or {}
        commands = [shaping.clear_argv(interface)]
        if "gso_max_segs" in settings:
            segments = str(settings["gso_max_segs"])
            commands.append(["ip", "link", "set", "dev", interface, "gso_max_segs", segments])
        offloads = [word for key in OFFLOADS.values() if key in settings
                    for word in (key, settings[key])]  # fmt: skip
        if offloads:
            commands.append(["ethtool", "-K", interface, *offloads])
        for argv, result in zip(commands, self._admin(session, commands), strict=True):
            if not result.ok and argv is not commands[0]:
                log.warning("%s: `%s` failed: %s", session.board.name, shlex.join(argv),
                            result.tail(1))  # fmt: skip

    # teardown

    def stop(self) -> None:
        for process in self.processes:
            _quietly(process.kill, f"killing {process.label}")
        self.processes = []
        for session in self.sessions:
            if session.client is not None:
                self._leave(session)
        self.shaped = set()

    def _leave(self, session: BoardSession) -> None:
        """Unshapes the board's link, removes the run directory, disconnects."""
        name = session.board.name
        if session.rank in self.shaped:
            _quietly(lambda: self._unshape(session), f"{name}: unshaping")
        if session.run_dir:
            remove = [session.board.python, "-c", REMOVE_TREE, session.run_dir]
            _quietly(lambda: session.execute(remove), f"{name}: removing {session.run_dir}")
        _quietly(session.client.close, f"{name}: closing the connection")
        session.client = session.sftp = None


def _quietly(action: Callable[[], Any], what: str) -> None:
    """Teardown goes on whatever one step raises; the failure is logged."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - teardown continues on every board
        log.warning("%s failed: %s", what, error)


def _sudo_advice(board: Board) -> str:
    return (
        f"let {board.user} run tc and ip without a password (sudoers: `{board.user} ALL=(root) "
        "NOPASSWD: /usr/sbin/tc, /usr/sbin/ip, /usr/sbin/ethtool`) or connect as root"
    )
