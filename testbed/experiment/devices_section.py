"""The `devices` section of an experiment: how many devices, and each one's CPUs, memory, speed
and share of the tokens.

Every per-device field takes one value for every device, or a mapping rank -> value
(`{1: 0.5}`: device 1 only, the others keep the default), or a list by rank. A device's
*speed* is the fraction of one host core that each of its cores computes at (1.0: the host's
own); `gflops` asks for an absolute rate instead (fp32 GFLOP/s of the model's own products,
`devices.gemm`), which the preflight turns into a speed with this host's measured rate; a
device *profile* (`device_profiles/`, `testbed.experiment.device_profiles`) gives a device
its CPUs, memory and speed or rate together. `variants` sweeps speeds and partitions like
`link.impairments` sweeps impairments: each variant is a session of its own on the same
devices. What the devices finally get is resolved per trial by `testbed.sweep.fleet`.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from testbed.experiment.link_section import rank_of
from testbed.experiment.names import check_slug
from testbed.experiment.strict import Strict, as_list, distinct

MAX_SPEED = 100.0  # a host core's multiple: beyond 1 in virtual time (experiment.dilation)
MAX_DEVICES = 254  # hosts of one /24 (the local backend's network)
DEFAULT_CPUS, DEFAULT_MEMORY_MB, DEFAULT_SPEED = 1.0, 2048, 1.0
PARTITIONS = ("even", "by_speed")
SPEED_SOURCES = {"speed", "gflops", "profile"}  # where a device's speed comes from: one of them
PER_DEVICE = "one value for every device, a mapping rank -> value, or a list by rank"
PER_NUMBER = {"shown_as": "number, or by rank: mapping or list of numbers"}
PER_WHOLE = {"shown_as": "whole number, or by rank: mapping or list of whole numbers"}
PER_TEXT = {"shown_as": "text, or by rank: mapping or list of texts"}

Partition = Literal["even", "by_speed"] | list[int]


def by_rank(value: Any) -> Any:
    """A per-device field as written: a list becomes a mapping by rank, keys become ranks."""
    if isinstance(value, list):
        value = dict(enumerate(value))
    if isinstance(value, dict):
        return {rank_of(key): item for key, item in value.items()}
    return value


def _number(value: Any, where: str, low: float, high: float, whole: bool = False) -> None:
    kind = int if whole else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
        raise ValueError(f"{where}: a {'whole ' if whole else ''}number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{where}: {value!r} is not in {low:,.10g}..{high:,.10g}")


def _each(value: Any, where: str, check: Any) -> Any:
    for rank, item in value.items() if isinstance(value, dict) else [(None, value)]:
        check(item, where if rank is None else f"device {rank}")
    return value


def _speed(value: Any, where: str) -> None:
    _number(value, where, -math.inf, math.inf)
    if value <= 0:
        raise ValueError(f"{where}: a speed is a positive multiple of a host core, got {value!r}")
    if value > MAX_SPEED:
        raise ValueError(f"{where}: {value:g} is more than {MAX_SPEED:g} host cores per core")


def _profile_name(value: Any, where: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: a device profile's name or a YAML file's path, got {value!r}")
    if "/" not in value and not value.endswith((".yaml", ".yml")):
        check_slug(value, "device profile name")


def check_partition(value: Any) -> Any:
    if isinstance(value, str):
        if value not in PARTITIONS:
            raise ValueError(
                f"partition: {value!r} is none of {', '.join(PARTITIONS)}, nor a list of token "
                "counts by rank"
            )
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"partition: even, by_speed or a list of token counts, got {value!r}")
    for index, tokens in enumerate(value):
        _number(tokens, f"partition[{index}]", 1, 1_000_000, whole=True)
    return value


class FleetVariant(Strict):
    """What one variant changes for its sessions (the section's own values otherwise)."""

    speed: Any = Field(None, description="as devices.speed")
    gflops: Any = Field(None, description="as devices.gflops")
    profile: Any = Field(None, description="as devices.profile")
    partition: Partition | None = Field(None, description="as devices.partition")

    _ranks = field_validator("speed", "gflops", "profile", mode="before")(by_rank)

    @field_validator("speed")
    @classmethod
    def _speeds(cls, value: Any) -> Any:
        return None if value is None else _each(value, "speed", _speed)

    @field_validator("gflops")
    @classmethod
    def _rates(cls, value: Any) -> Any:
        check = lambda v, w: _number(v, w, 1e-3, 1e6)  # noqa: E731
        return None if value is None else _each(value, "gflops", check)

    @field_validator("profile")
    @classmethod
    def _profiles(cls, value: Any) -> Any:
        return None if value is None else _each(value, "profile", _profile_name)

    @field_validator("partition", mode="before")
    @classmethod
    def _partition(cls, value: Any) -> Any:
        return None if value is None else check_partition(value)

    def label(self) -> str:
        """A short name for ids and tables: `speed1=0.5,by_speed` ('' for no change)."""
        parts = []
        for field in ("speed", "gflops", "profile"):
            value = getattr(self, field)
            if isinstance(value, dict):
                parts += [
                    f"{field}{rank}={v:g}" if field != "profile" else f"{field}{rank}={v}"
                    for rank, v in sorted(value.items())
                ]
            elif value is not None:
                parts.append(f"{field}={value:g}" if field != "profile" else f"{field}={value}")
        if self.partition is not None:
            partition = self.partition
            parts.append(partition if isinstance(partition, str) else "-".join(map(str, partition)))
        return ",".join(parts)


class DevicesSection(FleetVariant):
    """The devices: how many, and each one's share of the host."""

    count: list[int] = Field(
        default_factory=lambda: [2],
        description="P, the device counts swept (a number or a list); devices start once per count",
    )
    cpus: Any = Field(
        DEFAULT_CPUS,
        json_schema_extra=PER_NUMBER,
        description="CPUs per device (pinned whole cores where the host has enough, else a "
        "quota; with the local backend a cgroup of its own): " + PER_DEVICE + "; at most the "
        "host's own",
    )
    memory_mb: Any = Field(
        DEFAULT_MEMORY_MB,
        json_schema_extra=PER_WHOLE,
        description="memory per device (a cgroup limit): " + PER_DEVICE,
    )
    speed: Any = Field(
        None,
        json_schema_extra=PER_NUMBER,
        description="each device's speed, a fraction of one host core (default 1; above 1 "
        "in virtual time, `dilation`), e.g. {1: 0.5}: "
        + PER_DEVICE
        + "; a slower device's every stretch of compute takes 1/speed times as long "
        "(docs/devices.md)",
    )
    gflops: Any = Field(
        None,
        json_schema_extra=PER_NUMBER,
        description="a device's compute rate instead of a speed (fp32 GFLOP/s of the model's "
        "own products, all its cores), turned into a speed with this host's measured rate: "
        + PER_DEVICE,
    )
    profile: Any = Field(
        None,
        json_schema_extra=PER_TEXT,
        description="a device profile (a name in device_profiles/ or a YAML path) giving a "
        "device its cpus, memory and speed or rate: " + PER_DEVICE,
    )
    partition: Partition | None = Field(
        None,
        description="each device's tokens: even (default; sizes differ by at most one), "
        "by_speed (proportional to the devices' measured rates at their speeds) or a list of "
        "token counts by rank adding up to the model's tokens (one device count only)",
    )
    variants: list[FleetVariant] | None = Field(
        None,
        description="fleet variants swept like link.impairments, each a session of its own "
        "on the same devices: a mapping of speed, gflops, profile and partition laid over "
        "these (per device, the most specific statement wins: the variant's for the device, the "
        "variant's for all, the section's for the device, the section's for all), e.g. [{}, "
        "{speed: {1: 0.5}}, {speed: {1: 0.5}, partition: by_speed}]",
    )
    oversubscribe: bool = Field(
        False,
        description="let one device ask for more CPUs than the host has (then they share its "
        "cores); devices that together ask for more are allowed anyway, and recorded as "
        "oversubscribed",
    )

    _list = field_validator("count", mode="before")(as_list)
    _per_rank = field_validator("cpus", "memory_mb", mode="before")(by_rank)

    @field_validator("count")
    @classmethod
    def _in_range(cls, counts: list[int]) -> list[int]:
        if not counts or any(not 1 <= c <= MAX_DEVICES for c in counts):
            raise ValueError(f"every device count must be in 1..{MAX_DEVICES}, got {counts}")
        return distinct(counts, "device count")

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, value: Any) -> Any:
        return _each(value, "cpus", lambda v, w: _number(v, w, 0.01, 1024))

    @field_validator("memory_mb")
    @classmethod
    def _memory(cls, value: Any) -> Any:
        return _each(value, "memory_mb", lambda v, w: _number(v, w, 128, 1_048_576, whole=True))

    @field_validator("variants")
    @classmethod
    def _variants(cls, variants: list[FleetVariant] | None) -> Any:
        if variants is not None:
            if not variants:
                raise ValueError("variants: give at least one, or leave variants out")
            keys = [json.dumps(v.model_dump(exclude_none=True), sort_keys=True) for v in variants]
            distinct(keys, "fleet variant")
        return variants

    @model_validator(mode="after")
    def _one_source_per_device(self) -> DevicesSection:
        for variant in [self, *(self.variants or [])]:
            _check_sources(variant)
        return self

    def speed_source(self, variant: FleetVariant, rank: int) -> tuple[str, Any] | None:
        """Where device `rank`'s speed comes from under `variant`: ("speed", 0.5),
        ("gflops", 20.0), ("profile", "raspberry-pi-4"), or None (speed 1). The most specific
        statement wins: the variant's for this rank, the variant's for every device, the
        section's for this rank, the section's for every device."""
        for layer in (variant, self):
            for specific in (True, False):
                for field in sorted(SPEED_SOURCES):
                    value = getattr(layer, field)
                    if specific and isinstance(value, dict) and rank in value:
                        return field, value[rank]
                    if not specific and value is not None and not isinstance(value, dict):
                        return field, value
        return None

    def partition_of(self, variant: FleetVariant) -> str | list[int]:
        """The partition under `variant`: its own, the section's, or even."""
        return variant.partition or self.partition or "even"

    def resource(self, field: str, rank: int) -> Any:
        """Device `rank`'s cpus or memory_mb as written (its profile's is applied later)."""
        value = getattr(self, field)
        default = {"cpus": DEFAULT_CPUS, "memory_mb": DEFAULT_MEMORY_MB}[field]
        return value.get(rank, default) if isinstance(value, dict) else value

    def ranks_named(self) -> dict[str, list[int]]:
        """Every rank a per-device field names."""
        named: dict[str, set[int]] = {}
        for variant in [self, *(self.variants or [])]:
            for field in ("speed", "gflops", "profile"):
                value = getattr(variant, field)
                if isinstance(value, dict):
                    named.setdefault(f"devices.{field}", set()).update(value)
        for field in ("cpus", "memory_mb"):
            value = getattr(self, field)
            if isinstance(value, dict):
                named[f"devices.{field}"] = set(value)
        return {field: sorted(ranks) for field, ranks in named.items()}


def _check_sources(variant: FleetVariant) -> None:
    """A device's speed comes from one place: speed, gflops or a profile."""
    given = {f: getattr(variant, f) for f in sorted(SPEED_SOURCES)}
    given = {f: v for f, v in given.items() if v is not None}
    everyone = [f for f, v in given.items() if not isinstance(v, dict)]
    if len(everyone) > 1:
        raise ValueError(f"devices: {' and '.join(everyone)} both for every device; give one")
    ranks: dict[int, str] = {}
    for field, value in given.items():
        if isinstance(value, dict):
            for rank in value:
                if rank in ranks:
                    raise ValueError(
                        f"devices: device {rank} has both {ranks[rank]} and {field}; give one"
                    )
                ranks[rank] = field
