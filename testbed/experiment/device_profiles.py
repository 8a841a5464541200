"""Device profiles: what a kind of edge device is, one YAML file per profile in
`device_profiles/`.

A profile gives a device its CPUs, its memory and how fast it computes: a `speed` (a fraction
of one host core per core, for emulated stragglers) or a `gflops` rate (fp32 GFLOP/s of
GEMMs on all its cores, for a real kind of board), which the preflight turns into a speed with
this host's measured rate (`testbed.sweep.host_rate`) and refuses when the host is too slow to
emulate it. Every figure taken from elsewhere names its source (`sources`), and a figure
derived from another says how (`gflops_derivation`). Loading validates the file: unknown keys
are refused with a "did you mean", every error is one `ConfigError` naming the file and field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from testbed.errors import ConfigError
from testbed.experiment.strict import Strict, describe
from testbed.experiment.yamlfile import load_yaml, named_file
from testbed.source import DEVICE_PROFILES_DIR


class DeviceProfile(Strict):
    """One kind of device."""

    name: str = Field(min_length=1, description="default: the file's name")
    description: str = Field("", description="what device it stands for, in a sentence")
    cpus: float = Field(1.0, gt=0, le=1024, description="its cores")
    memory_mb: int | None = Field(None, ge=128, le=1_048_576, description="its memory")
    speed: float | None = Field(
        None, gt=0, le=100, description="each core's speed, a fraction of a host core"
    )
    gflops: float | None = Field(
        None, gt=0, le=1e6, description="or its fp32 GEMM rate on all its cores, GFLOP/s"
    )
    gflops_derivation: str = Field("", description="how gflops follows from its source")
    sources: dict[str, str] = Field(
        default_factory=dict, description="for each figure taken from elsewhere, where from"
    )

    @model_validator(mode="after")
    def _one_rate(self) -> DeviceProfile:
        if (self.speed is None) == (self.gflops is None):
            raise ValueError("give speed (a fraction of a host core) or gflops, one of them")
        unsourced = [
            f for f in ("gflops",) if getattr(self, f) is not None and f not in self.sources
        ]
        if unsourced:
            raise ValueError(f"{unsourced[0]}: a figure from elsewhere needs its source (sources)")
        return self


def load_device_profile(
    name_or_path: str | Path, directory: Path = DEVICE_PROFILES_DIR
) -> DeviceProfile:
    """A profile by name (`directory/<name>.yaml`) or a YAML file's path; ConfigError names
    the file and the field."""
    path = named_file(name_or_path, Path(directory), "device profile")
    data: Any = load_yaml(path, "device profile")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a device profile is a mapping, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    try:
        return DeviceProfile.model_validate(data)
    except ValidationError as error:
        raise ConfigError(
            f"{path}: invalid device profile: {describe(error, DeviceProfile)}"
        ) from None
