"""The worker image: built from local sources only, runs torch, and can shape its own link.

Each test module run gets its own internal network and container, labelled with a run id,
and both are removed in fixture finalisers, also when a test fails.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from testbed.base_image import DEFAULT_BASE
from testbed.image import WORKER_TAG

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


def _exec(container: Any, *args: str) -> str:
    exit_code, output = container.exec_run(list(args))
    text = output.decode(errors="replace")
    assert exit_code == 0, f"{args} exited {exit_code}: {text}"
    return text


def test_image_is_built_on_the_local_base(docker_client: Any, worker_image: str) -> None:
    assert worker_image == WORKER_TAG
    labels = docker_client.images.get(worker_image).labels
    assert labels["org.opencontainers.image.base.name"] == DEFAULT_BASE
    base = docker_client.images.get(DEFAULT_BASE)
    assert base.attrs["RepoDigests"] == []  # made by docker import here, never pulled


def test_container_runs_pinned_torch(worker: Any) -> None:
    output = _exec(worker, "python", "-c", "import torch, yaml; print(torch.__version__)")
    assert output.strip().split("+")[0] == "2.13.0"


def test_container_shapes_its_link_with_tbf(worker: Any) -> None:
    _exec(worker, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
          "rate", f"{TBF_RATE_MBIT}mbit", "burst", "32kbit", "latency", "50ms")  # fmt: skip
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
