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

A backend's own section (`inventory:`, `provider:`, a plug-in's) is no field of `Experiment`:
the experiment is validated by `experiment_model()`, `Experiment` with a field for every
section registered (`testbed.experiment.sections`), and `Experiment.section(key)` reads one.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from testbed.errors import ConfigError
from testbed.experiment.devices_section import DevicesSection
from testbed.experiment.link_section import LinkSection
from testbed.experiment.method_grid import (
    MAX_TRIALS,
    check_device_counts,
    check_level,
    check_method,
    expand_method,
    grid_size,
    short,
)
from testbed.experiment.names import check_slug
from testbed.experiment.sections import SECTIONS, Section
from testbed.experiment.strict import Strict, describe
from testbed.experiment.timeline_section import Event, check_timeline
from testbed.experiment.yamlfile import load_yaml
from tracevq.config import known_model_name, model_config

MAX_TIMEOUT_S = 7 * 24 * 3600.0


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
        description="trained weights, relative to the working directory: a file (.pth, .pt, "
        ".bin, .safetensors) in timm's names or Hugging Face's, a timm training checkpoint, or "
        "a Hugging Face save_pretrained folder (its config.json sets the activation); without "
        "it the weights are random (seeded): latency needs no trained weights, accuracy does",
    )
    checkpoint_ema: bool = Field(
        False,
        description="take the checkpoint's EMA weights (timm's state_dict_ema, DeiT's model_ema)",
    )
    seed: int = Field(0, ge=0, description="the seed of the random weights")

    _known = field_validator("name")(known_model_name)


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
    (`python -m accuracy` writes one next to its checkpoint and bundle). The trials then
    run the first `limit` inputs (all by default), cut to whole batches, instead of
    `repeats` generated inputs, and record the correct predictions."""

    inputs: str = Field(min_length=1, description="the .pt file, relative to the working directory")
    limit: int | None = Field(None, ge=1, description="the first inputs to run (default: all)")


class ReportSection(Strict):
    """What the answer and the figures set beside the measurements
    (testbed.experiment.level_accuracy)."""

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


DEFAULT_DILATION = 1.0
MAX_DILATION = 100.0


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
    dilation: float | Literal["auto"] = Field(
        DEFAULT_DILATION,
        description="virtual time: every session runs d times slower on the host (link rates "
        "/ d, delays, timeouts and the devices' compute x d) and its rows are divided back "
        "by d, so that devices faster than the host, or more than its cores, keep their "
        "own time; a number >= 1 or auto (the smallest d that leaves the fleet the host's "
        "safe load; docs/devices.md, Virtual time)",
    )
    timeline: list[Event] = Field(
        default_factory=list,
        description="what happens to a device during every session: each event at_s (seconds "
        "from the session's first measured inference) or at_inference, on a device, one of "
        "speed, pause_s, leave, link (see Event below; docs/devices.md)",
    )

    @field_validator("dilation")
    @classmethod
    def _dilation(cls, value: float | str) -> float | str:
        if value != "auto" and not 1 <= float(value) <= MAX_DILATION:
            raise ValueError(
                f"{value!r} is no dilation: a number in 1..{MAX_DILATION:g} (1: real time) or auto"
            )
        return value

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
                check_method(variant, index)
                check_device_counts(variant, index, self.devices.count)
                if "level_min_accuracy" in variant and self.report.level_accuracy is None:
                    raise ValueError(
                        f"methods[{index}].level_min_accuracy: needs report.level_accuracy, the "
                        "accuracy study's table its level is chosen from"
                    )
                key = repr(sorted(variant.items()))
                if key in seen:
                    where = "" if seen[key] == index else f" (as methods[{seen[key]}])"
                    raise ValueError(
                        f"methods[{index}]: the variant {short(variant)} is listed twice"
                        f"{where}; each trial must be distinct"
                    )
                seen[key] = index
                if self.bundle.path is None:  # a given bundle's tree is checked when loaded
                    check_level(variant, index)
        _check_devices_fit(self.devices.count, self.model.name)
        most = max(self.devices.count)
        _check_ranks({f"link.{f}": r for f, r in self.link.ranks_named().items()}, most)
        _check_ranks(self.devices.ranks_named(), most)
        _check_partitions(self.devices, self.model.name)
        inferences = self.repeats if self.evaluation is None else None  # batches: not known
        check_timeline(self.timeline, most, inferences, self.timeout_s)
        return self

    def method_variants(self) -> list[dict[str, Any]]:
        """Every method entry with its list-valued parameters expanded into a grid."""
        return [v for i, entry in enumerate(self.methods) for v in expand_method(entry, i)]

    def section(self, key: str | None) -> Section | None:
        """A backend's section (`Backend.settings` names it), or None where the file gives
        none or no section has that key."""
        return None if key is None else getattr(self, key, None)


def experiment_model() -> type[Experiment]:
    """`Experiment` with a field for every backend's section registered so far (each None
    unless given), which is what validates an experiment file."""
    return _with_sections(tuple(SECTIONS.values()))


@functools.cache
def _with_sections(sections: tuple[type[Section], ...]) -> type[Experiment]:
    fields: dict[str, Any] = {
        kind.section: (
            Annotated[kind | None, BeforeValidator(kind.given)],
            Field(None, description=kind.about),
        )
        for kind in sections
    }
    return create_model("Experiment", __base__=Experiment, __module__=__name__, **fields)


def _check_devices_fit(counts: list[int], model: str) -> None:
    tokens = model_config(model).tokens
    if max(counts) > tokens:
        raise ValueError(
            f"devices.count: {max(counts)} devices, but {model} has {tokens} tokens to split "
            f"among them (at most {tokens} devices)"
        )


def _check_ranks(named: dict[str, list[int]], most_devices: int) -> None:
    """Every device a per-device field names (field -> ranks) is in the largest trial."""
    for field, ranks in named.items():
        missing = [rank for rank in ranks if rank >= most_devices]
        if missing:
            raise ValueError(
                f"{field}: device {missing[0]} does not exist: devices.count is at most "
                f"{most_devices} (ranks 0..{most_devices - 1})"
            )


def _check_partitions(devices: DevicesSection, model: str) -> None:
    """A partition given as token counts fits the one device count and the model's tokens."""
    tokens = model_config(model).tokens
    for variant in [devices, *(devices.variants or [])]:
        sizes = variant.partition
        if not isinstance(sizes, list):
            continue
        if devices.count != [len(sizes)]:
            raise ValueError(
                f"devices.partition: {len(sizes)} token counts, but devices.count is "
                f"{devices.count}: a partition given by rank is for one device count"
            )
        if sum(sizes) != tokens:
            raise ValueError(
                f"devices.partition: {sizes} holds {sum(sizes)} tokens, {model} has {tokens}"
            )


def parse_experiment(data: Any, source: str = "<experiment>") -> Experiment:
    if data is None:
        raise ConfigError(f"{source}: empty; an experiment needs at least `name:` and `methods:`")
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: an experiment is a mapping of keys, got {type(data).__name__}"
        )
    model = experiment_model()
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = describe(error, model)
        if "testbed.backends.table" not in sys.modules and any(
            e["type"] == "extra_forbidden" and len(e["loc"]) == 1 for e in error.errors()
        ):  # the backends' own sections (inventory:, provider:) register as they are imported
            problems += " (a backend's section is known once `import testbed.backends.table` ran)"
        raise ConfigError(f"{source}: {problems}") from None


def load_experiment(path: str | Path) -> Experiment:
    """Reads and validates an experiment file; every problem a one-line `ConfigError`."""
    path = Path(path)
    return parse_experiment(load_yaml(path, "experiment file"), str(path))
