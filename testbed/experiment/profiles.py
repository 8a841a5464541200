"""Link profiles: what a shaped link looks like, one YAML file per profile in `netem_profiles/`.

A profile knows its rate (optional: a sweep usually supplies the rate, and the profile's own
rate is the default), the impairments netem would add (delay, jitter, loss), the token-bucket
burst it wants at least, and the queueing latency it tolerates (the tbf latency bound). It does
not know how it is applied: `testbed.kernel.shaping` turns a profile into qdisc parameters.

Loading validates the file against `LinkProfile`: unknown keys are rejected with a "did you
mean" hint, and every error is a `ConfigError` naming the file and the field.
"""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from testbed.errors import ConfigError
from testbed.experiment.strict import Strict, describe
from testbed.experiment.yamlfile import load_yaml
from testbed.source import PROFILES_DIR

log = logging.getLogger(__name__)

PROFILE_SUFFIX = ".yaml"


class LinkProfile(Strict):
    """One link's shape. Rates follow tc's convention: 1 mbit = 10^6 bit/s."""

    name: str = Field(min_length=1, description="default: the file's name")
    description: str = Field("", description="what link it stands for, in a sentence")
    rate_mbit: float | None = Field(
        default=None, ge=0.01, le=10_000, description="its rate where the sweep gives none"
    )
    delay_ms: float = Field(default=0.0, ge=0, le=60_000, description="one-way delay (netem)")
    jitter_ms: float = Field(default=0.0, ge=0, le=60_000, description="delay jitter (netem)")
    loss_pct: float = Field(default=0.0, ge=0, le=100, description="random loss (netem)")
    burst_bytes: int | None = Field(
        default=None, gt=0, le=1 << 30, description="a larger tbf bucket than two full frames"
    )
    queue_latency_ms: float = Field(
        default=50.0, gt=0, le=60_000, description="the queue's bound, as tc's tbf latency"
    )

    @property
    def needs_netem(self) -> bool:
        """Whether the profile asks for an impairment only `sch_netem` can emulate."""
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0


def available_profiles(directory: Path = PROFILES_DIR) -> list[str]:
    """Names of the profiles in `directory` (file names without `.yaml`), sorted."""
    return sorted(path.stem for path in Path(directory).glob(f"*{PROFILE_SUFFIX}"))


def load_profile(name_or_path: str | Path, directory: Path = PROFILES_DIR) -> LinkProfile:
    """Loads a profile by name (`directory/<name>.yaml`) or from a YAML file's path.

    Raises:
        ConfigError: unknown name (the message lists the available ones), unreadable or
            invalid YAML, or a field that fails validation (the message names file and field).
    """
    path = _resolve(name_or_path, Path(directory))
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


def _resolve(name_or_path: str | Path, directory: Path) -> Path:
    text = str(name_or_path)
    looks_like_path = (
        isinstance(name_or_path, Path) or "/" in text or text.endswith((".yaml", ".yml"))
    )
    if looks_like_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"{path}: link profile file not found")
        return path
    path = directory / f"{text}{PROFILE_SUFFIX}"
    if path.is_file():
        return path
    names = available_profiles(directory)
    hint = _did_you_mean(text, names)
    listed = ", ".join(names) or "none"
    raise ConfigError(f"unknown link profile '{text}'{hint}; available in {directory}: {listed}")


def _did_you_mean(word: str, candidates: list[str]) -> str:
    matches = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""
