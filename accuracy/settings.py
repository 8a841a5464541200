"""The study configuration: typed, unknown keys rejected with a hint, errors naming the field
path and the file. Loaded in one place (`load_settings`); the resolved form is saved with the
results (`settings.yaml` in the output directory). The methods a field may name are the method
table's (`tracevq.method_table`): its codebook methods, or its Trace methods.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tracevq.config import known_model_name, model_config
from tracevq.errors import ConfigError
from tracevq.fields import field_path, model_at
from tracevq.method_table import codebook_methods, methods_accepting, trace_methods
from tracevq.placement import PLACEMENTS

TASKS = ("digits", "pairs", "glyphs", "cifar", "folder", "fashion")


def _among(names: list[str], choices: list[str], kind: str) -> list[str]:
    """`names`, each one of `choices` (methods of the table, `kind` says which)."""
    for name in names:
        if name not in choices:
            hint = difflib.get_close_matches(str(name), choices, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ValueError(
                f"{name!r} is not a {kind}{suggestion}; choose from {', '.join(choices)}"
            )
    return names


def _codebook_methods(names: list[str]) -> list[str]:
    return _among(names, codebook_methods(), "codebook method")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataSection(Strict):
    """Which images. `path` is required for cifar (the batch folder) and folder (the root);
    fashion reads Debian's dataset-fashion-mnist unless `path` names another folder of its
    four files. test_size is the digits task's and the generated tasks' (fashion tests on
    its published 10,000)."""

    task: Literal["digits", "pairs", "glyphs", "cifar", "folder", "fashion"] = "digits"
    path: str | None = None
    train_size: int = Field(4000, ge=1)  # pairs and glyphs only: generated training images
    glyphs: int = Field(8, ge=2, le=64)  # glyphs only: prototypes (classes = glyphs^2)
    val_size: int = Field(200, ge=1)
    test_size: int = Field(400, ge=1)
    split_seed: int = 0
    mean: float = 0.5  # model input = (image - mean) / std, image in [0, 1]
    std: float = Field(0.5, gt=0)


class ModelSection(Strict):
    name: str = "vit-digits"
    # trained weights (timm's or Hugging Face's, see tracevq.checkpoint): the base model, no
    # training; checkpoint_ema takes a training checkpoint's EMA weights
    checkpoint: str | None = None
    checkpoint_ema: bool = False

    _known = field_validator("name")(known_model_name)


class BaseSection(Strict):
    """Training the single-device model from scratch (skipped with model.checkpoint)."""

    epochs: int = Field(40, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.05, ge=0)
    warmup_epochs: int = Field(3, ge=0)
    shift_px: int = Field(1, ge=0)  # random translation augmentation
    flip: bool = False  # half the images mirrored left-right (clothes, not digits)
    label_smoothing: float = Field(0.1, ge=0, lt=1)
    seed: int = 0


class RuleSection(Strict):
    """A codebook update rule (Table VIII); `code_dim` is the d_q projection (None: off)."""

    update: Literal["ema", "gradient"] = "ema"
    decay: float = Field(0.99, gt=0, lt=1)
    epsilon: float = Field(1e-5, gt=0)
    dead_fraction: float = Field(0.03, ge=0, lt=1)
    commitment: float = Field(0.25, ge=0)
    noise: float = Field(0.0, ge=0)  # Astra's noise-augmented quantisation (lambda); 0: off
    code_dim: int | None = Field(None, ge=1)
    # the families this rule is tried for besides the first rule (None: finetune.rule_families);
    # a rule that names its families is their own recipe and shows in Table III
    families: list[str] | None = None

    @field_validator("families")
    @classmethod
    def _families(cls, names: list[str] | None) -> list[str] | None:
        return None if names is None else _codebook_methods(names)


class CodebookSection(Strict):
    K: list[int] = Field(default_factory=lambda: [64, 1024])
    families: list[str] = Field(default_factory=codebook_methods)
    calibration_images: int = Field(256, ge=1)  # k-means initialisation rows come from these
    kmeans_iterations: int = Field(20, ge=1)  # Lloyd iterations after k-means++
    branching: int = Field(2, ge=2)
    metrics: list[Literal["euclidean", "cosine", "frequency"]] = Field(
        default_factory=lambda: ["euclidean", "cosine", "frequency"]
    )
    # Trace's Table VI cases (tracevq.placement) each trace family is run at; a family with
    # none listed runs at its default (trace-nb "1 A.i", trace-b "2 B")
    placements: list[str] = Field(default_factory=list)
    # trace-nb cases of `placements` also run with the receiver's FFN on its copy
    # (`remote_ffn`; at "1 B" the Trace-nb of before placements), the other reading of Table VI
    remote_ffn_placements: list[str] = Field(default_factory=list)
    evaluate_kmeans: bool = True  # False: only the fine-tuned codebooks are evaluated

    _families = field_validator("families")(_codebook_methods)

    @field_validator("placements")
    @classmethod
    def _placements(cls, names: list[str]) -> list[str]:
        unknown = [n for n in names if n not in PLACEMENTS]
        if unknown:
            raise ValueError(f"unknown placement {unknown[0]!r}; known: {', '.join(PLACEMENTS)}")
        if len(set(names)) != len(names):
            raise ValueError("a placement is listed twice")
        return names

    @field_validator("K")
    @classmethod
    def _sizes(cls, sizes: list[int]) -> list[int]:
        if not sizes or any(not 2 <= k <= 2**16 for k in sizes):
            raise ValueError("every K must lie in 2..65536")
        return sizes


class DistillSection(Strict):
    """Distillation from the frozen base model: the loss against the labels weighs 1 - weight,
    the teacher's softened distribution (temperature T; KL scaled by T^2) weighs `weight`."""

    temperature: float = Field(2.0, gt=0)
    weight: float = Field(0.5, ge=0, le=1)


class FinetuneSection(Strict):
    """VQ fine-tuning in the differentiable P-device forward (a P drawn per step)."""

    K: list[int] = Field(default_factory=lambda: [1024])  # sizes fine-tuned (others k-means)
    steps: int = Field(60, ge=0)
    epochs: float | None = Field(None, gt=0)  # instead of steps: passes over the training split
    batch_size: int = Field(64, ge=1)
    lr: float = Field(5e-4, gt=0)
    codebook_lr: float | None = Field(None, gt=0)  # gradient codebooks, d_q projections; None: lr
    warmup_steps: int | None = Field(None, ge=0)  # linear warm-up; None: a tenth of the steps
    weight_decay: float = Field(0.05, ge=0)
    # "matrices": weight decay on the weight matrices only, none on norms, biases, the class
    # token, the position embedding and the codebooks; "all": on every parameter
    decay: Literal["all", "matrices"] = "all"
    distill: DistillSection | None = None  # None: the labels only
    # after fine-tuning, each codeword becomes the mean of the final model's calibration rows
    # that choose it (one Lloyd step from the trained codebook; the trees are built after it)
    refresh: bool = False
    devices: list[int] = Field(default_factory=lambda: [2, 3])
    rules: dict[str, RuleSection] = Field(default_factory=lambda: {"ema": RuleSection()})
    rule_families: list[str] = Field(
        default_factory=lambda: ["trace-b"]
    )  # families that also get every rule after the first (Table VIII)
    metric_families: list[str] = Field(
        default_factory=lambda: ["trace-b"]
    )  # families whose default-rule codebooks get trees by every metric (Table VII)

    _families = field_validator("rule_families", "metric_families")(_codebook_methods)

    @property
    def tunes(self) -> bool:
        return self.epochs is not None or self.steps > 0

    def total_steps(self, train_size: int) -> int:
        """The steps: `steps`, or `epochs` passes over `train_size` images in batches."""
        if self.epochs is None:
            return self.steps
        return max(1, math.ceil(self.epochs * train_size / self.batch_size))

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> FinetuneSection:
        if self.epochs is not None and "steps" in self.model_fields_set:
            raise ValueError("give steps or epochs, not both")
        return self

    @field_validator("rules")
    @classmethod
    def _some_rule(cls, rules: dict[str, RuleSection]) -> dict[str, RuleSection]:
        if not rules:
            raise ValueError("at least one rule; the first is the default of every family")
        return rules


class EvaluationSection(Strict):
    devices: list[int] = Field(default_factory=lambda: [2, 3])
    prism_segments: list[int] = Field(default_factory=lambda: [2, 4])
    batch_size: int = Field(500, ge=1)
    all_levels: list[str] = Field(
        default_factory=trace_methods
    )  # evaluated at every tree level (with every metric for finetune.metric_families)
    sweep_kmeans: bool = True  # also sweep the levels of the k-means-only codebooks

    @field_validator("all_levels")
    @classmethod
    def _trace_methods(cls, names: list[str]) -> list[str]:
        return _among(names, trace_methods(), "Trace method (one with tree levels)")

    @field_validator("prism_segments")
    @classmethod
    def _segments(cls, segments: list[int]) -> list[int]:
        if any(s < 1 for s in segments):
            raise ValueError("every Prism segment size must be at least 1")
        return segments


class Settings(Strict):
    name: str
    description: str = ""
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    jobs: int = Field(1, ge=1)  # parallel processes, one torch thread each
    output: str = "results/accuracy"
    data: DataSection = Field(default_factory=DataSection)
    model: ModelSection = Field(default_factory=ModelSection)
    base: BaseSection = Field(default_factory=BaseSection)
    codebooks: CodebookSection = Field(default_factory=CodebookSection)
    finetune: FinetuneSection = Field(default_factory=FinetuneSection)
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection)

    @property
    def run_dir(self) -> Path:
        return Path(self.output) / self.name


def _describe(error: dict[str, Any]) -> str:
    location = tuple(error["loc"])
    if error["type"] == "extra_forbidden":
        model = model_at(Settings, location[:-1])
        known = list(model.model_fields) if model is not None else []
        hint = difflib.get_close_matches(str(location[-1]), known, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        return f"{field_path(location)}: unknown key{suggestion}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{field_path(location)}: {message}" if location else message


def parse_settings(data: Any, source: str = "<settings>", **overrides: Any) -> Settings:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a study is a mapping of keys, got {type(data).__name__}")
    try:
        settings = Settings.model_validate({**data, **overrides})
    except ValidationError as error:
        problems = "; ".join(_describe(e) for e in error.errors())
        raise ConfigError(f"{source}: {problems}") from None
    if settings.data.task in ("cifar", "folder") and settings.data.path is None:
        raise ConfigError(f"{source}: data.path: required for task {settings.data.task!r}")
    with_ffn = methods_accepting("remote_ffn")
    for name in settings.codebooks.remote_ffn_placements:
        if name not in settings.codebooks.placements or PLACEMENTS[name].method not in with_ffn:
            raise ConfigError(
                f"{source}: codebooks.remote_ffn_placements: {name!r} must be a "
                f"{' or '.join(with_ffn)} case listed in codebooks.placements"
            )
    for name in settings.codebooks.placements:
        if PLACEMENTS[name].method not in settings.codebooks.families:
            raise ConfigError(
                f"{source}: codebooks.placements: {name!r} is a {PLACEMENTS[name].method} "
                f"case, but codebooks.families does not list {PLACEMENTS[name].method}"
            )
    if settings.data.task == "glyphs":
        classes = model_config(settings.model.name).num_classes
        if classes != settings.data.glyphs**2:
            raise ConfigError(
                f"{source}: data.glyphs: {settings.data.glyphs} glyphs make "
                f"{settings.data.glyphs**2} classes, model {settings.model.name!r} has {classes}"
            )
    return settings


def load_settings(path: str | Path, **overrides: Any) -> Settings:
    """Read and validate a study file; `overrides` replace top-level keys (e.g. output)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"study file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return parse_settings(data, str(path), **overrides)


def dump_settings(settings: Settings, path: Path) -> None:
    path.write_text(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False))
