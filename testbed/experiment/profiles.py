"""Link profiles: what a shaped link looks like, one YAML file per profile in `netem_profiles/`.

A profile knows its rate (optional: a sweep usually supplies the rate, and the profile's own
rate is the default), the impairments netem would add (delay, jitter, loss), the token-bucket
burst it wants at least, and the queueing latency it tolerates (the tbf latency bound). It does
not know how it is applied: `testbed.kernel.shaping` turns a profile into qdisc parameters.

Loading validates the file against `LinkProfile`: unknown keys are rejected with a "did you
mean" hint, and every error is a `ConfigError` naming the file and the field.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from testbed.errors import ConfigError
from testbed.experiment.netem_parameters import NAMES as IMPAIRMENTS
from testbed.experiment.netem_parameters import ImpairmentError, checked, dilated, impaired
from testbed.experiment.strict import Strict, describe
from testbed.experiment.yamlfile import load_yaml, named_file, names_in
from testbed.source import PROFILES_DIR

log = logging.getLogger(__name__)

LOSS_MODELS = {"loss_pct", "loss_gemodel", "loss_state"}  # a variant naming one replaces them
# what needs a delay (netem's jitter and reordering): a variant that sets the delay to 0
# drops the profile's, except what it names itself
NEEDS_DELAY = (
    "jitter_ms",
    "delay_correlation_pct",
    "delay_distribution",
    "reorder_pct",
    "reorder_correlation_pct",
    "reorder_gap",
)


class GeModel(Strict):
    """netem's `loss gemodel p r 1-h 1-k` (tc's defaults where left out)."""

    p_pct: float = Field(description="good -> bad per frame")
    r_pct: float | None = Field(None, description="bad -> good per frame (default 100 - p)")
    one_minus_h_pct: float | None = Field(None, description="loss in the bad state (100)")
    one_minus_k_pct: float | None = Field(None, description="loss in the good state (0)")


class StateModel(Strict):
    """netem's `loss state p13 p31 p32 p23 p14` (tc's defaults where left out)."""

    p13_pct: float = Field(description="gap -> burst (a loss) per frame")
    p31_pct: float | None = Field(None, description="burst -> gap (default 100 - p13)")
    p32_pct: float | None = Field(None, description="lost -> sent within a burst (0)")
    p23_pct: float | None = Field(None, description="sent -> lost within a burst (100)")
    p14_pct: float | None = Field(None, description="an isolated loss in a gap (0)")


class LinkProfile(Strict):
    """One link's shape. Rates follow tc's convention: 1 mbit = 10^6 bit/s. Impairments are
    netem's (tc-netem(8)), each device's on what it sends, so a round trip sees the delay
    twice; the serial emulator draws them itself, tbf needs the kernel's `sch_netem`."""

    name: str = Field(min_length=1, description="default: the file's name")
    description: str = Field("", description="what link it stands for, in a sentence")
    rate_mbit: float | None = Field(
        default=None, ge=0.01, le=10_000, description="its rate where the sweep gives none"
    )
    delay_ms: float = Field(default=0.0, description="one-way delay")
    jitter_ms: float = Field(default=0.0, description="the delay's jitter, about it")
    delay_correlation_pct: float = Field(
        default=0.0, description="each delay's weight on the last one (netem's correlation)"
    )
    delay_distribution: str = Field(
        default="uniform", description="the jitter's: uniform, normal, pareto or paretonormal"
    )
    loss_pct: float = Field(default=0.0, description="random loss")
    loss_correlation_pct: float = Field(default=0.0, description="its correlation")
    loss_gemodel: GeModel | None = Field(
        default=None, description="Gilbert-Elliott loss instead (below)"
    )
    loss_state: StateModel | None = Field(
        default=None, description="4-state Markov loss instead (below)"
    )
    duplicate_pct: float = Field(default=0.0, description="frames sent twice")
    duplicate_correlation_pct: float = Field(default=0.0, description="its correlation")
    reorder_pct: float = Field(default=0.0, description="frames that skip the delay")
    reorder_correlation_pct: float = Field(default=0.0, description="its correlation")
    reorder_gap: int = Field(
        default=0, description="every gap-th frame may be reordered (default 1 with reorder)"
    )
    seed: int = Field(
        default=0,
        ge=0,
        description="what the serial emulator's draws start from (with the device count, "
        "the rate and the device): the same seed, the same realisation",
    )
    medium: Literal["dedicated", "shared"] = Field(
        default="dedicated",
        description="dedicated: a line per device, its frames alone on it; shared: one cell "
        "for every device's frames, data and acknowledgements, taking turns frame by frame "
        "(the serial emulator; see Shared medium)",
    )
    airtime_us: float = Field(
        default=0.0,
        ge=0,
        le=100_000,
        description="on a shared medium, what each frame adds to its wire time: preamble, "
        "MAC headers, the gap before and the acknowledgement after it (microseconds)",
    )
    burst_bytes: int | None = Field(
        default=None, gt=0, le=1 << 30, description="a larger tbf bucket than two full frames"
    )
    queue_latency_ms: float = Field(
        default=50.0, gt=0, le=60_000, description="the queue's bound, as tc's tbf latency"
    )

    @model_validator(mode="after")
    def _airtime_shared(self) -> LinkProfile:
        if self.airtime_us and self.medium != "shared":
            raise ValueError(
                f"airtime_us: {self.airtime_us:g} us of airtime per frame needs medium: shared"
            )
        return self

    @model_validator(mode="after")
    def _impairments_valid(self) -> LinkProfile:
        try:
            checked(self.impairments())
        except ImpairmentError as error:
            raise ValueError(str(error)) from None
        return self

    def impairments(self) -> dict[str, Any]:
        """The profile's netem parameters (testbed.experiment.netem_parameters), as written."""
        return self.model_dump(include=set(IMPAIRMENTS), exclude_none=True)

    def with_impairments(self, variant: dict[str, Any]) -> LinkProfile:
        """This profile with a variant's impairments (and medium, link.medium) laid over its
        own; a variant that names a loss model (loss_pct, loss_gemodel, loss_state) replaces
        the profile's, one that sets delay_ms to 0 drops the profile's jitter and reordering
        (NEEDS_DELAY: no delay, nothing to jitter or reorder) where it does not name them
        itself, and one of medium dedicated drops a shared medium's airtime. Raises
        ImpairmentError naming the parameter where the two do not go together."""
        base = self.model_dump(exclude_none=True)
        if LOSS_MODELS & set(variant):
            for name in (*LOSS_MODELS, "loss_correlation_pct"):
                base.pop(name, None)
        if "delay_ms" in variant and variant["delay_ms"] in (0, None):
            for name in set(NEEDS_DELAY) - set(variant):
                base.pop(name, None)
        if variant.get("medium") == "dedicated":  # a line each has no per-frame airtime
            base.pop("airtime_us", None)
        merged = {**base, **variant}
        checked({k: v for k, v in merged.items() if k in IMPAIRMENTS})
        return LinkProfile.model_validate(merged)

    def dilated(self, factor: float) -> LinkProfile:
        """The profile on the host's clock in a session of dilation `factor`: every time in
        it (delay, jitter, airtime, the queue's bound) `factor` times as long."""
        if factor == 1:
            return self
        times = {name: getattr(self, name) * factor for name in ("airtime_us", "queue_latency_ms")}
        return self.model_copy(update={**dilated(self.impairments(), factor), **times})

    @property
    def needs_netem(self) -> bool:
        """Whether the profile asks for any impairment (netem's work)."""
        return impaired(checked(self.impairments()))


def available_profiles(directory: Path = PROFILES_DIR) -> list[str]:
    """Names of the profiles in `directory` (file names without `.yaml`), sorted."""
    return names_in(directory)


def load_profile(name_or_path: str | Path, directory: Path = PROFILES_DIR) -> LinkProfile:
    """Loads a profile by name (`directory/<name>.yaml`) or from a YAML file's path.

    Raises:
        ConfigError: unknown name (the message lists the available ones), unreadable or
            invalid YAML, or a field that fails validation (the message names file and field).
    """
    path = named_file(name_or_path, Path(directory), "link profile")
    data = load_yaml(path, "link profile")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a link profile must be a mapping, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    profile = parse_profile(data, source=str(path))
    log.debug("loaded link profile %s from %s", profile.name, path)
    return profile


def parse_profile(data: dict[str, Any], source: str = "<link profile>") -> LinkProfile:
    """Validates a mapping (from a file, or inline in an experiment) as a `LinkProfile`."""
    try:
        return LinkProfile.model_validate(data)
    except ValidationError as error:
        problems = describe(error, LinkProfile)
        raise ConfigError(f"{source}: invalid link profile: {problems}") from None
