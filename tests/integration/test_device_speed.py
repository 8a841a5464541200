"""A device's speed for real: two devices, one at full speed and one at half, measured with the
GEMM probe (`python -m devices.gemm`, ViT-B/16's products, one block about 15-20 ms here) while
both compute at once, in containers and in namespaces.

Half speed must mean every block taking twice as long, not the same mean with holes in it.
The figures that say how well it does are a benchmark's (`python -m bench.bench_speed`; on a
quiet host, docs/devices.md: this test's ratio 0.483-0.486, slow median block 2.06-2.07 times
the fast one's, p95/median 1.12-1.14). This VM's neighbours take its cores now and then, and a
core that idles between stretches computes the next one slower (its caches come back cold:
5-25% here, more while its neighbour computes), so this test holds what dilation gives on a
busy host too: the ratio 0.3-0.6, the median block 1.6-3 times the fast one's, p95/median
under 2.5 (a CPU quota at Docker's 100 ms period gives 3.7-5.9: most blocks at full speed).
"""

from __future__ import annotations

import json
import statistics
import uuid
from pathlib import Path

import pytest

from testbed.backends.base import Backend, DeviceSpec
from testbed.kernel.netns import remove_leftovers

PROBE_S = 5.0
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
    floor = p95(fast["times_ms"]) / fast["block_ms"]
    figures = (
        f"rates {fast['gflops']:.1f} and {slow['gflops']:.1f} GFLOP/s (ratio {ratio:.3f}); "
        f"blocks {fast['block_ms']:.2f} and {slow['block_ms']:.2f} ms; p95/median "
        f"{floor:.2f} and {spread:.2f}"
    )
    print(figures)
    assert 0.3 <= ratio <= 0.6, figures
    assert 1.6 <= slow["block_ms"] / fast["block_ms"] <= 3.0, figures
    assert spread < 2.5, figures


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
