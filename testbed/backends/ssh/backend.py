"""Devices on real boards over SSH (paramiko): the backend connects, checks, deploys, runs.

The backend creates no devices: the inventory (`testbed.backends.ssh.inventory`) lists the
boards, and the first P of them, in order, are ranks 0..P-1. `start()` goes through them phase by
phase, so that a cheap failure (an unknown host key, a refused key, a board that does not answer)
comes before any slow work, and every error names its board:

1. connect: host keys checked against the inventory's known_hosts file, never auto-accepted
   unless `accept_new_host_keys` says so; key authentication only.
2. check: the board's Python and what the worker imports (torch against the project's pin),
   iproute2's `tc`, and `sudo -n` when the user is not root (shaping needs it).
3. deploy: a source archive of tracevq/, devices/, testbed/ and pyproject.toml, uploaded over
   SFTP into `<workdir>/code/<digest>/` unless that digest is already there; the run's files
   the workers read (bundles) into `<workdir>/runs/<run id>/`, each skipped when the board's
   copy has the same SHA-256. Then the deployed worker must import (`tracevq`, `devices`).
   The run secret (`testbed.backends.base`) goes over SFTP into `run.key` of the board's run
   directory, a file made mode 0600 before the secret is written to it; specs name it by that
   relative path. `collect` copies rank folders only, so it never comes back into results,
   and `stop` removes it with the board's run directory.
4. clock: each board's monotonic clock against ours by ping-pong over one SSH channel; the
   offsets (and between boards) go to `ssh-boards.json` in the run directory.

Commands are argument lists; each is quoted (`shlex`) into the one shell line SSH carries.
Every command that `spawn` starts runs under a small Python launcher on the board that makes
its own process group, reports its pid, and kills the group when its SSH channel closes, so a
lost controller leaves no worker behind; `kill` sends SIGKILL to the group. Workers run in
the board's run directory: `device_path` gives paths relative to it, and `collect` copies a
worker's output folder back. Its traffic control (`traffic_control`) renders
`testbed.kernel.shaping`'s plan as `tc` commands (with `sudo -n` when not root); `stop` kills
what runs, removes the qdiscs, restores the interface's offload settings and deletes the run
directory, on every board, on success, error and Ctrl-C.

The pieces live in sibling modules: `session` (connecting with host keys checked, commands
and SFTP on one board), `checks` (phase 2), `files` (the source archive and which files a
board lacks), `scripts` (the Python programs run on a board), `shaping` (tc, ip and ethtool as
root, and what unshaping restores) and `traffic_control` (the plan as tc commands on each
board, which the run's links use).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import posixpath
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from testbed.backends.base import (
    SECRET_FILE_NAME,
    Backend,
    CpuPlan,
    Device,
    DeviceSpec,
    Leftovers,
    Process,
)
from testbed.backends.ssh import leftovers
from testbed.backends.ssh.checks import check_board
from testbed.backends.ssh.files import code_is_current, source_archive, uploads_needed
from testbed.backends.ssh.inventory import Inventory
from testbed.backends.ssh.refusal import inventory_refusal
from testbed.backends.ssh.scripts import CLOCK, HASHES, INSTALL, LAUNCHER, REMOVE_TREE, VERIFY
from testbed.backends.ssh.session import (
    CHECK_TIMEOUT_S,
    BoardSession,
    SshProcess,
    connect,
    shell_line,
)
from testbed.backends.ssh.shaping import unshape
from testbed.backends.ssh.traffic_control import BoardTrafficControl
from testbed.errors import ConfigError, DeviceError, TestbedError
from testbed.experiment.resolved_fleet import worker_threads

if TYPE_CHECKING:
    from testbed.experiment.schema import Experiment

log = logging.getLogger(__name__)

CLOCK_ROUNDS = 8
DEPLOYED_MODULES = ("torch", "tracevq", "devices.worker", "devices.probe")


# The backend ----------------------------------------------------------------------------


class SshBackend(Backend):
    name = "ssh"
    python = "python3"  # as argv[0] of a command, it stands for each board's own interpreter
    on_this_host = False
    default_emulator = "tbf"  # the boards' own links, shaped on their uplinks
    shapes_downlinks = False
    settings = Inventory.section

    @classmethod
    def create(cls, run_id: str, run_dir: Path, experiment: Experiment) -> SshBackend:
        return cls(run_id, run_dir, experiment.section(cls.settings))

    @classmethod
    def section_refusal(cls, experiment: Experiment) -> str | None:
        """Its inventory's rules (`testbed.backends.ssh.refusal`)."""
        return inventory_refusal(experiment)

    @classmethod
    def leftovers(cls, run_dirs: Mapping[str, Path]) -> list[Leftovers]:
        """Runs whose boards may keep what they changed: those whose run directory holds the
        record (`testbed.backends.ssh.leftovers`), one item each, the record's path."""
        return leftovers.recorded(run_dirs)

    @classmethod
    def remove(cls, found: Leftovers) -> list[str]:
        """Connects to the record's boards and undoes what it says (TestbedError naming the
        boards not reached, whose record then stays)."""
        return leftovers.undo(Path(found.items[0]))

    def __init__(self, run_id: str, run_dir: Path, inventory: Inventory | None):
        super().__init__(run_id, run_dir)
        if inventory is None and self.settings == Inventory.section:  # a subclass fills it
            raise ConfigError(
                "the ssh backend needs an inventory of boards: add `inventory: boards.yaml` "
                "(or an inline mapping) to the experiment"
            )
        self.inventory = inventory
        self.sessions: list[BoardSession] = []
        self.processes: list[SshProcess] = []
        self.archive: tuple[bytes, str] | None = None
        self.local_digests: dict[Path, tuple[int, int, str]] = {}
        self.run_name = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)
        self.record_lock = threading.Lock()  # board-leftovers.json

    def start(self, spec: DeviceSpec) -> list[Device]:
        boards = self.inventory.boards
        if spec.count > len(boards):
            raise ConfigError(
                f"the experiment asks for {spec.count} devices; the inventory lists "
                f"{len(boards)} boards ({', '.join(b.name for b in boards)})"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log.info(
            "ssh backend: boards keep their own memory (%d MB not enforced)", spec.memory_of(0)
        )
        self.sessions = [BoardSession(rank, boards[rank]) for rank in range(spec.count)]
        try:
            self._each(lambda session: connect(session, self.inventory))
            self._each(check_board)
            self.archive = self.archive or source_archive()
            self._each(self._locate)
            leftovers.write(self.run_dir, self.inventory, self.sessions)  # before any change
            self._each(self._deploy)
            self._each(self._deliver_secret)
            self._sync_run_files(sorted(p for p in self.run_dir.glob("bundles/*") if p.is_file()))
            self._each(self._clock)
            self.devices = [self._device(session, spec) for session in self.sessions]
            self._write_facts()
        except BaseException:  # also Ctrl-C: leave nothing behind on any board
            self.stop()
            raise
        return self.devices

    def for_each(self, devices: Sequence[Device], action: Callable[[Device], None]) -> None:
        """`action` on every board at once (a rate change on 10 boards in turn took 0.36 s)."""
        self._each(lambda session: action(devices[session.rank]), self.sessions[: len(devices)])

    def _each(
        self,
        action: Callable[[BoardSession], None],
        sessions: Sequence[BoardSession] | None = None,
    ) -> None:
        """Runs `action` on every board (of `sessions`) at once; one error naming every board
        that failed (rank order: a DeviceError, or the first error's own kind when it is the
        only one), or the first error that is no TestbedError as it is."""
        sessions = self.sessions if sessions is None else sessions
        if not sessions:  # nothing to do (a change that no board's plan needs)
            return
        with ThreadPoolExecutor(len(sessions), thread_name_prefix="board") as pool:
            futures = [pool.submit(action, session) for session in sessions]
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
        cpus = board.cpus or spec.cpus_of(session.rank)
        threads = worker_threads(cpus)
        if threads > cores:
            log.warning("%s: %d threads on %d cores", board.label, threads, cores)
        self.cpu_plan = CpuPlan(
            [s.board.cpuset for s in self.sessions],
            oversubscribed=bool(self.cpu_plan and self.cpu_plan.oversubscribed) or threads > cores,
            host_cores=min(s.facts["cores"] for s in self.sessions),
            threads=[worker_threads(s.board.cpus or spec.cpus_of(s.rank)) for s in self.sessions],
        )
        return Device(
            rank=session.rank,
            name=board.name,
            address=board.peer_address,
            interface=board.interface,
            cpus=cpus,
            threads=threads,
            cpuset=board.cpuset,
        )

    # deployment

    def _locate(self, session: BoardSession) -> None:
        """Where the code and the run's directory go on the board (nothing made yet)."""
        board = session.board
        home = session.sftp.normalize(".")
        workdir = home + board.workdir[1:] if board.workdir.startswith("~") else board.workdir
        session.workdir = posixpath.normpath(posixpath.join(home, workdir))
        assert self.archive is not None
        session.code_dir = posixpath.join(session.workdir, "code", self.archive[1][:16])
        session.run_dir = posixpath.join(session.workdir, "runs", self.run_name)

    def _deploy(self, session: BoardSession) -> None:
        """The project's code (unless that digest is there) and the per-run directory."""
        board = session.board
        assert self.archive is not None
        archive, digest = self.archive
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

    def _deliver_secret(self, session: BoardSession) -> None:
        path = posixpath.join(session.run_dir, SECRET_FILE_NAME)
        log.debug("%s: sftp put %s (mode 0600)", session.board.name, path)
        with session.sftp.open(path, "wb") as stream:
            stream.chmod(0o600)  # before a byte of the secret is in it
            stream.write(self.secret.hex().encode() + b"\n")
        self.secret_files[session.rank] = SECRET_FILE_NAME  # workers run in the run directory

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
                {
                    "rank": s.rank,
                    "name": s.board.name,
                    "address": s.board.address,
                    "run_dir": s.run_dir,
                    "uploaded": s.uploaded,
                    **s.facts,
                }
                for s in self.sessions
            ],
        }
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

    def session_of(self, device: Device) -> BoardSession:
        if not 0 <= device.rank < len(self.sessions) or self.sessions[device.rank].client is None:
            raise DeviceError(f"{device.name} is not a connected board of run {self.run_id}")
        return self.sessions[device.rank]

    def spawn(self, device: Device, argv: Sequence[str]) -> Process:
        session = self.session_of(device)
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
        session = self.session_of(device)
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

    @functools.cached_property
    def traffic_control(self) -> BoardTrafficControl:
        """`tc` over SSH on each board (`testbed.backends.ssh.traffic_control`)."""
        return BoardTrafficControl(self)

    # teardown

    def stop(self) -> None:
        for process in self.processes:
            _quietly(process.kill, f"killing {process.label}")
        self.processes = []
        left = [self._leave(session) for session in self.sessions if session.client is not None]
        if all(left):
            leftovers.forget(self.run_dir)
        else:
            log.warning(
                "some boards were not left as they were (above); once they answer: "
                "python -m testbed.clean --boards %s",
                self.run_dir,
            )

    def _leave(self, session: BoardSession) -> bool:
        """Unshapes the board's link, removes the run directory, disconnects; whether all of
        it was done (else board-leftovers.json stays for testbed.clean)."""
        name = session.board.name
        done = True
        if session.link_settings is not None:
            done &= _quietly(lambda: unshape(session), f"{name}: unshaping")
        if session.run_dir:
            remove = [session.board.python, "-c", REMOVE_TREE, session.run_dir]
            done &= _quietly(lambda: session.execute(remove), f"{name}: removing {session.run_dir}")
        _quietly(session.client.close, f"{name}: closing the connection")
        session.client = session.sftp = None
        return done


def _quietly(action: Callable[[], Any], what: str) -> bool:
    """Teardown goes on whatever one step raises; the failure is logged (False)."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - teardown continues on every board
        log.warning("%s failed: %s", what, error)
        return False
    return True
