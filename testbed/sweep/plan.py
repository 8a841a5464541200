"""The trial plan: an experiment expanded into trials, each with its analytic payload.

Order: device count (devices start once per count), then bandwidth (the link is reshaped
between bandwidths, not restarted), then impairment variant (`link.impairments`, laid over
the profile), then fleet variant (`devices.variants`: speeds and partition), then method. A
trial is one method at one device count, bandwidth, impairment and fleet variant; the trials
that share the first four run in one worker session.

A trial's partition follows its fleet (testbed.experiment.resolved_fleet); `by_speed` here
weighs the devices by their speeds alone, and the runner again with the devices' measured
rates, whose rows then say the partition in force.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from testbed.errors import ConfigError
from testbed.experiment.devices_section import FleetVariant
from testbed.experiment.level_accuracy import load_level_accuracy, resolve_accuracy_floor
from testbed.experiment.link_section import DEFAULT_RATE_MBIT, LinkSection
from testbed.experiment.method_grid import method_params
from testbed.experiment.netem_parameters import ImpairmentError
from testbed.experiment.profiles import LinkProfile, load_profile
from testbed.experiment.resolved_fleet import Fleet, fleet_variant_keys, resolve_fleet
from testbed.experiment.schema import Experiment
from testbed.link.paths import PathImpairments
from testbed.link.traces import RateTrace, load_trace
from testbed.results.facts import PlanRow
from testbed.units import BIT_PER_MBIT
from tracevq.codec import index_bits
from tracevq.config import model_config
from tracevq.payload import exchanges, payload_bits
from tracevq.spec import method_spec

PAPER_MEGABIT = 2**20  # the paper's Tables IV and Fig. 6 divide by 2^20 bit/s per "Mbit/s"


@dataclass(frozen=True)
class Trial:
    experiment: str
    devices: int
    bandwidth_mbit: float
    method: str
    params: tuple[tuple[str, Any], ...] = field(default=())
    impairment: str = ""  # a variant of link.impairments as canonical JSON; empty: the profile's
    fleet: str = ""  # a variant of devices.variants as canonical JSON; empty: none

    @property
    def method_params(self) -> dict[str, Any]:
        """The parameters the method takes (the testbed's own, resolved, left out)."""
        return method_params(dict(self.params))

    @property
    def spec(self):
        return method_spec(self.method, **self.method_params)

    @property
    def trial_id(self) -> str:
        parts = [f"p{self.devices}", self.method]
        parts += [f"{key}{_short(value)}" for key, value in self.params]
        parts.append(f"{_short(self.bandwidth_mbit)}mbit")
        if self.impairment:
            parts.append(impairment_label(self.impairments))
        if self.fleet:
            parts.append(fleet_label(self.fleet))
        return "-".join(parts).replace("_", "")

    @property
    def impairments(self) -> dict[str, Any]:
        """The impairment variant laid over the profile (empty: none)."""
        return json.loads(self.impairment) if self.impairment else {}


def fleet_label(key: str) -> str:
    """A fleet variant in a trial's name: {"speed": {"1": 0.5}} -> "speed1=0.5"."""
    label = FleetVariant.model_validate(json.loads(key)).label() if key else ""
    return label.replace("=", "").replace(",", "-").replace("_", "") or "fleet"


def impairment_label(variant: dict[str, Any]) -> str:
    """A variant in a trial's name: {"delay_ms": 5, "loss_pct": 1} -> "delay5ms-loss1pct"."""
    words = []
    for key, value in variant.items():
        if isinstance(value, dict):
            inner = "".join(f"{k.removesuffix('_pct')}{_short(v)}" for k, v in value.items())
            words.append(f"{key.removeprefix('loss_')}{inner}")
            continue
        for unit in ("_ms", "_pct"):
            if key.endswith(unit):
                words.append(f"{key.removesuffix(unit)}{_short(value)}{unit[1:]}")
                break
        else:
            words.append(f"{key}{_short(value)}")
    return "-".join(words).replace("_", "") or "none"


def link_profile(experiment: Experiment, trial: Trial) -> LinkProfile:
    """The trial's link: the experiment's profile with the trial's impairment variant over it.
    Raises ConfigError naming link.impairments where the two do not go together."""
    profile = load_profile(experiment.link.profile)
    if not trial.impairment:
        return profile
    try:
        return profile.with_impairments(trial.impairments)
    except ImpairmentError as error:
        raise ConfigError(
            f"link.impairments: variant {trial.impairment} over profile '{profile.name}': {error}"
        ) from None


def device_profiles(experiment: Experiment, trial: Trial) -> dict[int, LinkProfile]:
    """Each device's uplink in the trial: the trial's link with the device's
    link.uplink_impairments laid over it. Raises ConfigError naming the field and device."""
    profile = link_profile(experiment, trial)
    profiles = {}
    for rank in range(trial.devices):
        parameters = experiment.link.uplink_impairments.get(rank)
        if parameters is None:
            profiles[rank] = profile
            continue
        try:
            profiles[rank] = profile.with_impairments(parameters)
        except ImpairmentError as error:
            raise ConfigError(
                f"link.uplink_impairments: device {rank} over profile '{profile.name}': {error}"
            ) from None
    return profiles


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def link_rates(link: LinkSection) -> list[float]:
    """The trials' rates: the swept ones, or a trace's time-weighted mean."""
    if link.trace is not None:
        return [round(link_trace(link).mean_mbit(), 3)]
    return link.bandwidth_mbit or [DEFAULT_RATE_MBIT]


def link_trace(link: LinkSection) -> RateTrace:
    """The experiment's trace as played (stretched). Raises ConfigError naming link.trace."""
    assert link.trace is not None
    try:
        return load_trace(link.trace).stretched(link.trace_stretch)
    except ConfigError as error:
        raise ConfigError(f"link.trace: {error}") from None


def plan_trials(experiment: Experiment) -> list[Trial]:
    """Every trial of the grid; a method's level_min_accuracy resolved, per device count,
    into its level (testbed.experiment.level_accuracy.resolve_accuracy_floor)."""
    trials = []
    variants = experiment.method_variants()
    floors = any("level_min_accuracy" in variant for variant in variants)
    table = load_level_accuracy(experiment) if floors else None
    fleets = fleet_variant_keys(experiment.devices)
    for count in experiment.devices.count:
        resolved = [resolve_accuracy_floor(variant, count, table) for variant in variants]
        for rate in link_rates(experiment.link):
            for impairment in impairment_variants(experiment.link):
                for fleet in fleets:
                    for variant in resolved:
                        params = tuple((k, v) for k, v in variant.items() if k != "name")
                        trial = Trial(
                            experiment.name, count, rate, variant["name"], params, impairment, fleet
                        )
                        trials.append(trial)
    return trials


def impairment_variants(link: LinkSection) -> list[str]:
    """The link's variants as canonical JSON ([""]: the profile alone): each impairment
    variant (link.impairments), for each medium where link.medium names them."""
    variants = link.impairments if link.impairments is not None else [{}]
    media = [{}] if link.medium is None else [{"medium": medium} for medium in link.medium]
    laid = [{**variant, **medium} for medium in media for variant in variants]
    return [json.dumps(variant, sort_keys=True) if variant else "" for variant in laid]


def analytic_comm_ms(
    bits_per_layer: int, messages: int, devices: int, rate_mbit: float, megabit: int = BIT_PER_MBIT
) -> float:
    """Time the device's egress link needs for its `messages` messages of one inference (one
    per layer, or one fewer for Trace's exact-embedding placements).

    Over a TCP mesh a device's one link carries a copy of each message for each of its
    P - 1 peers; the paper's Table II counts one copy (equal for P = 2). On a shared medium
    the line is every device's: `bits_per_layer` is then all devices' (plan_rows), and a
    frame's airtime overhead is left out.
    """
    copies = max(devices - 1, 0)
    return 1000.0 * bits_per_layer * messages * copies / (rate_mbit * megabit)


def trial_fleet(experiment: Experiment, trial: Trial, host_gflops: float | None) -> Fleet:
    """The trial's devices: their CPUs, memory, speeds and the partition asked for."""
    return resolve_fleet(experiment.devices, trial.devices, trial.fleet, host_gflops)


def plan_rows(
    experiment: Experiment,
    trials: list[Trial],
    host_gflops: float | None = None,
    gflops: dict[int, float] | None = None,
) -> list[PlanRow]:
    """One row per trial and rank: the identifying columns, the device and its share of the
    tokens, and the analytic payload. `host_gflops`: this host's core rate (for speeds given
    as rates); `gflops`: the devices' measured rates (by_speed weighs them; equal without)."""
    config = model_config(experiment.model.name)
    rows = []
    paths = PathImpairments.of(experiment.link)
    for trial in trials:
        profiles = device_profiles(experiment, trial)
        delays = {r: p.delay_ms for r, p in profiles.items()}
        shared = profiles[0].medium == "shared"
        spec = trial.spec
        fleet = trial_fleet(experiment, trial, host_gflops)
        sizes = fleet.sizes(config.tokens, gflops)
        bits = payload_bits(
            config, trial.method, trial.devices, experiment.batch, sizes, **trial.method_params
        )
        messages = exchanges(spec, config.depth)  # Trace's "A" placements: no block-0 message
        for rank, rank_bits in enumerate(bits):
            # a device waits for its slowest peer's message: that peer's uplink delay, and
            # the pair's and this device's downlink's
            delay_ms = max(
                (d + paths.delay_ms(peer, rank) for peer, d in delays.items() if peer != rank),
                default=0.0,
            )
            # on a shared medium every device's messages take the one line
            carried = sum(bits) if shared else rank_bits
            comm_ms = functools.partial(
                analytic_comm_ms, carried, messages, trial.devices, trial.bandwidth_mbit
            )
            rows.append(
                PlanRow(
                    trial_id=trial.trial_id,
                    experiment=experiment.name,
                    model=config.name,
                    method=trial.method,
                    devices=trial.devices,
                    rank=rank,
                    bandwidth_mbit=trial.bandwidth_mbit,
                    K=spec.K if spec.uses_codebooks else None,
                    level_k=spec.resolved_level_k if spec.is_trace else None,
                    r_bits=index_bits(spec.resolved_level_k) if spec.is_trace else None,
                    params=",".join(f"{k}={_short(v)}" for k, v in trial.params),
                    payload_bits_per_layer=rank_bits,
                    analytic_comm_ms=comm_ms(),
                    analytic_comm_ms_paper=comm_ms(PAPER_MEGABIT),
                    analytic_delay_ms=messages * delay_ms,
                    fleet=fleet.label,
                    partition="-".join(map(str, sizes)),
                    tokens=sizes[rank],
                    cpus=fleet.shares[rank].cpus,
                    memory_mb=fleet.shares[rank].memory_mb,
                    device_speed=fleet.shares[rank].speed,
                )
            )
    return rows
