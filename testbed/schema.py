"""The experiment file: typed, unknown keys rejected with a hint, every error naming the field
path (`methods[2].K`) and the file. Loaded in one place; the resolved form is saved with the
results of every run.

An experiment names the model, the device counts and their CPU/memory, the backend, the link
profile and the bandwidths, the methods with their parameters (a list anywhere in a method's
parameters expands into a grid), repeats and warm-up, and optionally an evaluation set.
"""

from __future__ import annotations

import difflib
import itertools
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from testbed.errors import ConfigError
from testbed.inventory import Inventory, inventory_input
from tracevq.config import known_model_name

BACKENDS = ("auto", "docker", "local", "ssh")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]


class ModelSection(Strict):
    name: str = "vit-b16"
    checkpoint: str | None = None
    seed: int = 0

    _known = field_validator("name")(known_model_name)


class DevicesSection(Strict):
    count: list[int] = Field(default_factory=lambda: [2])
    cpus: float = Field(1.0, gt=0)
    memory_mb: int = Field(2048, ge=128)

    _list = field_validator("count", mode="before")(_as_list)

    @field_validator("count")
    @classmethod
    def _positive(cls, counts: list[int]) -> list[int]:
        if not counts or any(c < 1 for c in counts):
            raise ValueError("every device count must be at least 1")
        return counts


EMULATORS = ("tbf", "serial")


class LinkSection(Strict):
    profile: str = "ideal"
    bandwidth_mbit: list[float] = Field(default_factory=lambda: [10.0])
    # traffic per rate probe, in seconds at the target rate (timed after its first tenth)
    probe_s: float = Field(0.5, gt=0, le=60)
    # what shapes the links: `serial` clocks every frame out at the rate in a userspace link
    # between the devices (a lone small message takes its wire time, as on a real link);
    # `tbf` is the kernel's token bucket on each device's egress (holds the rate, but lets a
    # small message through at once). Default: serial, except on ssh boards (tbf); see
    # testbed.link.emulator_for.
    emulator: Literal["tbf", "serial"] | None = None

    _list = field_validator("bandwidth_mbit", mode="before")(_as_list)

    @field_validator("bandwidth_mbit")
    @classmethod
    def _positive(cls, rates: list[float]) -> list[float]:
        if not rates or any(r <= 0 for r in rates):
            raise ValueError("every bandwidth must be positive (Mbit/s)")
        return rates


class BundleSection(Strict):
    """Where codebooks come from: a bundle file, or fitted by k-means on calibration inputs."""

    path: str | None = None
    K: int | None = None  # default: the largest K any method asks for
    calibration_inputs: int = Field(8, ge=1)
    code_dim: int | None = None
    metric: Literal["euclidean", "cosine", "frequency"] = "euclidean"
    seed: int = 0


class EvaluationSection(Strict):
    """Labelled inputs to run through the distributed workers: a .pt file holding
    {"inputs": (N, C, [T,] H, W), "labels": (N,)} already normalised as the model expects
    (`python -m tracevq.train` writes one next to its checkpoint and bundle). The trials then
    run the first `limit` inputs (all by default), cut to whole batches, instead of
    `repeats` generated inputs, and record the correct predictions."""

    inputs: str
    limit: int | None = Field(None, ge=1)


class Experiment(Strict):
    name: str
    description: str = ""
    model: ModelSection = ModelSection()
    devices: DevicesSection = DevicesSection()
    backend: Literal["auto", "docker", "local", "ssh"] = "auto"
    inventory: Inventory | None = None  # the ssh backend's boards: a YAML file's path, or inline
    link: LinkSection = LinkSection()
    methods: list[dict[str, Any]]
    bundle: BundleSection = BundleSection()
    batch: int = Field(1, ge=1)
    repeats: int = Field(3, ge=1)
    warmup: int = Field(1, ge=0)
    evaluation: EvaluationSection | None = None
    timeout_s: float = Field(600.0, gt=0)

    _inventory = field_validator("inventory", mode="before")(inventory_input)

    @model_validator(mode="after")
    def _methods_valid(self) -> Experiment:
        if not self.methods:
            raise ValueError("methods: at least one method is needed")
        for index, entry in enumerate(self.methods):
            for variant in expand_method(entry, index):
                _check_method(variant, index)
        return self

    def method_variants(self) -> list[dict[str, Any]]:
        """Every method entry with its list-valued parameters expanded into a grid."""
        return [v for i, entry in enumerate(self.methods) for v in expand_method(entry, i)]


def expand_method(entry: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(entry, dict) or "name" not in entry:
        raise ValueError(f"methods[{index}]: needs a 'name' (e.g. {{name: trace-b, K: 1024}})")
    keys = list(entry)
    values = [_as_list(entry[k]) for k in keys]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def _check_method(variant: dict[str, Any], index: int) -> None:
    from tracevq.errors import ConfigError as TraceConfigError
    from tracevq.spec import method_spec

    params = {k: v for k, v in variant.items() if k != "name"}
    try:
        method_spec(variant["name"], **params)
    except TraceConfigError as error:
        field = f".{error.field}" if error.field else ""
        raise ValueError(f"methods[{index}]{field}: {error}") from None


def _path(location: tuple[Any, ...]) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _describe(error: dict[str, Any], data: Any) -> str:
    location = tuple(p for p in error["loc"] if p not in ("function-after",))
    if error["type"] == "extra_forbidden":
        *parent, key = location
        owner = _lookup_model(parent)
        known = list(owner.model_fields) if owner else []
        hint = difflib.get_close_matches(str(key), known, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        return f"{_path(location)}: unknown key{suggestion}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{_path(location)}: {message}" if location else message


def _lookup_model(parent: list[Any]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Experiment
    for part in parent:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
    return model


def parse_experiment(data: Any, source: str = "<experiment>") -> Experiment:
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: an experiment is a mapping of keys, got {type(data).__name__}"
        )
    try:
        return Experiment.model_validate(data)
    except ValidationError as error:
        lines = [_describe(e, data) for e in error.errors()]
        raise ConfigError(f"{source}: " + "; ".join(lines)) from None


def load_experiment(path: str | Path) -> Experiment:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return parse_experiment(data, str(path))
