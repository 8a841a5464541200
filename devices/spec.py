"""The run spec of one device: a typed model loaded from a YAML/JSON file and/or CLI flags.

Flags override the file key by key (`--param` entries are merged into the file's `params`).
Unknown keys are rejected with the key's name and a "did you mean" hint. The resolved spec is
saved with the device's records (session.json).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from devices.errors import SpecError
from devices.transport import parse_address


class RunSpec(BaseModel):
    """Everything one device needs for a session. Times in seconds, rate in 10^6 bit/s."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    rank: int = Field(ge=0)
    peers: list[str] = Field(min_length=1, description="host:port of every device, rank order")
    model: str = Field(description="model configuration name (the architecture)")
    checkpoint: Path | None = Field(None, description="weights for that architecture")
    model_seed: int = 0
    bundle: Path | None = None
    method: str = "voltage"
    params: dict[str, Any] = Field(default_factory=dict)
    batch: int = Field(1, ge=1)
    warmup: int = Field(0, ge=0)
    inferences: int = Field(1, ge=1)
    threads: int = Field(1, ge=1)
    input_seed: int = 0
    inputs: Path | None = None
    out: Path
    connect_timeout_s: float = Field(30.0, gt=0)
    recv_timeout_s: float = Field(60.0, gt=0)
    rate_mbit: float | None = Field(None, gt=0)

    @field_validator("peers", mode="before")
    @classmethod
    def _split_peers(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("peers")
    @classmethod
    def _check_peers(cls, peers: list[str]) -> list[str]:
        for peer in peers:
            parse_address(peer)
        return peers

    @model_validator(mode="after")
    def _check_consistency(self) -> RunSpec:
        if self.rank >= len(self.peers):
            raise ValueError(f"rank {self.rank} out of range for {len(self.peers)} peers")
        return self

    @property
    def devices(self) -> int:
        return len(self.peers)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [parse_address(peer) for peer in self.peers]


def parse_param(text: str) -> tuple[str, Any]:
    """'key=value' with a YAML scalar value: 'K=16' -> ('K', 16), 'buffers=false' -> False."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SpecError(f"--param {text!r}: expected key=value")
    return key.strip(), yaml.safe_load(value) if value.strip() else None


def read_spec_file(path: Path) -> dict[str, Any]:
    """Keys of a YAML or JSON run-spec file."""
    if not path.is_file():
        raise SpecError(f"run spec {path}: no such file")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise SpecError(f"run spec {path}: cannot be parsed: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(f"run spec {path}: expected a mapping of keys, got {type(data).__name__}")
    return data


def resolve_spec(
    path: Path | None, overrides: dict[str, Any], params: list[str] | tuple[str, ...] = ()
) -> RunSpec:
    """The spec from `path` (optional), with non-None `overrides` and `key=value` params on top."""
    data = read_spec_file(path) if path is not None else {}
    data.update({key: value for key, value in overrides.items() if value is not None})
    if params:
        merged = dict(data.get("params") or {})
        merged.update(parse_param(text) for text in params)
        data["params"] = merged
    source = f"run spec {path}" if path is not None else "run spec"
    try:
        spec = RunSpec.model_validate(data)
    except ValidationError as error:
        raise SpecError(f"{source}: {describe_validation_error(error)}") from None
    check_method(spec)
    return spec


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, each naming its key; unknown keys get a "did you mean" hint."""
    known = list(RunSpec.model_fields)
    lines = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "spec"
        if problem["type"] == "extra_forbidden":
            hint = difflib.get_close_matches(where, known, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            lines.append(f"unknown key {where!r}{suggestion}")
        else:
            message = problem["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {message}" if problem["loc"] else message)
    return "; ".join(lines)


def check_method(spec: RunSpec) -> None:
    """Validate the method name and parameters now (tracevq names the bad parameter)."""
    from tracevq.errors import ConfigError
    from tracevq.spec import method_spec

    try:
        method_spec(spec.method, **spec.params)
    except ConfigError as error:
        raise SpecError(str(error)) from None
    except TypeError as error:  # a parameter of the wrong type reaching the dataclass
        raise SpecError(f"method {spec.method!r}: {error}") from None
