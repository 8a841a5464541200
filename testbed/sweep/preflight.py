"""Checks of a loaded experiment against where it will run: the backend chosen (its own rules,
`Backend.refusal`), this host's CPUs and kernel, the emulator (`Emulator.refusal`), and the
files it names. Made by `testbed.run` (dry runs included) and by `Runner` before anything is
written or started; the schema has already checked what the file alone decides.

Each problem is a one-line `ConfigError`: `FILE: field: what is wrong; what would be right`.
Relative paths are taken from the working directory, as the run later reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from testbed.backends.base import Backend
from testbed.backends.table import backend_class
from testbed.errors import ConfigError
from testbed.experiment.dilation import Dilation, host_busy_cores, resolve_dilation
from testbed.experiment.level_accuracy import check_covered, load_level_accuracy
from testbed.experiment.method_grid import FITTED_BRANCHING, variant_spec
from testbed.experiment.netem_parameters import ImpairmentError
from testbed.experiment.profiles import LinkProfile, load_profile
from testbed.experiment.resolved_fleet import resources
from testbed.experiment.schema import Experiment
from testbed.link.emulator import Emulator
from testbed.link.emulators import emulator_class
from testbed.link.paths import PathImpairments
from testbed.sweep.fleets import check_fleets
from testbed.sweep.plan import (
    Trial,
    device_profiles,
    impairment_variants,
    link_profile,
    link_trace,
)
from tracevq.codec import level_sizes_for

if TYPE_CHECKING:
    from tracevq.bundle import Bundle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked:
    """What the preflight found: the link profile, the backend (`auto` chosen) and emulator."""

    profile: LinkProfile
    backend: type[Backend]
    emulator: type[Emulator]
    host_gflops: float | None = None  # this host's core rate, where a device's speed needs it
    dilations: dict[int, Dilation] = dataclasses.field(default_factory=dict)  # by device count


def check_experiment(experiment: Experiment, backend_name: str, source: str) -> Checked:
    """Raises ConfigError naming `source` and the field; returns what it checked."""
    backend = _backend(backend_name, source)
    refused = backend.refusal(experiment)
    if refused is not None:
        raise ConfigError(f"{source}: {refused}")
    _check_files(experiment, source)
    bundle = _check_bundle(experiment, source)
    _check_level_accuracy(experiment, bundle, source)
    _check_cpus(experiment, backend, source)
    host_gflops = check_fleets(experiment, source)
    emulator = _emulator(experiment, backend, source)
    profile = _profile(experiment, source)
    paths = PathImpairments.of(experiment.link)
    for field, variant in _variants(experiment, profile, source):
        if variant.medium == "shared":
            _check_shared_medium(experiment, variant, source)
        refused = emulator.refusal(variant, backend, bool(experiment.link.pair_mbit), paths)
        if refused is not None:
            field = field if refused.field == "link.profile" else refused.field
            if field == "link.medium" and not experiment.link.medium:  # the profile's medium
                field = "link.profile"
            raise ConfigError(f"{source}: {field}: {refused.why}")
    return Checked(
        profile,
        backend,
        emulator,
        host_gflops,
        _dilations(experiment, host_gflops, emulator, source),
    )


def _dilations(
    experiment: Experiment, host_gflops: float | None, emulator: type[Emulator], source: str
) -> dict[int, Dilation]:
    """Every device count's dilation; ConfigError where a fixed one is too low. `auto` looks
    at the host's load once, for every count."""
    busy = host_busy_cores() if experiment.dilation == "auto" else 0.0
    try:
        return {
            count: resolve_dilation(experiment, count, host_gflops, emulator.name, None, busy)
            for count in experiment.devices.count
        }
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def _check_shared_medium(experiment: Experiment, variant: LinkProfile, source: str) -> None:
    """A shared medium is one line that every frame takes at its sender's rate: a receiver's
    or a pair's rate or later hop has no place on it."""
    link = experiment.link
    for field in ("downlink_mbit", "pair_mbit", "downlink_impairments", "pair_impairments"):
        if getattr(link, field):
            where = "link.medium" if link.medium else f"link.profile {variant.name}"
            raise ConfigError(
                f"{source}: link.{field}: a shared medium ({where}) is one cell that every "
                "frame crosses at its sender's rate; it has no downlink or per-pair rates or "
                "impairments (use link.uplink_mbit and link.uplink_impairments)"
            )


def _variants(
    experiment: Experiment, profile: LinkProfile, source: str
) -> list[tuple[str, LinkProfile]]:
    """The profile, or each variant of link.impairments laid over it, and each device's own
    uplink (link.uplink_impairments) over those, each named for a refusal with the field
    that gave it."""
    checked = []
    most = max(experiment.devices.count)
    for index, impairment in enumerate(impairment_variants(experiment.link)):
        trial = Trial(experiment.name, most, 1.0, "voltage", impairment=impairment)
        try:
            laid = link_profile(experiment, trial)
            uplinks = device_profiles(experiment, trial)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None
        if impairment:
            name = f"variant {index} over {profile.name}"
            field = "link.impairments" if set(trial.impairments) - {"medium"} else "link.medium"
            checked.append((field, laid.model_copy(update={"name": name})))
        else:
            checked.append(("link.profile", laid))
        for rank in sorted(experiment.link.uplink_impairments):
            if rank < most:
                own = uplinks[rank].model_copy(update={"name": f"device {rank}'s uplink"})
                checked.append(("link.uplink_impairments", own))
    try:
        trace = None if experiment.link.trace is None else link_trace(experiment.link)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    if trace is not None and trace.impairments:
        try:
            steps = [profile.with_impairments(step) for step in trace.impairments]
        except ImpairmentError as error:
            raise ConfigError(f"{source}: link.trace: {trace.name}'s steps: {error}") from None
        worst = max(steps, key=lambda step: step.needs_netem)
        checked.append(("link.trace", worst.model_copy(update={"name": f"trace {trace.name}"})))
    return checked


def _backend(name: str, source: str) -> type[Backend]:
    try:
        return backend_class(name)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def _check_files(experiment: Experiment, source: str) -> None:
    named = {
        "model.checkpoint": experiment.model.checkpoint,
        "bundle.path": experiment.bundle.path,
        "evaluation.inputs": experiment.evaluation.inputs if experiment.evaluation else None,
        "report.level_accuracy": experiment.report.level_accuracy,
    }
    for field, name in named.items():
        if name is None:
            continue
        path = Path(name).expanduser()
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        if not path.exists():
            raise ConfigError(f"{source}: {field}: file not found: {name}{where}")
        if field == "model.checkpoint" and path.is_dir():
            _check_checkpoint_folder(path, f"{source}: {field}")
        elif not path.is_file():
            raise ConfigError(f"{source}: {field}: not a regular file: {name}{where}")
        if not os.access(path, os.R_OK):
            raise ConfigError(f"{source}: {field}: not readable: {name}")
    if experiment.link.trace is not None:
        try:
            link_trace(experiment.link)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None


def _check_checkpoint_folder(path: Path, where: str) -> None:
    """A folder is a checkpoint when it is Hugging Face's save_pretrained layout."""
    from tracevq.checkpoint import HF_WEIGHTS

    if not any((path / name).is_file() for name in HF_WEIGHTS):
        raise ConfigError(
            f"{where}: not a regular file, nor a Hugging Face save_pretrained folder (none of "
            f"{', '.join(HF_WEIGHTS)} in {path})"
        )


def _check_bundle(experiment: Experiment, source: str) -> Bundle | None:
    """A given bundle (bundle.path) has every codebook family, K and tree level the methods
    ask for: otherwise the workers would refuse it only once the devices run. Returns it."""
    if experiment.bundle.path is None:
        return None
    from tracevq.bundle import Bundle

    bundle = Bundle.load(experiment.bundle.path)  # ConfigError: unreadable, wrong format
    for variant in experiment.method_variants():
        spec = variant_spec(variant)
        if not spec.uses_codebooks:
            continue
        where = f"{source}: bundle.path: {experiment.bundle.path}"
        if spec.name not in bundle.trees:
            have = ", ".join(bundle.trees) or "none"
            raise ConfigError(f"{where} has no {spec.name} codebooks (it has: {have})")
        sizes = bundle.trees[spec.name][0].level_sizes
        if spec.K != sizes[-1]:
            raise ConfigError(f"{where}: {spec.name} K={spec.K}, its codebooks have {sizes[-1]}")
        if not spec.is_trace:
            continue
        for field, size in (("level_k", spec.resolved_level_k), ("level_min_k", spec.level_min_k)):
            if size is not None and size not in sizes:
                raise ConfigError(
                    f"{where}: {spec.name} {field}={size} is not a level of its codebook tree "
                    f"(levels: {', '.join(map(str, sizes))})"
                )
    return bundle


def _check_level_accuracy(experiment: Experiment, bundle: Bundle | None, source: str) -> None:
    """The table of report.level_accuracy reads, and has a row for every level the Trace
    methods may use (their trees' levels: the given bundle's, else the fitted tree's)."""
    if experiment.report.level_accuracy is None:
        return
    metric = None if bundle is None else bundle.meta.get("metric")
    if metric is not None and metric != experiment.bundle.metric:
        raise ConfigError(
            f"{source}: bundle.metric: the trees of {experiment.bundle.path} are built by "
            f"{metric}, the rows of report.level_accuracy are taken for {experiment.bundle.metric}"
            f"; say bundle: {{metric: {metric}}}"
        )

    def level_sizes(method: str, K: int) -> list[int]:
        if bundle is None:
            return level_sizes_for(K, FITTED_BRANCHING)
        return list(bundle.trees[method][0].level_sizes)

    try:
        table = load_level_accuracy(experiment)
        assert table is not None
        check_covered(table, experiment, level_sizes)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def host_cpus() -> int:
    return os.cpu_count() or 1


def _check_cpus(experiment: Experiment, backend: type[Backend], source: str) -> None:
    """A device may not ask for more CPUs than the host has, unless the file says so; devices
    that together ask for more are allowed and recorded as `oversubscribed`, as before. Boards
    (ssh) have cores of their own."""
    devices = experiment.devices
    if not backend.on_this_host or devices.oversubscribe:
        return
    for rank in range(max(devices.count)):
        try:
            cpus, _ = resources(devices, rank)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None
        if cpus <= host_cpus():
            continue
        whose = "per device" if not isinstance(devices.cpus, dict) else f"for device {rank}"
        raise ConfigError(
            f"{source}: devices.cpus: {cpus:g} CPUs {whose}, but this host has "
            f"{host_cpus()}; at most {host_cpus()}, or say devices: {{oversubscribe: true}}"
        )


def _emulator(experiment: Experiment, backend: type[Backend], source: str) -> type[Emulator]:
    try:
        return emulator_class(experiment.link.emulator, backend)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def _profile(experiment: Experiment, source: str) -> LinkProfile:
    try:
        return load_profile(experiment.link.profile)
    except ConfigError as error:
        raise ConfigError(f"{source}: link.profile: {error}") from None
