"""A link's impairments as netem defines them (tc-netem(8)): their parameters, defaults and the
rules that refuse a bad combination. Standard library only: the serial emulator checks what
it is told with these same rules, and link profiles (`testbed.experiment.profiles`) check
what a user writes with them.

Parameters (every probability and correlation in percent, as tc writes them):

- `delay_ms`, `jitter_ms`, `delay_correlation_pct`, `delay_distribution` (uniform, normal,
  pareto, paretonormal): netem's `delay TIME JITTER CORRELATION distribution NAME`;
- `loss_pct`, `loss_correlation_pct`: `loss random PERCENT CORRELATION`;
- `loss_gemodel` {p_pct, r_pct, one_minus_h_pct, one_minus_k_pct}: `loss gemodel p r 1-h 1-k`,
  with tc's defaults r = 100 - p, 1-h = 100, 1-k = 0;
- `loss_state` {p13_pct, p31_pct, p32_pct, p23_pct, p14_pct}: `loss state ...`, with tc's
  defaults p31 = 100 - p13, p32 = 0, p23 = 100, p14 = 0;
- `duplicate_pct`, `duplicate_correlation_pct`: `duplicate PERCENT CORRELATION`;
- `reorder_pct`, `reorder_correlation_pct`, `reorder_gap`: `reorder PERCENT CORRELATION gap N`
  (gap 1 when not given, as tc sets it).

Refused as tc refuses them: reordering without a delay, a gap without reordering, a
distribution without a delay and a jitter. Refused besides: jitter without a delay (half of
its draws would be negative and count as zero: not the distribution asked for), more than
one loss model, and a number that is not finite or lies outside its range.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

DISTRIBUTIONS = ("uniform", "normal", "pareto", "paretonormal")
MAX_DELAY_MS = 60_000.0
NUMBERS: dict[str, tuple[float, float]] = {  # flat parameters: their ranges
    "delay_ms": (0.0, MAX_DELAY_MS),
    "jitter_ms": (0.0, MAX_DELAY_MS),
    "delay_correlation_pct": (0.0, 100.0),
    "loss_pct": (0.0, 100.0),
    "loss_correlation_pct": (0.0, 100.0),
    "duplicate_pct": (0.0, 100.0),
    "duplicate_correlation_pct": (0.0, 100.0),
    "reorder_pct": (0.0, 100.0),
    "reorder_correlation_pct": (0.0, 100.0),
}
GEMODEL = ("p_pct", "r_pct", "one_minus_h_pct", "one_minus_k_pct")
STATE = ("p13_pct", "p31_pct", "p32_pct", "p23_pct", "p14_pct")
TIMES_MS = ("delay_ms", "jitter_ms")  # what a dilation multiplies (testbed.experiment.dilation)
NAMES = (*NUMBERS, "delay_distribution", "loss_gemodel", "loss_state", "reorder_gap")


def dilated(parameters: Mapping[str, Any], factor: float) -> dict[str, Any]:
    """netem's parameters with every time in them `factor` times as long."""
    return {k: v * factor if k in TIMES_MS and v else v for k, v in parameters.items()}


class ImpairmentError(ValueError):
    """A bad impairment; the message starts with the parameter's name."""


def checked(parameters: Mapping[str, Any], whole: bool = True) -> dict[str, Any]:
    """Every parameter, defaults filled in, plus `loss_model` (random, gemodel or state).
    Raises ImpairmentError naming the parameter. `whole` false: each parameter alone, not how
    they go together (a variant laid over a profile is checked whole once laid)."""
    parameters = {k: v for k, v in parameters.items() if k != "loss_model"}  # checked again
    unknown = sorted(set(parameters) - set(NAMES))
    if unknown:
        close = difflib.get_close_matches(unknown[0], NAMES, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"they are {', '.join(NAMES)}"
        raise ImpairmentError(f"{unknown[0]}: not an impairment ({hint})")
    values: dict[str, Any] = {name: _number(parameters, name, *NUMBERS[name]) for name in NUMBERS}
    values["delay_distribution"] = parameters.get("delay_distribution") or "uniform"
    if values["delay_distribution"] not in DISTRIBUTIONS:
        raise ImpairmentError(
            f"delay_distribution: {values['delay_distribution']!r} is not one of "
            f"{', '.join(DISTRIBUTIONS)}"
        )
    gap = parameters.get("reorder_gap") or 0
    if isinstance(gap, bool) or not isinstance(gap, int) or gap < 0:
        raise ImpairmentError(f"reorder_gap: a whole number of frames >= 0, got {gap!r}")
    values["reorder_gap"] = gap
    values["loss_gemodel"] = _gemodel(parameters.get("loss_gemodel"))
    values["loss_state"] = _state(parameters.get("loss_state"))
    values["loss_model"] = _loss_model(values)
    if whole:
        _combinations(values)
    return values


def _number(parameters: Mapping[str, Any], name: str, low: float, high: float) -> float:
    value = parameters.get(name, 0.0)
    if value is None:
        value = 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ImpairmentError(f"{name}: a finite number, got {value!r}")
    if not low <= value <= high:
        raise ImpairmentError(f"{name}: must lie in {low:g}..{high:g}, got {value:g}")
    return float(value)


def _probabilities(
    given: Any, name: str, fields: tuple[str, ...], defaults: dict[str, float]
) -> dict[str, float] | None:
    if given is None:
        return None
    if not isinstance(given, Mapping):
        raise ImpairmentError(f"{name}: a mapping of {', '.join(fields)}, got {given!r}")
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ImpairmentError(f"{name}.{unknown[0]}: not a parameter ({', '.join(fields)})")
    if fields[0] not in given:
        raise ImpairmentError(f"{name}.{fields[0]}: required")
    first = _number(given, fields[0], 0.0, 100.0)
    values = {fields[0]: first}
    for field in fields[1:]:
        default = defaults[field] if field in defaults else 100.0 - first
        values[field] = _number(given, field, 0.0, 100.0) if field in given else default
    return values


def _gemodel(given: Any) -> dict[str, float] | None:
    try:
        defaults = {"one_minus_h_pct": 100.0, "one_minus_k_pct": 0.0}
        return _probabilities(given, "loss_gemodel", GEMODEL, defaults)
    except ImpairmentError as error:
        raise _under(error, "loss_gemodel") from None


def _state(given: Any) -> dict[str, float] | None:
    try:
        defaults = {"p32_pct": 0.0, "p23_pct": 100.0, "p14_pct": 0.0}
        return _probabilities(given, "loss_state", STATE, defaults)
    except ImpairmentError as error:
        raise _under(error, "loss_state") from None


def _under(error: ImpairmentError, name: str) -> ImpairmentError:
    text = str(error)
    return ImpairmentError(text if text.startswith(name) else f"{name}.{text}")


def _loss_model(values: dict[str, Any]) -> str:
    models = [
        name
        for name, given in (
            ("loss_pct", values["loss_pct"] > 0),
            ("loss_gemodel", values["loss_gemodel"] is not None),
            ("loss_state", values["loss_state"] is not None),
        )
        if given
    ]
    if len(models) > 1:
        raise ImpairmentError(f"{models[1]}: one loss model at a time, and {models[0]} is given")
    return {"loss_gemodel": "gemodel", "loss_state": "state"}.get(
        models[0] if models else "", "random"
    )


def _combinations(values: dict[str, Any]) -> None:
    if values["jitter_ms"] > 0 and values["delay_ms"] == 0:
        raise ImpairmentError("jitter_ms: jitter needs a delay (delay_ms > 0)")
    if values["delay_distribution"] != "uniform" and values["jitter_ms"] == 0:
        raise ImpairmentError(
            "delay_distribution: a distribution needs a delay and a jitter (as tc's netem)"
        )
    if values["reorder_pct"] > 0 and values["delay_ms"] == 0:
        raise ImpairmentError(
            "reorder_pct: reordering needs a delay (delay_ms > 0), as tc's netem: a reordered "
            "frame is one that skips it"
        )
    if values["reorder_gap"] > 0 and values["reorder_pct"] == 0:
        raise ImpairmentError("reorder_gap: a gap without reorder_pct (as tc's netem refuses)")
    if values["reorder_pct"] > 0 and values["reorder_gap"] == 0:
        values["reorder_gap"] = 1


def impaired(values: Mapping[str, Any]) -> bool:
    """Whether checked parameters change anything at all."""
    return any(values[name] for name in NUMBERS if not name.endswith("correlation_pct")) or (
        values["loss_model"] != "random"
    )
