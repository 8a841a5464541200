"""The `link` section of an experiment: a profile, the swept rates or a trace, the emulator,
and rates and impairments per device and per pair (`testbed.link.rates` combines the rates
per trial, `testbed.link.paths` the impairments)."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from testbed.experiment.names import check_slug
from testbed.experiment.netem_parameters import ImpairmentError, checked
from testbed.experiment.strict import Strict, as_list_or_none, distinct

RATE_RANGE_MBIT = (0.01, 10_000.0)
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
    medium: list[Literal["dedicated", "shared"]] | None = Field(
        None,
        description="the media swept like the rates (one or a list): dedicated, a line per "
        "device (a switched network); shared, one cell that every device's frames take in "
        "turn (a Wi-Fi channel; the serial emulator only, without per-pair or downlink "
        "rates and impairments); default: the profile's",
    )
    uplink_mbit: dict[int, float] = Field(
        default_factory=dict, description="what each named device sends at: " + PER_DEVICE
    )
    downlink_mbit: dict[int, float] = Field(
        default_factory=dict,
        description="what each named device receives at (unshaped where not named): " + PER_DEVICE,
    )
    impairments: list[dict[str, Any]] | None = Field(
        None,
        description="impairment variants swept like the rates: each a mapping of netem's "
        "parameters (as a link profile names them: delay_ms, jitter_ms, loss_pct, "
        "loss_gemodel, ...) laid over the profile's, e.g. [{delay_ms: 0}, {delay_ms: 20}]; "
        "a variant naming a loss model replaces the profile's, and delay_ms: 0 drops the "
        "profile's jitter and reordering (they need a delay) unless the variant names them",
    )
    uplink_impairments: dict[int, dict[str, Any]] = Field(
        default_factory=dict,
        description="per device rank, netem's parameters laid over the trial's link (profile "
        "and variant) for what that device sends, e.g. {0: {delay_ms: 30, loss_pct: 0.5}}: "
        "one device on LTE, the others on Wi-Fi",
    )
    downlink_impairments: dict[int, dict[str, Any]] = Field(
        default_factory=dict,
        description="per device rank, netem's parameters for what that device receives, a "
        "hop after the sender's uplink (delays add, losses compound), e.g. {1: {delay_ms: 10}}; "
        "drawn by the serial emulator, or netem on the receiver's ifb with tbf",
    )
    pair_impairments: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='per directed pair "SRC->DST", netem\'s parameters for what SRC sends to '
        "DST, a hop between SRC's uplink and DST's downlink, e.g. {\"0->1\": {delay_ms: 40}}: "
        "a pair farther apart than the others; drawn by the serial emulator, or netem as the "
        "leaf of SRC's class for DST with tbf (not beside the uplink's own impairments)",
    )
    pair_mbit: dict[str, float] = Field(
        default_factory=dict,
        description='per directed pair "SRC->DST": Mbit/s ({"0->1": 2.0}), a cap on what SRC '
        "sends to DST inside SRC's uplink and DST's downlink (the pair gets the least of the "
        "three)",
    )

    _list = field_validator("bandwidth_mbit", "medium", mode="before")(as_list_or_none)

    @field_validator("medium")
    @classmethod
    def _distinct_media(cls, media: list[str] | None) -> list[str] | None:
        return None if media is None else distinct(media, "medium")

    @field_validator("impairments")
    @classmethod
    def _impairments_checked(cls, variants: list[dict[str, Any]] | None) -> Any:
        if variants is None:
            return None
        if not variants:
            raise ValueError("give at least one variant, or leave impairments out")
        for index, variant in enumerate(variants):
            try:
                checked(variant, whole=False)  # whole once laid over the profile
            except ImpairmentError as error:
                raise ValueError(f"variant {index}: {error}") from None
        distinct([json.dumps(v, sort_keys=True) for v in variants], "impairment variant")
        return variants

    @field_validator("uplink_impairments", "downlink_impairments", mode="before")
    @classmethod
    def _impairments_by_rank(cls, value: Any, info: ValidationInfo) -> dict[int, dict[str, Any]]:
        if isinstance(value, list):
            value = dict(enumerate(value))
        if not isinstance(value, dict):
            raise ValueError(
                "a mapping device rank -> netem's parameters ({0: {delay_ms: 30}}) or a list "
                f"of them by rank, got {value!r}"
            )
        by_rank = {}
        for key, parameters in value.items():
            rank = rank_of(key)
            if not isinstance(parameters, dict):
                raise ValueError(
                    f"device {rank}: a mapping of netem's parameters, got {parameters!r}"
                )
            # an uplink's are laid over the trial's link (checked whole then); a downlink is
            # a hop of its own
            whole = info.field_name == "downlink_impairments"
            try:
                checked(parameters, whole=whole)
            except ImpairmentError as error:
                raise ValueError(f"device {rank}: {error}") from None
            by_rank[rank] = parameters
        return by_rank

    @field_validator("pair_impairments", mode="before")
    @classmethod
    def _impairments_by_pair(cls, value: Any) -> dict[str, dict[str, Any]]:
        if not isinstance(value, dict):
            raise ValueError(
                f'a mapping "SRC->DST" -> netem\'s parameters ({{"0->1": {{delay_ms: 40}}}}), '
                f"got {value!r}"
            )
        by_pair = {}
        for key, parameters in value.items():
            source, target = _pair(key)
            if not isinstance(parameters, dict):
                raise ValueError(f"pair {key}: a mapping of netem's parameters, got {parameters!r}")
            try:
                checked(parameters)
            except ImpairmentError as error:
                raise ValueError(f"pair {key}: {error}") from None
            by_pair[f"{source}->{target}"] = parameters
        return by_pair

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
        return {rank_of(key): _rate(rate, f"device {rank_of(key)}") for key, rate in value.items()}

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

    def impaired_pairs(self) -> dict[tuple[int, int], dict[str, Any]]:
        """`pair_impairments` by (sending rank, receiving rank)."""
        return {_pair(key): parameters for key, parameters in self.pair_impairments.items()}

    def ranks_named(self) -> dict[str, list[int]]:
        """Every rank each per-device field names (pairs: both ends)."""
        return {
            "uplink_mbit": sorted(self.uplink_mbit),
            "uplink_impairments": sorted(self.uplink_impairments),
            "downlink_mbit": sorted(self.downlink_mbit),
            "downlink_impairments": sorted(self.downlink_impairments),
            "pair_mbit": sorted({rank for pair in self.pairs() for rank in pair}),
            "pair_impairments": sorted({rank for pair in self.impaired_pairs() for rank in pair}),
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
        return distinct(rates, "bandwidth")

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


def rank_of(key: Any) -> int:
    """A device named by its rank (JSON's keys are strings)."""
    rank = int(key) if isinstance(key, str) and key.isdigit() else key
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"device {rank!r}: a device is named by its rank (0, 1, ...)")
    return rank


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
