"""What one device is asked to run: a typed spec, written to a file by whoever starts the
worker (the testbed, a test, a person) and read here, in one place.

    python -m devices.worker SPEC.json        # or SPEC.yaml

A session is one process per device, one TCP mesh and one model; it measures one or more
*runs* (a method variant each: a trial of the testbed). Their inferences are interleaved in
time, round-robin over the runs (`RunSpec.schedule`), so that a slow minute of a shared host
lands on every method alike. Unknown keys are refused with their path and a "did you mean"
hint; method parameters are validated by tracevq. The resolved spec is saved with the
device's records (session.json).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from devices.errors import SpecError
from devices.transport import parse_address


class MethodRun(BaseModel):
    """One method variant of the session, measured `inferences` times."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, description="names the run in records (the trial id)")
    method: str = "voltage"
    params: dict[str, Any] = Field(default_factory=dict)
    bundle: Path | None = Field(None, description="codebooks (astra, trace-b, trace-nb)")
    inferences: int = Field(1, ge=1, description="measured inferences")


class RunSpec(BaseModel):
    """Everything one device needs for a session. Times in seconds, rate in 10^6 bit/s."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    rank: int = Field(ge=0)
    peers: list[str] = Field(min_length=1, description="host:port of every device, rank order")
    model: str = Field(description="model configuration name (the architecture)")
    checkpoint: Path | None = Field(None, description="weights for that architecture")
    model_seed: int = 0
    runs: list[MethodRun] = Field(min_length=1)
    batch: int = Field(1, ge=1)
    warmup: int = Field(0, ge=0, description="unrecorded inferences of each run, first")
    threads: int = Field(1, ge=1)
    input_seed: int = 0
    inputs: Path | None = None
    out: Path
    connect_timeout_s: float = Field(30.0, gt=0)
    recv_timeout_s: float = Field(60.0, gt=0)
    rate_mbit: float | None = Field(None, gt=0, description="link rate for level_k=auto")
    secret_file: Path | None = Field(
        None,
        description="the run's secret (hex, at least 32 digits): every peer must prove "
        "it knows it in the handshake; the file, kept out of results, is read, never copied",
    )
    partition: list[int] | None = Field(
        None, description="every device's tokens in rank order (default even)"
    )
    speed: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the device's speed, a fraction of its cores' own (devices.pace): each "
        "stretch of compute takes 1/speed times its CPU time",
    )
    control_file: Path | None = Field(
        None,
        description="a control file (devices.pace) that gives the speed while the session "
        "runs and releases the holds; the worker then reports the round it starts in "
        "out/progress",
    )
    turn_file: Path | None = Field(
        None,
        description="a file that the host's devices lock, one at a time, around every stretch "
        "their warm-ups sample (devices.pace): the references are a core's alone, not what "
        "the devices warming up at once left of it",
    )
    holds: list[int] = Field(
        default_factory=list,
        description="measured rounds before which the device waits for the orchestrator's "
        "release (an event at that inference); needs control_file",
    )
    references: dict[str, float] = Field(
        default_factory=dict,
        description="stretch costs known on this host (CPU s per unit of work, by stretch "
        "kind, devices.pace): the worker paces to them from its first inference, and learns "
        "only the others from its warm-ups (they go to out/references.json)",
    )
    clock_skew_s: float = Field(
        0.0,
        description="added to every timestamp this device takes: emulates a board whose "
        "clock is off, to test the alignment of clocks",
    )

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
        ids = [run.id for run in self.runs]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"runs: ids must differ, {repeated} repeated")
        if self.partition is not None and len(self.partition) != len(self.peers):
            raise ValueError(
                f"partition: {len(self.partition)} token counts for {len(self.peers)} devices"
            )
        if self.holds and self.control_file is None:
            raise ValueError("holds: a device that holds needs a control_file to be released")
        return self

    @property
    def devices(self) -> int:
        return len(self.peers)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [parse_address(peer) for peer in self.peers]

    def schedule(self) -> Iterator[tuple[int, int]]:
        """(run index, inference index) in the order they run: round-robin over the runs.
        Lazily: a session of a million inferences does not list them first."""
        rounds = max(run.inferences for run in self.runs)
        return (
            (r, i) for i in range(rounds) for r, run in enumerate(self.runs) if i < run.inferences
        )

    def write(self, path: Path) -> Path:
        """The spec as JSON, for `python -m devices.worker PATH`."""
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=1) + "\n")
        return path


def read_spec_file(path: Path) -> dict[str, Any]:
    """Keys of a YAML or JSON run-spec file."""
    if not path.is_file():
        raise SpecError(f"run spec {path}: no such file")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise SpecError(f"run spec {path}: cannot be parsed: {error}") from None
    if not isinstance(data, dict):
        raise SpecError(f"run spec {path}: expected a mapping of keys, got {type(data).__name__}")
    return data


def load_spec(path: Path) -> RunSpec:
    """The spec of a file, validated (method parameters included)."""
    return parse_spec(read_spec_file(path), f"run spec {path}")


def parse_spec(data: dict[str, Any], source: str = "run spec") -> RunSpec:
    try:
        spec = RunSpec.model_validate(data)
    except ValidationError as error:
        raise SpecError(f"{source}: {describe_validation_error(error)}") from None
    for run in spec.runs:
        check_method(run)
    return spec


def describe_validation_error(error: ValidationError) -> str:
    """One problem per clause, each naming its key path (`runs.0.inferences`); unknown keys
    get a "did you mean" hint."""
    lines = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"]) or "spec"
        if problem["type"] == "extra_forbidden":
            known = MethodRun.model_fields if where.startswith("runs.") else RunSpec.model_fields
            hint = difflib.get_close_matches(where.rsplit(".", 1)[-1], list(known), n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            lines.append(f"unknown key {where!r}{suggestion}")
        else:
            message = problem["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {message}" if problem["loc"] else message)
    return "; ".join(lines)


MIN_SECRET_BYTES = 16


def read_secret(path: Path) -> bytes:
    """The run secret of a file of hex digits; SpecError names the file, never its content."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(
            f"secret_file {path}: cannot be read ({error.__class__.__name__})"
        ) from None
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise SpecError(f"secret_file {path}: expected hex digits") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise SpecError(
            f"secret_file {path}: {len(secret)} bytes, at least {MIN_SECRET_BYTES} needed "
            f"({2 * MIN_SECRET_BYTES} hex digits)"
        )
    return secret


def check_method(run: MethodRun) -> None:
    """Validate the method name and parameters now (tracevq names the bad parameter)."""
    from tracevq.errors import ConfigError
    from tracevq.spec import method_spec

    try:
        method_spec(run.method, **run.params)
    except ConfigError as error:
        raise SpecError(f"run {run.id!r}: {error}") from None
    except TypeError as error:  # a parameter of the wrong type reaching the dataclass
        raise SpecError(f"run {run.id!r}: method {run.method!r}: {error}") from None
