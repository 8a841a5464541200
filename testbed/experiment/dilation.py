"""Virtual time: the dilation factor d of an experiment's sessions (docs/devices.md, Virtual
time; DESIGN.md section 10).

In a dilated session everything that takes time takes d times as long on the host: the
links carry rate / d, their delays, jitter, airtime and queue bounds are d times theirs, the
timeline's times and every timeout are d times theirs, and every device computes at its
speed / d (devices.pace). What the workers, the emulator and the probe record is divided by d
once (testbed.sweep.virtual_time), so the rows read as the experiment asked. The host then
gives the fleet 1/d of the cores it asks for: room for devices that together, or one by one,
are faster than the host.

`experiment.dilation` is a number >= 1 or `auto`: the smallest d (in steps of STEP) that
leaves the fleet's demand within the host's safe load: every device's CPUs x its fastest
speed (a fraction of a host core per core; a gflops rate's speed may be above 1), divided by
d, at most SAFE_LOAD of the host's cores less the emulator's reserve, and each device's one
thread at most PER_THREAD_LOAD of a core. `auto` sees a busy host (NEAT's load-aware factor,
taken once before the run): the cores that others' processes keep busy while it plans
(host_busy_cores, in steps of STEP) are taken off the host's before SAFE_LOAD is applied, so
one spinning process on two cores leaves the fleet one core's safe load. In virtual time
(d > 1) a device of c cores is one host thread at c times its speed per core
(testbed.sweep.fleets.folded_threads), so that thread carries c x speed / d of a core. A fixed
d is refused, naming the d that would do, where a device's thread would need more than a
whole core: speed > 1 at d = 1, c x speed > d above it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from testbed.errors import ConfigError
from testbed.experiment.resolved_fleet import fleet_variant_keys, resolve_fleet, worker_threads

if TYPE_CHECKING:
    from testbed.experiment.schema import Experiment

# the share of the host's cores the devices' paced compute may take on average: above it,
# the paced stretches of devices that compute at once start to overrun (bench/bench_dilation.py
# robustness: at 0.6, P = 3 Astra at d = 1.5 overran 13-17 stretches in 2 quiet runs of 4 and
# its median block moved 2-5%; docs/devices.md, Virtual time)
SAFE_LOAD = 0.5
PER_THREAD_LOAD = 0.8  # one device's thread: the rest of its core is its pace's slack
EMULATOR_RESERVE_CORES = {"serial": 0.25}  # the userspace link's switch; tbf is the kernel's
STEP = 0.25
MIN_BUDGET = 0.1  # host cores: what a host busy to its last core still gives the fleet


@dataclass(frozen=True)
class Dilation:
    """The dilation of one device count's sessions, and why."""

    factor: float
    demand_cores: float  # what the fleet asks for at its virtual speeds, in host cores
    fastest: float  # the fastest device's speed per core (a fraction of a host core)
    budget_cores: float  # what the host gives it safely
    asked: str  # "auto" or the experiment's number
    heaviest: float = 0.0  # the most a device's one thread carries in virtual time (c x speed)
    busy_cores: float = 0.0  # the host's cores others kept busy when auto planned

    @property
    def needed(self) -> float:
        return needed_factor(self.demand_cores, self.fastest, self.budget_cores, self.heaviest)

    def describe(self) -> str:
        """For the plan: 'd = 2.5 (auto): the fleet asks 2.00 host cores, 1.15 are safe'."""
        why = (
            f"the fleet asks {self.demand_cores:.2f} host cores (fastest device "
            f"{self.fastest:.2f} of a core per core), {self.budget_cores:.2f} are safe here"
        )
        if self.busy_cores:
            why += f" ({self.busy_cores:g} of the host's cores busy with other work)"
        if self.factor < self.needed:
            why += f"; auto would pick {self.needed:g} (below it the devices' compute may overrun)"
        return f"d = {self.factor:g} ({self.asked}): {why}"


def needed_factor(
    demand_cores: float, fastest: float, budget_cores: float, heaviest: float = 0.0
) -> float:
    """The smallest d in steps of STEP (at least 1) that fits the demand in the budget and
    every device's thread in PER_THREAD_LOAD of a core (above d = 1, its folded thread)."""
    raw = max(1.0, demand_cores / budget_cores, fastest / PER_THREAD_LOAD)
    if _steps(raw) > 1:
        raw = max(raw, heaviest / PER_THREAD_LOAD)
    return _steps(raw)


def _steps(raw: float) -> float:
    return math.ceil(raw / STEP - 1e-9) * STEP


def host_cores() -> int:
    return len(os.sched_getaffinity(0))


BUSY_WINDOW_S = 0.25  # /proc/stat counts in 10 ms ticks: 50 a window on two cores


def host_busy_cores(window_s: float = BUSY_WINDOW_S) -> float:
    """The host's cores kept busy by other processes over `window_s` (this process's own CPU
    time taken off), to the nearest STEP."""
    tick = os.sysconf("SC_CLK_TCK")
    busy, own, began = _busy_ticks(), _own_s(), time.monotonic()
    time.sleep(window_s)
    elapsed = time.monotonic() - began
    others = (_busy_ticks() - busy) / tick - (_own_s() - own)
    return round(max(0.0, others / elapsed) / STEP) * STEP


def _busy_ticks() -> int:
    """Every CPU's time not idle (user, nice, system, irq, softirq, steal), in ticks."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return user + nice + system + irq + softirq + steal


def _own_s() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@dataclass
class Demand:
    """What `count` devices ask of the host at their fastest, over every fleet variant."""

    cores: float = 0.0  # host cores, all devices at once
    fastest: float = 0.0  # the fastest speed per core
    which: str = ""  # the device that has it, and why
    heaviest: float = 0.0  # the most one device's folded thread carries: c x speed
    heaviest_which: str = ""


def fleet_demand(experiment: Experiment, count: int, host_gflops: float | None) -> Demand:
    """What the `count` devices ask for: each device at the fastest speed its timeline gives."""
    devices, found = experiment.devices, Demand()
    for key in fleet_variant_keys(devices):
        fleet = resolve_fleet(devices, count, key, host_gflops)
        total = 0.0
        for share in fleet.shares:
            events = [e for e in experiment.timeline if e.device == share.rank and e.speed]
            speed = max([share.speed, *(e.speed or 0 for e in events)])
            total += share.cpus * speed
            which = f"device {share.rank}"
            if share.source.startswith(("gflops", "profile")) and host_gflops:
                which += (
                    f" ({share.source}: {speed * share.cpus * host_gflops:.1f} GFLOP/s on "
                    f"{share.cpus:g} CPUs, where this host gives {host_gflops:.1f} per core)"
                )
            if speed > found.fastest:
                found.fastest, found.which = speed, which
            thread = worker_threads(share.cpus) * speed
            if thread > found.heaviest:
                found.heaviest, found.heaviest_which = thread, which
        found.cores = max(found.cores, total)
    return found


def resolve_dilation(
    experiment: Experiment,
    count: int,
    host_gflops: float | None,
    emulator: str,
    cores: int | None = None,
    busy_cores: float = 0.0,
) -> Dilation:
    """The dilation of `count` devices' sessions, on `cores` (the host's) of which `busy_cores`
    are others'. ConfigError names `dilation` where the experiment's fixed d is below what the
    fleet needs."""
    demand = fleet_demand(experiment, count, host_gflops)
    free = (cores or host_cores()) - busy_cores
    budget = max(MIN_BUDGET, SAFE_LOAD * free - EMULATOR_RESERVE_CORES.get(emulator, 0.0))
    asked = experiment.dilation
    picked = Dilation(
        1.0, demand.cores, demand.fastest, budget, "auto", demand.heaviest, busy_cores
    )
    if asked == "auto":
        return dataclasses.replace(picked, factor=picked.needed)
    chosen = dataclasses.replace(picked, factor=float(asked), asked=f"{asked:g}")
    # no pace can make a device's thread faster than the host's core
    if demand.fastest > asked:
        load, which, unit = demand.fastest, demand.which, "of a host core per core"
    elif asked > 1 and demand.heaviest > asked:
        load, which, unit = demand.heaviest, demand.heaviest_which, "host cores on one thread"
    else:
        return chosen
    raise ConfigError(
        f"dilation: {asked:g} is too low for P={count}: {which} computes at {load:.2f} "
        f"{unit}, which needs a dilation of at least {load:.2f} (dilation: auto picks "
        f"{picked.needed:g})"
    )
