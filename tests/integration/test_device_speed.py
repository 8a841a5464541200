"""A device's speed for real: two devices, one at full speed and one at half, measured with the
GEMM probe (`python -m devices.gemm`, ViT-B/16's products, one block about 15-20 ms here) while
both compute at once, in containers and in namespaces.

Half speed must mean every block taking twice as long: the ratio of the two rates is within
10% of 0.5, the slow device's median block within 10% of twice the fast one's, and its p95
at most 1.3 times its median (a CPU quota at Docker's 100 ms period gives 5.9: docs/devices.md).
"""

from __future__ import annotations

import json
import statistics
import uuid
from pathlib import Path

import pytest

from testbed.backends.base import Backend, DeviceSpec
from testbed.kernel.netns import remove_leftovers

PROBE_S = 3.0
TIMEOUT_S = 120.0


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1]


def probe_both(backend: Backend) -> tuple[dict, dict]:
    """The probe at speed 1 on device 0 and 0.5 on device 1, run at the same time."""
    fast, slow = backend.devices
    argv = [backend.python, "-m", "devices.gemm", "--model", "vit-b16", "--blocks"]
    argv += ["--seconds", str(PROBE_S)]
    processes = [
        backend.spawn(fast, [*argv, "--speed", "1"]),
        backend.spawn(slow, [*argv, "--speed", "0.5"]),
    ]
    found = []
    for process in processes:
        result = process.wait(TIMEOUT_S)
        assert result.ok, result.tail()
        found.append(json.loads(result.stdout))
    return found[0], found[1]


def check_half_speed(fast: dict, slow: dict) -> None:
    ratio = slow["gflops"] / fast["gflops"]
    spread = p95(slow["times_ms"]) / slow["block_ms"]
    figures = (
        f"rates {fast['gflops']:.1f} and {slow['gflops']:.1f} GFLOP/s (ratio {ratio:.3f}); "
        f"blocks {fast['block_ms']:.2f} and {slow['block_ms']:.2f} ms; slow p95/median {spread:.2f}"
    )
    print(figures)
    assert 0.45 <= ratio <= 0.55, figures
    assert slow["block_ms"] == pytest.approx(2 * fast["block_ms"], rel=0.1), figures
    assert spread <= 1.3, figures


@pytest.mark.netns
@pytest.mark.slow
def test_half_speed_on_the_local_backend(root: None, tmp_path: Path) -> None:
    from testbed.backends.local import LocalBackend

    backend = LocalBackend(uuid.uuid4().hex, tmp_path / "run")
    try:
        backend.start(DeviceSpec(count=2, cpus=1, memory_mb=1024))
        check_half_speed(*probe_both(backend))
    finally:
        backend.stop()
        remove_leftovers(backend.run_id)


@pytest.mark.docker
@pytest.mark.slow
def test_half_speed_in_containers(worker_image: str, tmp_path: Path) -> None:
    from testbed.backends.docker.backend import DockerBackend

    run_id = f"speed-{uuid.uuid4().hex[:8]}"
    with DockerBackend(run_id, tmp_path / "run", image=worker_image) as backend:
        backend.start(DeviceSpec(count=2, cpus=1, memory_mb=1024))
        check_half_speed(*probe_both(backend))
