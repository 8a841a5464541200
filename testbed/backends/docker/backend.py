"""Devices as Docker containers on one internal bridge network per run.

Every container and network is labelled `testbed.run=<run id>` so that `testbed.clean` can
find what a crashed run left (`testbed.backends.docker.labelled`). Containers get a memory
limit, and either pinned cores (`cpuset_cpus`) or a CPU quota (`nano_cpus`).

Least privilege, decided as follows:
- No capabilities at all (`cap_drop: ALL`, `no-new-privileges`, never privileged). Links are
  shaped from the host: `testbed.kernel.netlink` enters the container's network namespace
  (`/proc/<pid>/ns/net`) with pyroute2, and `nsenter` for ethtool and `tc -s`; the rate probe
  and the workers only open TCP sockets on unprivileged ports. So no process in a container
  needs NET_ADMIN, and none has it.
- The worker runs as the image's non-root user `worker` (WORKER_UID, devices/Dockerfile).
  When the orchestrator is not root it cannot hand folders to that uid, and the containers
  run as the orchestrator's own uid and gid instead (non-root either way).
- A pids limit (PIDS_LIMIT) bounds processes and threads: a worker is one process whose
  threads are torch's pools (one per host core at most) and its senders.
- The run directory is mounted read-only at /run-dir (specs, bundles and inputs go in). Each
  device writes only its own output folder, a host folder of the run's private folder
  (`tempfile.mkdtemp`, mode 0700, outside the run directory) mounted read-write at /out;
  `output_path` maps a session's rank folder there and `collect` copies what the worker wrote
  back into the run directory (as the orchestrator's files), then empties it.
- The run secret (`testbed.backends.base`) is the private folder's `run.key`, mode 0400 and
  owned by the worker's uid (0600 and ours when the containers run as us), mounted read-only
  at DEVICE_SECRET_FILE; never in the run directory. `stop()` removes the private folder with
  the containers; a killed orchestrator leaves it in the temporary folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

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
from testbed.backends.docker import labelled
from testbed.backends.docker.labelled import LABEL
from testbed.errors import DeviceError
from testbed.kernel.names import run_tag

log = logging.getLogger(__name__)

NAME_PREFIX = "testbed-"
# where a container's memory cgroup counts its OOM kills (cgroup v1; v2 with the systemd or
# the cgroupfs driver)
CGROUP_MEMORY_EVENTS = (
    "/sys/fs/cgroup/memory/docker/{id}/memory.oom_control",
    "/sys/fs/cgroup/system.slice/docker-{id}.scope/memory.events",
    "/sys/fs/cgroup/docker/{id}/memory.events",
)
DEVICE_RUN_DIR = "/run-dir"  # the run directory, read-only
DEVICE_OUT_DIR = "/out"  # the device's own output folder, read-write
DEVICE_SECRET_FILE = "/run/testbed/run.key"
WORKER_UID = 10001  # the image's `worker` user and group (devices/Dockerfile)
PIDS_LIMIT = 1024


def _client() -> Any:
    try:
        import docker

        client = docker.from_env()
        client.ping()
        return client
    except Exception as error:  # noqa: BLE001 - the SDK raises many kinds for "no engine"
        raise DeviceError(
            f"no Docker engine answers ({error}); start one with `make docker-up` or use "
            "--backend local"
        ) from error


def engine_available() -> bool:
    """True when a Docker engine answers (used by the `auto` backend choice)."""
    try:
        _client().close()
    except DeviceError:
        return False
    return True


class DockerProcess(Process):
    """A `docker exec` running in a thread of ours; killed through its host pid."""

    def __init__(self, api: Any, exec_id: str, label: str):
        self.api, self.exec_id = api, exec_id
        super().__init__(label)

    def _collect(self) -> None:
        try:
            stdout, stderr = self.api.exec_start(self.exec_id, demux=True)
            code = self.api.exec_inspect(self.exec_id)["ExitCode"]
            self.result = ExecResult(
                code,
                (stdout or b"").decode(errors="replace"),
                (stderr or b"").decode(errors="replace"),
            )
        except Exception as error:  # noqa: BLE001 - reported as the command's failure
            self.result = ExecResult(-1, "", f"docker exec failed: {error}")

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        try:
            pid = self.api.exec_inspect(self.exec_id).get("Pid", 0)
            if pid and self.thread.is_alive():
                os.kill(pid, sig)
        except (ProcessLookupError, Exception):  # noqa: BLE001 - already gone
            pass


class DockerBackend(Backend):
    name = "docker"
    python = "python"  # the image's venv is first on PATH
    in_auto = True

    @classmethod
    def available(cls) -> bool:
        return engine_available()

    @classmethod
    def versions(cls) -> dict[str, str]:
        from testbed.backends.docker.engine import server_version

        return {"docker": server_version()}

    @classmethod
    def leftovers(cls, run_dirs: Mapping[str, Path]) -> list[Leftovers]:
        """Containers and networks labelled by a run, when an engine answers."""
        if not engine_available():
            return []
        client = _client()
        try:
            found = labelled.by_run(client).items()
        finally:
            client.close()
        return [Leftovers(run_tag(run_id), run_id, tuple(items)) for run_id, items in found]

    @classmethod
    def remove(cls, leftovers: Leftovers) -> list[str]:
        client = _client()
        try:
            return labelled.remove(client, leftovers.run_id)
        finally:
            client.close()

    def __init__(self, run_id: str, run_dir: Path, image: str | None = None):
        super().__init__(run_id, run_dir)
        self.image = image
        self.client: Any = None
        self.network: Any = None
        self.containers: list[Any] = []
        self.private_dir: Path | None = None  # outputs and the secret, outside the run dir
        # who runs in the containers: the image's worker, or (not root) the orchestrator
        self.user = (WORKER_UID, WORKER_UID) if os.geteuid() == 0 else (os.geteuid(), os.getegid())

    @property
    def labels(self) -> dict[str, str]:
        return {LABEL: self.run_id}

    def prepare(self) -> None:
        if self.image is None:
            # the worker image must run this checkout's code: (re)build it, seconds when cached
            from testbed.backends.docker.image import build_image

            self.image = build_image()

    def start(self, spec: DeviceSpec) -> list[Device]:
        self.client = _client()
        self.prepare()
        try:
            self.client.images.get(self.image)
        except Exception as error:  # noqa: BLE001 - ImageNotFound and API errors alike
            raise DeviceError(f"worker image {self.image} is not present") from error
        self.run_dir.mkdir(parents=True, exist_ok=True)
        name = f"{NAME_PREFIX}{self.run_id}"
        log.debug("docker network create --internal %s", name)
        self.network = self.client.networks.create(
            name, driver="bridge", internal=True, labels=self.labels
        )
        self.cpu_plan = plan_cpus(spec.count, spec.all_cpus)
        try:
            self._make_private_dir(spec.count)
            self.devices = [self._start_device(rank, spec) for rank in range(spec.count)]
        except BaseException:
            self.stop()
            raise
        return self.devices

    def _make_private_dir(self, count: int) -> None:
        """The run secret and one output folder per device, owned by the containers' user."""
        self.private_dir = Path(tempfile.mkdtemp(prefix=f"{NAME_PREFIX}{self.run_id}-"))
        owner = self.user if self.user != (os.geteuid(), os.getegid()) else None
        write_secret(self.private_dir / SECRET_FILE_NAME, self.secret, owner)
        for rank in range(count):
            out = self._host_out(rank)
            out.mkdir()
            if owner is not None:
                os.chown(out, *owner)
        log.debug("private folder %s (secret, outputs) for uid %d", self.private_dir, self.user[0])
        self.secret_files = dict.fromkeys(range(count), DEVICE_SECRET_FILE)

    def _host_out(self, rank: int) -> Path:
        assert self.private_dir is not None
        return self.private_dir / f"d{rank}"

    def _start_device(self, rank: int, spec: DeviceSpec) -> Device:
        assert self.cpu_plan is not None
        cpuset = self.cpu_plan.cpusets[rank]
        # a device asking for more CPUs than the host has (`oversubscribe: true`) gets all of
        # them: Docker refuses a quota above the host's cores
        quota_cpus = min(spec.cpus_of(rank), self.cpu_plan.host_cores)
        limits: dict[str, Any] = (
            {"cpuset_cpus": cpuset} if cpuset else {"nano_cpus": int(quota_cpus * 1e9)}
        )
        name = f"{NAME_PREFIX}{self.run_id}-d{rank}"
        assert self.private_dir is not None
        volumes = {
            str(self.run_dir): {"bind": DEVICE_RUN_DIR, "mode": "ro"},
            str(self._host_out(rank)): {"bind": DEVICE_OUT_DIR, "mode": "rw"},
            str(self.private_dir / SECRET_FILE_NAME): {"bind": DEVICE_SECRET_FILE, "mode": "ro"},
        }
        user = f"{self.user[0]}:{self.user[1]}"
        log.debug(
            "docker run %s (%s, user %s, no capabilities, %d MB, %d pids, %s, %s)",
            name,
            self.image,
            user,
            spec.memory_of(rank),
            PIDS_LIMIT,
            limits,
            volumes,
        )
        container = self.client.containers.run(
            self.image,
            ["sleep", "infinity"],
            name=name,
            hostname=f"d{rank}",
            detach=True,
            network=self.network.name,
            user=user,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            pids_limit=PIDS_LIMIT,
            labels=self.labels,
            mem_limit=f"{spec.memory_of(rank)}m",
            volumes=volumes,
            environment={"OMP_NUM_THREADS": str(self.cpu_plan.threads[rank])},
            **limits,
        )
        self.containers.append(container)
        container.reload()
        network = container.attrs["NetworkSettings"]["Networks"][self.network.name]
        pid = container.attrs["State"]["Pid"]
        return Device(
            rank=rank,
            name=name,
            address=network["IPAddress"],
            interface="eth0",
            cpus=spec.cpus_of(rank),
            threads=self.cpu_plan.threads[rank],
            cpuset=cpuset,
            netns_path=f"/proc/{pid}/ns/net",
        )

    def device_path(self, host_path: Path) -> str:
        relative = Path(host_path).resolve().relative_to(self.run_dir)
        return str(PurePosixPath(DEVICE_RUN_DIR) / relative)

    def output_path(self, device: Device, host_path: Path) -> str:
        """The run-directory folder's place in the device's own output folder."""
        relative = Path(host_path).resolve().relative_to(self.run_dir)
        return str(PurePosixPath(DEVICE_OUT_DIR) / relative)

    def live_output(self, device: Device, host_path: Path) -> Path | None:
        """The device's own output folder on the host (the private folder's), read while
        the worker runs."""
        relative = Path(host_path).resolve().relative_to(self.run_dir)
        return self._host_out(device.rank) / relative

    def pause(self, device: Device) -> None:
        log.debug("docker pause %s", device.name)
        self.client.api.pause(device.name)

    def resume(self, device: Device) -> None:
        log.debug("docker unpause %s", device.name)
        self.client.api.unpause(device.name)

    def collect(self, device: Device, host_path: Path) -> None:
        """Copies what the device wrote for `host_path` there (files owned by us), then
        removes the device's copy."""
        relative = Path(host_path).resolve().relative_to(self.run_dir)
        written = self._host_out(device.rank) / relative
        if not written.is_dir():
            log.debug("%s: nothing to collect at %s", device.name, written)
            return
        log.debug("cp -r %s %s", written, host_path)
        shutil.copytree(written, host_path, dirs_exist_ok=True)
        shutil.rmtree(written)

    def spawn(self, device: Device, argv: Sequence[str]) -> Process:
        log.debug("docker exec %s %s", device.name, list(argv))
        exec_id = self.client.api.exec_create(device.name, list(argv))["Id"]
        return DockerProcess(self.client.api, exec_id, device.name)

    def gone(self, device: Device) -> str | None:
        """Why the device's container no longer runs (its exit status, and whether the
        kernel killed it for memory), or None while it does."""
        try:
            state = self.client.containers.get(device.name).attrs["State"]
        except Exception as error:  # noqa: BLE001 - NotFound and API errors alike
            if _gone(error):
                return f"its container {device.name} was removed"
            return f"the Docker engine does not answer ({type(error).__name__})"
        if state.get("Running"):
            return None
        code = state.get("ExitCode")
        why = " (SIGKILL)" if code == 137 else ""
        if state.get("OOMKilled"):
            why = " (out of memory: the device's memory_mb)"
        return f"its container {device.name} exited with status {code}{why}"

    def out_of_memory(self, device: Device) -> bool:
        """The container's memory cgroup counted an OOM kill (cgroup v1's memory.oom_control,
        v2's memory.events), or the engine says the container died of it."""
        try:
            container = self.client.containers.get(device.name)
        except Exception:  # noqa: BLE001 - gone, or the engine does not answer
            return False
        if container.attrs["State"].get("OOMKilled"):
            return True
        for path in CGROUP_MEMORY_EVENTS:
            try:
                text = Path(path.format(id=container.id)).read_text()
            except OSError:
                continue
            counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
            return int(counts.get("oom_kill", "0")) > 0
        return False

    def logs(self, device: Device) -> str:
        return self.client.containers.get(device.name).logs().decode(errors="replace")

    def stop(self) -> None:
        """Removes the run's containers and network; what the engine could not remove (it
        is down: restarted mid-run) is named in one warning with the command that removes
        it once the engine is back."""
        kept = []
        for container in self.containers:
            log.debug("docker rm -f %s", container.name)
            try:
                container.remove(force=True)
            except Exception as error:  # noqa: BLE001 - already gone is fine
                log.debug("removing %s: %s", container.name, error)
                if not _gone(error):
                    kept.append(container.name)
        self.containers = []
        if self.network is not None:
            log.debug("docker network rm %s", self.network.name)
            try:
                self.network.remove()
            except Exception as error:  # noqa: BLE001
                log.debug("removing network: %s", error)
                if not _gone(error):
                    kept.append(f"network {self.network.name}")
            self.network = None
        if kept:
            log.warning(
                "the Docker engine did not remove %s (is it running?): `python -m testbed.clean "
                "--run %s` removes them once it answers",
                ", ".join(kept),
                self.run_id,
            )
        if self.private_dir is not None:
            log.debug("rm -r %s", self.private_dir)
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir, self.secret_files = None, {}
        if self.client is not None:
            self.client.close()
            self.client = None


def _gone(error: Exception) -> bool:
    """Whether a removal failed because the object is already gone (404), not because the
    engine did not answer."""
    return getattr(getattr(error, "response", None), "status_code", None) == 404
