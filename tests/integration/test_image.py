"""The worker image: built from local sources only, runs torch as an unprivileged user, can
shape its own link when root asks (the compose demo), and the docker backend's containers run
with least privilege.

Each test module run gets its own internal network and container, labelled with a run id,
and both are removed in fixture finalisers, also when a test fails.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from testbed.backends.base import DeviceSpec
from testbed.backends.docker.backend import (
    DEVICE_SECRET_FILE,
    PIDS_LIMIT,
    WORKER_UID,
    DockerBackend,
)
from testbed.backends.docker.base_image import default_suite, named_base_runtime
from testbed.backends.docker.image import WORKER_TAG

pytestmark = [pytest.mark.docker, pytest.mark.slow]

RUN_LABEL = "testbed.run"
CONTAINER_MEM_LIMIT = "1g"
TBF_RATE_MBIT = 10


@pytest.fixture(scope="module")
def run_id() -> str:
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def internal_network(docker_client: Any, run_id: str) -> Iterator[Any]:
    network = docker_client.networks.create(
        f"testbed-{run_id[:12]}", driver="bridge", internal=True, labels={RUN_LABEL: run_id}
    )
    try:
        yield network
    finally:
        _remove_run(docker_client, run_id)


def _remove_run(client: Any, run_id: str) -> None:
    """Removes every container and network labelled with this run id."""
    label = f"{RUN_LABEL}={run_id}"
    for container in client.containers.list(all=True, filters={"label": label}):
        container.remove(force=True)
    for network in client.networks.list(filters={"label": label}):
        network.remove()


@pytest.fixture(scope="module")
def worker(docker_client: Any, worker_image: str, internal_network: Any, run_id: str) -> Any:
    container = docker_client.containers.run(
        worker_image,
        command=["sleep", "infinity"],
        name=f"testbed-{run_id[:12]}-dev0",
        detach=True,
        network=internal_network.name,
        cap_add=["NET_ADMIN"],
        nano_cpus=int(1e9),
        mem_limit=CONTAINER_MEM_LIMIT,
        labels={RUN_LABEL: run_id},
    )
    return container  # removed by internal_network's finaliser, with everything of the run


def _exec(container: Any, *args: str, user: str = "") -> str:
    exit_code, output = container.exec_run(list(args), user=user)
    text = output.decode(errors="replace")
    assert exit_code == 0, f"{args} exited {exit_code}: {text}"
    return text


def test_image_is_built_on_the_local_base(docker_client: Any, worker_image: str) -> None:
    assert worker_image == WORKER_TAG
    labels = docker_client.images.get(worker_image).labels
    suite = default_suite()  # the host's own: bookworm on this project's machines
    assert labels["org.opencontainers.image.base.name"] == suite.tag
    base = docker_client.images.get(suite.tag)
    assert base.attrs["RepoDigests"] == []  # made by docker import here, never pulled


def test_the_base_has_the_python_its_suite_gives_the_wheelhouse(worker_image: str) -> None:
    """What a named base is asked, asked of the local one: the table and the image agree."""
    suite = default_suite()
    assert named_base_runtime(suite.tag) == (suite.python, suite.glibc_minor)


def test_container_runs_pinned_torch(worker: Any) -> None:
    output = _exec(worker, "python", "-c", "import torch, yaml; print(torch.__version__)")
    assert output.strip().split("+")[0] == "2.13.0"


def test_the_image_runs_as_the_unprivileged_worker_with_setpriv_at_hand(worker: Any) -> None:
    assert _exec(worker, "id", "-un").strip() == "worker"
    assert _exec(worker, "id", "-u").strip() == str(WORKER_UID)
    # what compose/as-worker.sh drops privileges with
    assert _exec(worker, "setpriv", "--version").startswith("setpriv from util-linux")


def test_container_shapes_its_link_with_tbf(worker: Any) -> None:
    """As root (the compose demo's devices shape their own link before dropping to worker)."""
    _exec(
        worker,
        "tc",
        "qdisc",
        "replace",
        "dev",
        "eth0",
        "root",
        "tbf",
        "rate",
        f"{TBF_RATE_MBIT}mbit",
        "burst",
        "32kbit",
        "latency",
        "50ms",
        user="root",
    )
    shown = _exec(worker, "tc", "qdisc", "show", "dev", "eth0")
    match = re.search(r"qdisc tbf \S+ root .*?rate (\d+)Mbit", shown)
    assert match is not None, shown
    assert int(match.group(1)) == TBF_RATE_MBIT


def test_run_network_is_internal(worker: Any, internal_network: Any, run_id: str) -> None:
    internal_network.reload()
    assert internal_network.attrs["Internal"] is True
    assert internal_network.attrs["Labels"] == {RUN_LABEL: run_id}
    worker.reload()
    assert set(worker.attrs["NetworkSettings"]["Networks"]) == {internal_network.name}


def test_backend_devices_run_unprivileged_on_a_read_only_run_directory(
    docker_client: Any, worker_image: str, tmp_path: Any
) -> None:
    """The docker backend's container: the worker user, no capability, a pids limit, the run
    directory read-only, its own output folder writable, the run secret readable there only."""
    run_dir = tmp_path / "run"
    (run_dir / "bundles").mkdir(parents=True)
    (run_dir / "bundles" / "b.pt").write_text("bundle")
    with DockerBackend(f"privtest-{uuid.uuid4().hex[:8]}", run_dir, image=worker_image) as backend:
        (device,) = backend.start(DeviceSpec(count=1, cpus=1, memory_mb=512))
        host = docker_client.containers.get(device.name).attrs["HostConfig"]
        assert host["CapDrop"] == ["ALL"] and not host["CapAdd"] and not host["Privileged"]
        assert host["PidsLimit"] == PIDS_LIMIT
        assert backend.run(device, ["id", "-u"]).stdout.strip() == str(WORKER_UID)
        status = backend.run(device, ["grep", "^Cap", "/proc/self/status"]).stdout
        assert all(line.split()[1] == "0" * 16 for line in status.splitlines()), status
        bundle = backend.device_path(run_dir / "bundles" / "b.pt")
        assert backend.run(device, ["cat", bundle]).stdout == "bundle"
        refused = backend.run(device, ["touch", backend.device_path(run_dir / "x")])
        assert not refused.ok and "Read-only file system" in refused.stderr
        out = run_dir / "sessions" / "s" / "rank0"
        out.mkdir(parents=True)
        folder = backend.output_path(device, out)
        assert backend.run(device, ["mkdir", "-p", f"{folder}/logits"]).ok
        assert backend.run(device, ["touch", f"{folder}/logits/t.npy"]).ok
        assert backend.secret_files == {0: DEVICE_SECRET_FILE}
        key = backend.run(device, ["cat", DEVICE_SECRET_FILE]).stdout.strip()
        assert key == backend.secret.hex()
        backend.collect(device, out)
        assert (out / "logits" / "t.npy").stat().st_uid == os.geteuid()  # copied: ours
        private = backend.private_dir
    assert private is not None and not private.exists()
    assert not any(backend.secret.hex() in p.read_text() for p in run_dir.rglob("*") if p.is_file())
