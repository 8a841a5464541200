"""The `methods` of an experiment: entries whose list-valued parameters expand into a grid of
variants, each checked against the method table (`tracevq.spec`) and, for Trace, against the
levels of the tree the testbed fits."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from testbed.experiment.strict import as_list
from tracevq.codec import level_sizes_for
from tracevq.spec import MethodSpec, method_spec

MAX_TRIALS = 10_000  # device counts x bandwidths x method variants, counted before expanding
FITTED_BRANCHING = 2  # codebooks the testbed fits get a binary tree (testbed.sweep.bundles)
FLAG_PARAMS = {f.name for f in dataclasses.fields(MethodSpec) if isinstance(f.default, bool)}
# parameters of the testbed, not of the method: resolved into the method's own before the run
# (level_min_accuracy: into level_k or level_min_k, testbed.experiment.level_accuracy)
TESTBED_PARAMS = ("level_min_accuracy",)


def method_params(variant: dict[str, Any]) -> dict[str, Any]:
    """The parameters of one expanded entry that the method itself takes."""
    return {k: v for k, v in variant.items() if k != "name" and k not in TESTBED_PARAMS}


def short(variant: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" if k != "name" else str(v) for k, v in variant.items())


def expand_method(entry: Any, index: int) -> list[dict[str, Any]]:
    if not isinstance(entry, dict) or "name" not in entry:
        raise ValueError(f"methods[{index}]: needs a 'name' (e.g. {{name: trace-b, K: 1024}})")
    keys = list(entry)
    values = [as_list(entry[k]) for k in keys]
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def _length(value: Any) -> int:
    return len(value) if isinstance(value, list) else 1


def grid_size(data: Any) -> int:
    """Trials the raw experiment mapping would expand into (0 where its shape is wrong)."""
    if not isinstance(data, dict):
        return 0
    devices, link, methods = data.get("devices"), data.get("link"), data.get("methods")
    counts = _length(devices.get("count")) if isinstance(devices, dict) else 1
    if isinstance(devices, dict) and isinstance(devices.get("variants"), list):
        counts *= max(1, len(devices["variants"]))
    rates = _length(link.get("bandwidth_mbit")) if isinstance(link, dict) else 1
    entries = methods if isinstance(methods, list) else []
    variants = sum(
        math.prod(_length(value) for value in entry.values())
        for entry in entries
        if isinstance(entry, dict)
    )
    return counts * rates * variants


def check_method(variant: dict[str, Any], index: int) -> None:
    from tracevq.errors import ConfigError as TraceConfigError

    if not isinstance(variant["name"], str):
        raise ValueError(
            f"methods[{index}].name: a method's name is text such as 'trace-b', "
            f"got {variant['name']!r}"
        )
    params = method_params(variant)
    for key, value in variant.items():
        if isinstance(value, bool) and key not in FLAG_PARAMS:
            raise ValueError(f"methods[{index}].{key}: takes a number, got {value!r}")
    try:
        spec = method_spec(variant["name"], **params)
    except TraceConfigError as error:
        field = f".{error.field}" if error.field else ""
        raise ValueError(f"methods[{index}]{field}: {error}") from None
    if "level_min_accuracy" in variant:
        _check_accuracy_floor(variant["level_min_accuracy"], spec, f"methods[{index}]")


def _check_accuracy_floor(floor: Any, spec: MethodSpec, where: str) -> None:
    """level_min_accuracy: a top-1 percentage for a Trace method whose level it may choose."""
    where = f"{where}.level_min_accuracy"
    if not isinstance(floor, int | float) or not 0 < floor <= 100:
        raise ValueError(f"{where}: a top-1 percentage in (0, 100], got {floor!r}")
    if not spec.is_trace:
        raise ValueError(f"{where}: only Trace methods (trace-b, trace-nb) have levels")
    if spec.level_min_k is not None:
        raise ValueError(f"{where}: chooses level_min_k itself; give one of the two")
    if spec.level_k not in (None, "auto"):
        raise ValueError(
            f"{where}: chooses the level itself (level_k: auto bounded by it, or without "
            f"level_k the level); level_k is {spec.level_k!r}"
        )


def variant_spec(variant: dict[str, Any]) -> MethodSpec:
    """The method spec of one expanded method entry ({"name": ..., parameters ...})."""
    return method_spec(variant["name"], **method_params(variant))


def check_device_counts(variant: dict[str, Any], index: int, counts: list[int]) -> None:
    """A method that runs on one device (it exchanges nothing) is swept at one device only."""
    spec = variant_spec(variant)
    if not spec.exchanges and counts != [1]:
        raise ValueError(
            f"methods[{index}]: method {spec.name!r} runs on one device, but devices.count is "
            f"{counts}: give it an experiment of its own with count 1"
        )


def check_level(variant: dict[str, Any], index: int) -> None:
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
