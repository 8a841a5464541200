"""A trial's devices as the experiment gives them: each one's CPUs, memory and speed, and how
the tokens are split among them.

`devices` (testbed.experiment.devices_section) says it per device, with profiles and fleet
variants; this module resolves it for one device count and one variant:

- CPUs and memory are the devices' own for the whole device count (they start once per
  count): a device's profile gives them where it has one, else `devices.cpus` and
  `devices.memory_mb`. A variant may change speeds and the partition, not CPUs or memory.
- A speed is a fraction of one host core per core. `gflops` (and a profile's) is an absolute
  rate on all the device's cores, turned into a speed with this host's core rate (measured
  once, `testbed.sweep.host_rate`): speed = gflops / (cpus x the host core's GFLOP/s). A
  device faster than a host core (a speed above 1) runs in virtual time, with a dilation
  that makes it fit (testbed.experiment.dilation).
- The partition: even, by_speed (tokens proportional to each device's rate: its measured
  GEMM rate at full speed times its speed; equal rates where none is measured yet, as in the
  plan) or the given token counts.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from testbed.errors import ConfigError
from testbed.experiment.device_profiles import DeviceProfile, load_device_profile
from testbed.experiment.devices_section import DevicesSection, FleetVariant
from tracevq.partition import check_sizes, partition_sizes, sizes_by_rates


@dataclass(frozen=True)
class DeviceShare:
    """One device of a trial."""

    rank: int
    cpus: float
    memory_mb: int
    speed: float  # at the session's start
    source: str = ""  # where the speed comes from: "speed", "gflops 16", "profile raspberry-pi-4"


@dataclass(frozen=True)
class Fleet:
    """A trial's devices and the partition it asks for."""

    shares: list[DeviceShare]
    partition: str | list[int]  # even, by_speed or the given token counts
    label: str = ""  # the fleet variant's, empty without variants

    def sizes(self, tokens: int, gflops: dict[int, float] | None = None) -> list[int]:
        """Every device's tokens; `gflops`, each device's measured rate at full speed, on all
        its threads (by_speed weighs it by the device's speed, and by its quota's share of
        those threads where its CPUs are a fraction: a short probe runs within one quota
        period, at the cores' full rate; equal where not given)."""
        if isinstance(self.partition, list):
            return check_sizes(tokens, self.partition)
        if self.partition == "even":
            return partition_sizes(tokens, len(self.shares))
        rates = [
            (gflops or {}).get(s.rank, 1.0) * s.speed * quota_share(s.cpus) for s in self.shares
        ]
        return sizes_by_rates(tokens, rates)

    @property
    def speeds(self) -> list[float]:
        return [share.speed for share in self.shares]


def worker_threads(cpus: float) -> int:
    """The torch threads of a device of `cpus`: its whole cores, at least one
    (testbed.backends.base.plan_cpus; in virtual time folded into one, testbed.sweep.fleets)."""
    return max(1, int(cpus))


def quota_share(cpus: float) -> float:
    """The share of its threads' cores a device of `cpus` gets (a quota of a fraction of its
    worker's threads' cores)."""
    return min(1.0, cpus / worker_threads(cpus))


def fleet_variant_keys(devices: DevicesSection) -> list[str]:
    """The fleet variants as canonical JSON, as trials carry them ([""]: none)."""
    if not devices.variants:
        return [""]
    return [json.dumps(v.model_dump(exclude_none=True), sort_keys=True) for v in devices.variants]


def variant_of(devices: DevicesSection, key: str) -> FleetVariant:
    return FleetVariant.model_validate(json.loads(key)) if key else FleetVariant()


@functools.cache
def _profile(name: str) -> DeviceProfile:
    """A device profile, read once per process (every trial's plan row resolves its fleet)."""
    return load_device_profile(name)


def _device_profile(name: str, rank: int) -> DeviceProfile:
    try:
        return _profile(name)
    except ConfigError as error:
        raise ConfigError(f"devices.profile: device {rank}: {error}") from None


def profile_of(devices: DevicesSection, rank: int, variant: FleetVariant) -> DeviceProfile | None:
    source = devices.speed_source(variant, rank)
    if source is None or source[0] != "profile":
        return None
    return _device_profile(str(source[1]), rank)


def rate_source(
    devices: DevicesSection, rank: int, variant: FleetVariant
) -> tuple[str, float, DeviceProfile | None] | None:
    """How device `rank` is as fast as it is under `variant`: ("speed", 0.5, None),
    ("gflops", 20.0, None), the same with the profile they come from, or None (speed 1)."""
    source = devices.speed_source(variant, rank)
    if source is None:
        return None
    field, value = source
    if field != "profile":
        return field, float(value), None
    profile = _device_profile(str(value), rank)
    if profile.speed is not None:
        return "speed", profile.speed, profile
    assert profile.gflops is not None  # a profile has one of them (DeviceProfile)
    return "gflops", profile.gflops, profile


def resources(devices: DevicesSection, rank: int) -> tuple[float, int]:
    """A device's CPUs and memory (MB) for its device count: its profile's (the section's
    own, without variants), else the section's per-device values."""
    profile = profile_of(devices, rank, FleetVariant())
    cpus = devices.resource("cpus", rank)
    memory = devices.resource("memory_mb", rank)
    if profile is not None:
        cpus = profile.cpus
        memory = profile.memory_mb if profile.memory_mb is not None else memory
    return float(cpus), int(memory)


def resolve_fleet(
    devices: DevicesSection, count: int, key: str = "", host_gflops: float | None = None
) -> Fleet:
    """The fleet of `count` devices under the variant `key` (fleet_variant_keys). Raises
    ConfigError naming the field and device: a variant's profile that changes a device's
    CPUs or memory, a gflops figure without the host's rate."""
    variant = variant_of(devices, key)
    shares = []
    for rank in range(count):
        cpus, memory = resources(devices, rank)
        source = rate_source(devices, rank, variant)
        speed, said = 1.0, ""
        if source is not None:
            field, value, profile = source
            started = (cpus, memory)
            if profile is not None and (profile.cpus, profile.memory_mb or memory) != started:
                raise ConfigError(
                    f"devices.variants: device {rank}'s profile {profile.name} has other "
                    f"CPUs or memory than the device started with ({cpus:g} CPUs, "
                    f"{memory} MB): a variant changes speeds, not devices"
                )
            speed = value if field == "speed" else _speed_of(value, cpus, rank, host_gflops)
            if profile is not None:
                said = f"profile {profile.name}"
            else:
                said = field if field == "speed" else f"gflops {value:g}"
        shares.append(DeviceShare(rank, cpus, memory, speed, said))
    partition = devices.partition_of(variant)
    label = variant.label() if key else ""
    return Fleet(shares, partition, label)


def needs_host_rate(devices: DevicesSection, count: int) -> bool:
    """Whether some device's speed is a rate (gflops, or a profile's) for this device count."""
    return any(
        (source := rate_source(devices, rank, variant_of(devices, key))) is not None
        and source[0] == "gflops"
        for key in fleet_variant_keys(devices)
        for rank in range(count)
    )


def _speed_of(gflops: float, cpus: float, rank: int, host_gflops: float | None) -> float:
    if host_gflops is None:
        raise ConfigError(
            f"devices.gflops: device {rank} asks for {gflops:g} GFLOP/s, and this host's core "
            "rate is not known (it is measured before the run)"
        )
    return gflops / (cpus * host_gflops)  # above 1: the dilation makes room for it
