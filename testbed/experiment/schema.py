"""The experiment file: typed, unknown keys rejected with a hint, every error naming the field
path (`methods[2].K`) and the file. Loaded in one place; the resolved form is saved with the
results of every run.

An experiment names the model, the device counts and their CPU/memory, the backend, the link
profile and the bandwidths, the methods with their parameters (a list anywhere in a method's
parameters expands into a grid), repeats and warm-up, and optionally an evaluation set.

What the file alone decides is checked here: types without coercion (a boolean or a string is
not a number), finite numbers in sane ranges, names that are slugs, tree levels, device counts
against the model's tokens, and the grid's size before it is expanded. What depends on the
host, its files and the backend is checked by `testbed.sweep.preflight`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from testbed.errors import ConfigError
from testbed.experiment.inventory import Inventory, inventory_input
from testbed.experiment.names import check_slug
from testbed.experiment.strict import Strict, describe
from testbed.experiment.yamlfile import load_yaml
from tracevq.codec import level_sizes_for
from tracevq.config import known_model_name, model_config
from tracevq.spec import MethodSpec, method_spec

MAX_TRIALS = 10_000  # device counts x bandwidths x method variants, counted before expanding
MAX_DEVICES = 254  # hosts of one /24 (the local backend's network)
RATE_RANGE_MBIT = (0.01, 10_000.0)
MAX_TIMEOUT_S = 7 * 24 * 3600.0
FITTED_BRANCHING = 2  # codebooks the testbed fits get a binary tree (testbed.sweep.bundles)
FLAG_PARAMS = {f.name for f in dataclasses.fields(MethodSpec) if isinstance(f.default, bool)}


def _as_list(value: Any) -> Any:
    return value if isinstance(value, list) else [value]


def _distinct(values: list[Any], what: str) -> list[Any]:
    """`values`, or ValueError naming the first repeated one (two trials would share an id)."""
    seen = set()
    for value in values:
        if value in seen:
            raise ValueError(f"{what} {value!r} is listed twice; each trial must be distinct")
        seen.add(value)
    return values


def _as_list_or_none(value: Any) -> Any:
    return None if value is None else _as_list(value)


class ModelSection(Strict):
    """The model every device runs."""

    name: str = Field(
        "vit-b16",
        description="a model of tracevq.config: vit-b16, vivit-b, vit-tiny, vivit-tiny, "
        "vit-digits, vit-digit-pairs, vit-glyphs",
    )
    checkpoint: str | None = Field(
        None,
        min_length=1,
        description="trained weights (.pth, .pt, .safetensors; timm's names), relative to the "
        "working directory; without it the weights are random (seeded): latency needs no "
        "trained weights, accuracy does",
    )
    seed: int = Field(0, ge=0, description="the seed of the random weights")

    _known = field_validator("name")(known_model_name)


class DevicesSection(Strict):
    """The devices: how many, and each one's share of the host."""

    count: list[int] = Field(
        default_factory=lambda: [2],
        description="P, the device counts swept (a number or a list); devices start once per count",
    )
    cpus: float = Field(
        1.0,
        gt=0,
        le=1024,
        description="CPUs per device (pinned whole cores where the host has enough, else a "
        "quota); at most the host's own",
    )
    memory_mb: int = Field(2048, ge=128, le=1_048_576, description="memory per device")
    oversubscribe: bool = Field(
        False,
        description="let one device ask for more CPUs than the host has (then they share its "
        "cores); devices that together ask for more are allowed anyway, and recorded as "
        "oversubscribed",
    )

    _list = field_validator("count", mode="before")(_as_list)

    @field_validator("count")
    @classmethod
    def _in_range(cls, counts: list[int]) -> list[int]:
        if not counts or any(not 1 <= c <= MAX_DEVICES for c in counts):
            raise ValueError(f"every device count must be in 1..{MAX_DEVICES}, got {counts}")
        return _distinct(counts, "device count")


DEFAULT_RATE_MBIT = 10.0


PER_DEVICE = (
    "a mapping device rank -> Mbit/s ({0: 2.0, 3: 5.0}) or a list by rank ([2.0, 10.0]); a "
    "given rate replaces the swept bandwidth_mbit for that device, the same in every trial "
    "(a replayed trace scales it with the trace's rate); ranks beyond a trial's device count "
    "are unused in it"
)


class LinkSection(Strict):
    """The devices' links: their shape (a profile), their rates, what emulates them."""

    profile: str = Field(
        "ideal",
        min_length=1,
        description="a link profile: a name in netem_profiles/ (ideal, wifi, lte, ...) or a "
        "YAML file's path; see Link profiles below",
    )
    bandwidth_mbit: list[float] | None = Field(
        None,
        description="the swept rates, every device's uplink (a number or a list; default 10, "
        "tc's Mbit: 10^6 bit/s of whole frames); leave out with a trace, which gives them",
    )
    trace: str | None = Field(
        None,
        min_length=1,
        description="a bandwidth trace replayed on every device's links during each session "
        "instead of a constant rate: a file in netem_profiles/ or a path; a CSV `t_s,mbit` or "
        "Mahimahi's packet-delivery format (`.mahimahi`), looped. The trials' bandwidth_mbit "
        "is its time-weighted mean; every inference records the rate in force at its start",
    )
    trace_stretch: float = Field(
        1.0, gt=0, le=1000, description="play the trace this many times slower"
    )
    probe_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="traffic per rate probe after every shaping, in seconds at the target "
        "rate (timed after its first tenth)",
    )
    emulator: str | None = Field(
        None,
        min_length=1,
        description="what shapes the links, an emulator of the table below (serial, tbf); "
        "default: the backend's (serial, except on ssh boards: tbf)",
    )
    uplink_mbit: dict[int, float] = Field(
        default_factory=dict, description="what each named device sends at: " + PER_DEVICE
    )
    downlink_mbit: dict[int, float] = Field(
        default_factory=dict,
        description="what each named device receives at (unshaped where not named): " + PER_DEVICE,
    )
    pair_mbit: dict[str, float] = Field(
        default_factory=dict,
        description='per directed pair "SRC->DST": Mbit/s ({"0->1": 2.0}), a cap on what SRC '
        "sends to DST inside SRC's uplink and DST's downlink (the pair gets the least of the "
        "three)",
    )

    _list = field_validator("bandwidth_mbit", mode="before")(_as_list_or_none)

    @field_validator("uplink_mbit", "downlink_mbit", mode="before")
    @classmethod
    def _rates_by_rank(cls, value: Any) -> dict[int, float]:
        if isinstance(value, list):
            value = dict(enumerate(value))
        if not isinstance(value, dict):
            raise ValueError(
                "a mapping device rank -> Mbit/s ({0: 2.0}) or a list of Mbit/s by rank, "
                f"got {value!r}"
            )
        rates = {}
        for key, rate in value.items():
            rank = int(key) if isinstance(key, str) and key.isdigit() else key  # JSON's keys
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise ValueError(f"device {rank!r}: a device is named by its rank (0, 1, ...)")
            rates[rank] = _rate(rate, f"device {rank}")
        return rates

    @field_validator("pair_mbit", mode="before")
    @classmethod
    def _pair_rates(cls, value: Any) -> dict[str, float]:
        if not isinstance(value, dict):
            raise ValueError(f'a mapping "SRC->DST" -> Mbit/s ({{"0->1": 2.0}}), got {value!r}')
        rates = {}
        for key, rate in value.items():
            source, target = _pair(key)
            rates[f"{source}->{target}"] = _rate(rate, f"pair {key}")
        return rates

    def pairs(self) -> dict[tuple[int, int], float]:
        """`pair_mbit` by (sending rank, receiving rank)."""
        return {_pair(key): rate for key, rate in self.pair_mbit.items()}

    def ranks_named(self) -> dict[str, list[int]]:
        """Every rank each per-device field names (pairs: both ends)."""
        pair_ranks = sorted({rank for pair in self.pairs() for rank in pair})
        return {
            "uplink_mbit": sorted(self.uplink_mbit),
            "downlink_mbit": sorted(self.downlink_mbit),
            "pair_mbit": pair_ranks,
        }

    @field_validator("bandwidth_mbit")
    @classmethod
    def _in_range(cls, rates: list[float] | None) -> list[float] | None:
        if rates is None:
            return None
        low, high = RATE_RANGE_MBIT
        wrong = [r for r in rates if not low <= r <= high]
        if not rates or wrong:
            raise ValueError(
                f"every bandwidth must be positive, in {low:g}..{high:,.0f} Mbit/s; "
                f"got {wrong[0] if wrong else 'none'}"
            )
        return _distinct(rates, "bandwidth")

    @model_validator(mode="after")
    def _trace_or_rates(self) -> LinkSection:
        if self.trace is not None and self.bandwidth_mbit is not None:
            raise ValueError(
                "link.bandwidth_mbit: a trace gives the rates (link.trace); leave "
                "bandwidth_mbit out"
            )
        return self

    @field_validator("profile")
    @classmethod
    def _profile_name(cls, profile: str) -> str:
        looks_like_path = "/" in profile or profile.endswith((".yaml", ".yml"))
        return profile if looks_like_path else check_slug(profile, "profile name")


def _rate(rate: Any, where: str) -> float:
    """A per-device or per-pair rate: a finite number of Mbit/s in RATE_RANGE_MBIT."""
    low, high = RATE_RANGE_MBIT
    number = isinstance(rate, int | float) and not isinstance(rate, bool)
    if not number or not math.isfinite(rate) or not low <= rate <= high:
        raise ValueError(
            f"{where}: a rate is a number of Mbit/s in {low:g}..{high:,.0f}, got {rate!r}"
        )
    return float(rate)


PAIR_PATTERN = re.compile(r"^\s*(\d+)\s*->\s*(\d+)\s*$")


def _pair(key: Any) -> tuple[int, int]:
    """'0->1' -> (0, 1): a directed pair of distinct device ranks."""
    found = PAIR_PATTERN.match(key) if isinstance(key, str) else None
    if found is None:
        raise ValueError(
            f'pair {key!r}: a pair is written "SRC->DST" with device ranks, e.g. "0->1"'
        )
    source, target = int(found.group(1)), int(found.group(2))
    if source == target:
        raise ValueError(f"pair {key!r}: a device does not send to itself")
    return source, target


class BundleSection(Strict):
    """Where codebooks come from: a bundle file, or fitted by k-means on calibration inputs."""

    path: str | None = Field(
        None,
        min_length=1,
        description="a bundle file (what `python -m tracevq.fit` or the accuracy study "
        "writes), relative to the working directory; without it the codebooks are fitted "
        "and cached",
    )
    K: int | None = Field(
        None, ge=2, le=65536, description="codewords to fit; default: each K a method asks for"
    )
    calibration_inputs: int = Field(
        8, ge=1, le=100_000, description="seeded random inputs whose activations k-means fits"
    )
    code_dim: int | None = Field(
        None, ge=1, description="the quantisers' projection d_q (default: none)"
    )
    metric: Literal["euclidean", "cosine", "frequency"] = Field(
        "euclidean", description="the distance of the codebook trees' k-medoids"
    )
    seed: int = Field(0, ge=0, description="the seed of the fit")


class EvaluationSection(Strict):
    """Labelled inputs to run through the distributed workers: a .pt file holding
    {"inputs": (N, C, [T,] H, W), "labels": (N,)} already normalised as the model expects
    (`python -m tracevq.train` writes one next to its checkpoint and bundle). The trials then
    run the first `limit` inputs (all by default), cut to whole batches, instead of
    `repeats` generated inputs, and record the correct predictions."""

    inputs: str = Field(min_length=1, description="the .pt file, relative to the working directory")
    limit: int | None = Field(None, ge=1, description="the first inputs to run (default: all)")


class ReportSection(Strict):
    """What the answer and the figures set beside the measurements
    (testbed.results.level_accuracy)."""

    level_accuracy: str | None = Field(
        None,
        min_length=1,
        description="the accuracy study's per-level table (results/accuracy/<task>/"
        "table7_levels.csv or results.csv), relative to the working directory: every Trace "
        "row gets the study's top-1 at the level it used",
    )
    variant: str | None = Field(
        None,
        min_length=1,
        description="the table's rows to take (kmeans, ema, ...); default: the one fine-tuned "
        "variant for a given bundle.path, else kmeans",
    )

    @field_validator("variant")
    @classmethod
    def _of_a_table(cls, variant: str | None, info: ValidationInfo) -> str | None:
        if variant is not None and info.data.get("level_accuracy") is None:
            raise ValueError("names a variant of report.level_accuracy, which is not given")
        return variant


class Experiment(Strict):
    """An experiment: what runs where, over which links, how often."""

    name: str = Field(description="its name, a slug: the results go to results/<name>/")
    description: str = Field("", description="free text, kept with the results")
    model: ModelSection = ModelSection()
    devices: DevicesSection = DevicesSection()
    backend: str = Field(
        "auto",
        min_length=1,
        description="where devices live: a backend of the table below, or auto (docker when "
        "an engine answers, else local)",
    )
    inventory: Inventory | None = Field(
        None,
        description="the boards of a backend that needs them (ssh): a YAML file's path, or "
        "inline; see Inventory below",
    )
    link: LinkSection = LinkSection()
    methods: list[dict[str, Any]] = Field(
        description="the method variants: each a mapping with a `name` and its parameters "
        "(see Methods below); a list anywhere in an entry expands into a grid",
    )
    bundle: BundleSection = BundleSection()
    batch: int = Field(1, ge=1, le=4096, description="inputs per inference")
    repeats: int = Field(
        3,
        ge=1,
        le=100_000,
        description="measured inferences per trial, interleaved across the trials of a session",
    )
    warmup: int = Field(1, ge=0, le=10_000, description="unmeasured inferences first")
    evaluation: EvaluationSection | None = Field(
        None, description="labelled inputs instead of generated ones (accuracy per trial)"
    )
    report: ReportSection = ReportSection()
    timeout_s: float = Field(
        600.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="per trial: a session gets this times its trials before its workers are killed",
    )

    _inventory = field_validator("inventory", mode="before")(inventory_input)

    @field_validator("name")
    @classmethod
    def _slug(cls, name: str) -> str:
        return check_slug(name, "experiment name")

    @model_validator(mode="before")
    @classmethod
    def _grid_bounded(cls, data: Any) -> Any:
        """Refuses a grid too large to run before it is expanded (YAML aliases can make a
        four-line file name 10^9 trials)."""
        trials = grid_size(data)
        if trials > MAX_TRIALS:
            raise ValueError(
                f"methods: the grid (devices.count x link.bandwidth_mbit x method variants) "
                f"has {trials:,} trials; at most {MAX_TRIALS:,} per experiment"
            )
        return data

    @model_validator(mode="after")
    def _methods_valid(self) -> Experiment:
        if not self.methods:
            raise ValueError("methods: at least one method is needed")
        seen: dict[str, int] = {}
        for index, entry in enumerate(self.methods):
            for variant in expand_method(entry, index):
                _check_method(variant, index)
                key = repr(sorted(variant.items()))
                if key in seen:
                    where = "" if seen[key] == index else f" (as methods[{seen[key]}])"
                    raise ValueError(
                        f"methods[{index}]: the variant {_short(variant)} is listed twice"
                        f"{where}; each trial must be distinct"
                    )
                seen[key] = index
                if self.bundle.path is None:  # a given bundle's tree is checked when loaded
                    _check_level(variant, index)
        _check_devices_fit(self.devices.count, self.model.name)
        _check_ranks(self.link, max(self.devices.count))
        return self

    def method_variants(self) -> list[dict[str, Any]]:
        """Every method entry with its list-valued parameters expanded into a grid."""
        return [v for i, entry in enumerate(self.methods) for v in expand_method(entry, i)]


def _short(variant: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" if k != "name" else str(v) for k, v in variant.items())


def expand_method(entry: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(entry, dict) or "name" not in entry:
        raise ValueError(f"methods[{index}]: needs a 'name' (e.g. {{name: trace-b, K: 1024}})")
    keys = list(entry)
    values = [_as_list(entry[k]) for k in keys]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def _length(value: Any) -> int:
    return len(value) if isinstance(value, list) else 1


def grid_size(data: Any) -> int:
    """Trials the raw experiment mapping would expand into (0 where its shape is wrong)."""
    if not isinstance(data, dict):
        return 0
    devices, link, methods = data.get("devices"), data.get("link"), data.get("methods")
    counts = _length(devices.get("count")) if isinstance(devices, dict) else 1
    rates = _length(link.get("bandwidth_mbit")) if isinstance(link, dict) else 1
    entries = methods if isinstance(methods, list) else []
    variants = sum(
        math.prod(_length(value) for value in entry.values())
        for entry in entries
        if isinstance(entry, dict)
    )
    return counts * rates * variants


def _check_method(variant: dict[str, Any], index: int) -> None:
    from tracevq.errors import ConfigError as TraceConfigError

    if not isinstance(variant["name"], str):
        raise ValueError(
            f"methods[{index}].name: a method's name is text such as 'trace-b', "
            f"got {variant['name']!r}"
        )
    params = {k: v for k, v in variant.items() if k != "name"}
    for key, value in params.items():
        if isinstance(value, bool) and key not in FLAG_PARAMS:
            raise ValueError(f"methods[{index}].{key}: takes a number, got {value!r}")
    try:
        method_spec(variant["name"], **params)
    except TraceConfigError as error:
        field = f".{error.field}" if error.field else ""
        raise ValueError(f"methods[{index}]{field}: {error}") from None


def variant_spec(variant: dict[str, Any]) -> MethodSpec:
    """The method spec of one expanded method entry ({"name": ..., parameters ...})."""
    return method_spec(variant["name"], **{k: v for k, v in variant.items() if k != "name"})


def _check_level(variant: dict[str, Any], index: int) -> None:
    """A trace method's `level_k` and `level_min_k` must be levels of the tree fitted over
    its K codewords."""
    spec = variant_spec(variant)
    if not spec.is_trace:
        return
    levels = level_sizes_for(spec.K, FITTED_BRANCHING)
    for field, size in (("level_k", spec.level_k), ("level_min_k", spec.level_min_k)):
        if size not in (None, "auto") and size not in levels:
            raise ValueError(
                f"methods[{index}].{field}: {size} is not a level of the K={spec.K} codebook "
                f"tree (branching {FITTED_BRANCHING}); its levels are "
                f"{', '.join(map(str, levels))}"
            )


def _check_devices_fit(counts: list[int], model: str) -> None:
    tokens = model_config(model).tokens
    if max(counts) > tokens:
        raise ValueError(
            f"devices.count: {max(counts)} devices, but {model} has {tokens} tokens to split "
            f"among them (at most {tokens} devices)"
        )


def _check_ranks(link: LinkSection, most_devices: int) -> None:
    """Every device a per-device rate names is in the largest trial."""
    for field, ranks in link.ranks_named().items():
        missing = [rank for rank in ranks if rank >= most_devices]
        if missing:
            raise ValueError(
                f"link.{field}: device {missing[0]} does not exist: devices.count is at most "
                f"{most_devices} (ranks 0..{most_devices - 1})"
            )


def parse_experiment(data: Any, source: str = "<experiment>") -> Experiment:
    if data is None:
        raise ConfigError(f"{source}: empty; an experiment needs at least `name:` and `methods:`")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: an experiment is a mapping of keys, got {type(data).__name__}"
        )
    try:
        return Experiment.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"{source}: " + describe(error, Experiment)) from None


def load_experiment(path: str | Path) -> Experiment:
    """Reads and validates an experiment file; every problem a one-line `ConfigError`."""
    path = Path(path)
    return parse_experiment(load_yaml(path, "experiment file"), str(path))
