"""The top-level docker-compose.yml runs to completion: two CPU-limited devices, each shaping
its own egress to 10 Mbit/s, a short session of the demo model, records in a mounted folder,
written by the image's unprivileged `worker` user (the services drop root after shaping)."""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from devices.records import read_records
from testbed.backends.docker.backend import WORKER_UID
from tests.conftest import REQUIRE_DOCKER, require_or_skip

ROOT = Path(__file__).resolve().parents[2]


def compose(project: str, out: Path, *args: str, timeout: float = 300):
    command = [
        "docker-compose",
        "--project-name",
        project,
        "--file",
        str(ROOT / "docker-compose.yml"),
    ]
    return subprocess.run(
        [*command, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "TESTBED_COMPOSE_OUT": str(out)},
    )


@pytest.mark.docker
@pytest.mark.slow
def test_docker_compose_up_runs_both_devices_to_the_end_on_a_shaped_link(tmp_path, worker_image):
    require_or_skip(
        shutil.which("docker-compose") is not None,
        "docker-compose is not installed (apt-get install docker-compose)",
        REQUIRE_DOCKER,
    )
    project = f"tbtest{secrets.token_hex(3)}"
    try:
        up = compose(project, tmp_path, "up", "--no-color")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        states = compose(project, tmp_path, "ps").stdout
    finally:
        compose(project, tmp_path, "down", "--volumes")
    for service in ("codebooks", "d0", "d1"):
        assert f"{project}_{service}_1" in states and "Exit 0" in states.split(service, 1)[1]
    records = [read_records(tmp_path / f"d{rank}") for rank in (0, 1)]
    for device in records:
        runs = sorted((i.run, i.inference) for i in device.inferences)
        assert runs == sorted((run, i) for run in ("voltage", "trace-b") for i in range(5))
    assert (tmp_path / "d0" / "logits" / "trace-b.npy").is_file()
    # the workers and the fit ran as `worker`, not as the root that shaped the link
    written = [tmp_path / "codebooks" / "bundle-K16.pt"]
    written += [
        tmp_path / f"d{rank}" / name
        for rank in (0, 1)
        for name in ("records.jsonl", "session.json")
    ]
    assert {path.stat().st_uid for path in written} == {WORKER_UID}
    # each device's egress went through its 10 Mbit/s token bucket, its messages with it
    for rank, device in enumerate(records):
        qdisc = (tmp_path / f"d{rank}" / "qdisc.txt").read_text()
        assert re.search(r"qdisc tbf \S+ root .*rate 10Mbit burst 302\db", qdisc), qdisc
        sent = int(re.search(r"Sent (\d+) bytes", qdisc).group(1))
        assert sent >= sum(b.message_bytes for b in device.blocks) > 0
