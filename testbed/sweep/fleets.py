"""The devices of a run as the experiment's `devices` and `timeline` make them: what each device
count starts with, how fast each device is, and what a session's devices are told.

- `device_spec`: each device's CPUs and memory for a device count
  (testbed.experiment.resolved_fleet).
- `measure_devices`: the GEMM probe (`python -m devices.gemm`, at full speed) on every device
  once they have started, one after another so that they do not share the host's cores while
  measured: each device's own rate (the rows' `device_gflops` is it times the speed in force,
  and `by_speed` partitions by it). Boards over SSH are measured the same way.
- `session_fleet`: a session's partition (with the measured rates), every device's speed at
  its start and the timeline to play.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from testbed import voice
from testbed.backends.base import Backend, Device, DeviceSpec
from testbed.errors import ConfigError, DeviceError
from testbed.experiment.resolved_fleet import (
    Fleet,
    fleet_variant_keys,
    needs_host_rate,
    resolve_fleet,
    resources,
    worker_threads,
)
from testbed.experiment.schema import Experiment
from testbed.sweep.host_rate import host_core_gflops
from testbed.sweep.plan import Trial, trial_fleet
from testbed.sweep.session_timeline import SessionTimeline
from testbed.sweep.sessions import SessionFleet
from tracevq.config import model_config

log = logging.getLogger(__name__)

PROBE_SECONDS = 0.5
PROBE_TIMEOUT_S = 300.0


def check_fleets(experiment: Experiment, source: str) -> float | None:
    """Every device count's fleets resolve (a rate faster than the host, a variant's profile
    that changes a device are refused); returns this host's core rate where a device's speed
    is a rate (measured once, cached), else None. ConfigError names `source`."""
    devices, model = experiment.devices, experiment.model.name
    try:
        needed = any(needs_host_rate(devices, count) for count in devices.count)
        host_gflops = host_core_gflops(model) if needed else None
        for count in devices.count:
            for key in fleet_variant_keys(devices):
                resolve_fleet(devices, count, key, host_gflops)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    return host_gflops


def device_spec(experiment: Experiment, count: int) -> DeviceSpec:
    """What `count` devices start with: each one's CPUs and memory."""
    each = [resources(experiment.devices, rank) for rank in range(count)]
    return DeviceSpec(count, tuple(c for c, _ in each), tuple(m for _, m in each))


def describe(spec: DeviceSpec) -> str:
    """'1 CPU, 2048 MB each', or each device's where they differ."""
    pairs = [(spec.cpus_of(r), spec.memory_of(r)) for r in range(spec.count)]
    if len(set(pairs)) == 1:
        return f"{pairs[0][0]:g} CPU, {pairs[0][1]} MB each"
    return ", ".join(f"d{r}: {c:g} CPU {m} MB" for r, (c, m) in enumerate(pairs))


def measure_devices(
    backend: Backend, devices: list[Device], model: str, dilation: float = 1.0
) -> dict[int, float]:
    """Each device's GEMM rate (GFLOP/s) at full speed, on the threads its worker runs (in
    virtual time one, its rate then times the threads folded into it: folded_threads);
    DeviceError names the device whose probe failed."""
    rates = {}
    with voice.phase("device rates", f"GEMM probe on {len(devices)} devices") as step:
        for device in devices:
            folded = fold(device.cpus, dilation)
            threads = 1 if folded > 1 else device.threads
            argv = [backend.python, "-m", "devices.gemm", "--model", model]
            argv += ["--threads", str(threads), "--seconds", str(PROBE_SECONDS)]
            result = backend.run(device, argv, PROBE_TIMEOUT_S)
            if not result.ok:
                raise DeviceError(f"device {device.rank}: the GEMM probe failed: {result.tail(1)}")
            rates[device.rank] = float(json.loads(result.stdout)["gflops"]) * folded
        step.outcome = ", ".join(f"{rates[d.rank]:.1f}" for d in devices) + " GFLOP/s"
    return rates


def session_fleet(
    experiment: Experiment,
    trials: list[Trial],
    directory: Path,
    host_gflops: float | None,
    gflops: dict[int, float],
    live_out: dict[int, Path | None],
    dilation: float = 1.0,
) -> tuple[Fleet, SessionFleet]:
    """A session's devices (its trials share a fleet variant): the fleet, and what its
    workers are told: the partition in force, their speeds, the timeline (None when no
    event concerns these devices), in virtual time of `dilation`. `live_out`: where the
    host reads each device's output."""
    fleet = trial_fleet(experiment, trials[0], host_gflops)
    sizes = fleet.sizes(model_config(experiment.model.name).tokens, gflops)
    count = len(fleet.shares)
    folded = folded_threads(fleet, dilation)
    timeline = None
    if any(event.device < count for event in experiment.timeline):
        timeline = SessionTimeline(
            experiment.timeline,
            count,
            directory,
            fleet.speeds,
            live_out.__getitem__,
            dilation,
            folded,
        )
    return fleet, SessionFleet(sizes, fleet.speeds, timeline, dilation=dilation, folded=folded)


def folded_threads(fleet: Fleet, dilation: float) -> list[int]:
    """By rank, the threads folded into the worker's one: in virtual time (d > 1) a device of
    c cores computes on one host thread at c times its speed per core, so that P devices are
    P threads on the host's cores, each with its pace's slack, and not c x P threads that
    preempt one another inside a GEMM (docs/devices.md, Virtual time). 1 each at d = 1."""
    return [fold(share.cpus, dilation) for share in fleet.shares]


def fold(cpus: float, dilation: float) -> int:
    """The threads a device of `cpus` folds into its worker's one at `dilation`."""
    return worker_threads(cpus) if dilation > 1 else 1
