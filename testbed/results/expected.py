"""What netem's parameters predict of a link, for the fidelity report
(testbed.results.fidelity): the probability per draw of each count the serial emulator keeps
(lost, duplicated, reordered), with the design effect of its count where the draws come in
runs, and the delay a frame meets on a path of hops, drawn from netem's model
(`testbed.link.serial.netem_draws`) with a seed of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from testbed.link.serial.netem_draws import Impairments

DRAWS = 20_000  # frames of the configured model per path


@dataclass(frozen=True)
class Expected:
    """A count's probability per draw as the parameters give it, and the variance of the count
    over the binomial's (None: the draws are not independent enough for an interval)."""

    probability: float
    design_effect: float | None = 1.0


def expected_counts(values: Mapping[str, Any]) -> dict[str, Expected]:
    """Per count (lost, duplicated, reordered), its probability per draw under checked netem
    parameters, in the serial emulator's order (`Impairments.frame`): a frame is counted lost
    when it was not duplicated and lost, duplicated when neither copy was lost; a copy is
    reordered with r, then not for the next gap - 1 copies."""
    loss, loss_effect = loss_rate(values)
    dup = float(values["duplicate_pct"]) / 100
    dup_independent = not values["duplicate_correlation_pct"] and (dup == 0 or loss_effect == 1)
    reorder, gap = float(values["reorder_pct"]) / 100, int(values["reorder_gap"] or 1)
    return {
        "lost": Expected((1 - dup) * loss, loss_effect),
        "duplicated": Expected(dup * (1 - loss) ** 2, 1.0 if dup_independent else None),
        "reordered": Expected(
            reorder / (1 + (gap - 1) * reorder),
            None if values["reorder_correlation_pct"] else 1.0,
        ),
    }


def loss_rate(values: Mapping[str, Any]) -> tuple[float, float | None]:
    """The long-run share of frames the loss model loses, and the design effect of its count:
    1 for independent draws, the Gilbert chain's (1 + l) / (1 - l) with l = 1 - p - r where the
    state alone decides, else None."""
    if values["loss_model"] == "gemodel":
        ge = {key: float(value) / 100 for key, value in values["loss_gemodel"].items()}
        p, r = ge["p_pct"], ge["r_pct"]
        bad = p / (p + r) if p + r else 0.0
        rate = (1 - bad) * ge["one_minus_k_pct"] + bad * ge["one_minus_h_pct"]
        gilbert = ge["one_minus_h_pct"] == 1 and ge["one_minus_k_pct"] == 0 and p + r < 2
        lag = 1 - p - r
        return rate, (1 + lag) / (1 - lag) if gilbert else None
    if values["loss_model"] == "state":
        return _four_state_rate({key: float(v) / 100 for key, v in values["loss_state"].items()})
    correlated = bool(values["loss_correlation_pct"])
    return float(values["loss_pct"]) / 100, None if correlated else 1.0


def _four_state_rate(s: Mapping[str, float]) -> tuple[float, None]:
    """netem's 4-state chain (1 sent in a gap, 2 sent in a burst, 3 lost in a burst, 4 an
    isolated loss): a frame is lost when the chain enters 3 or 4; its stationary share."""
    p13, p14, p23, p31, p32 = s["p13_pct"], s["p14_pct"], s["p23_pct"], s["p31_pct"], s["p32_pct"]
    move = np.array(
        [
            [1 - p13 - p14, 0, p13, p14],
            [0, 1 - p23, p23, 0],
            [p31, p32, 1 - p31 - p32, 0],
            [1, 0, 0, 0],
        ]
    )
    share = np.array([1.0, 0, 0, 0])
    for _ in range(10_000):
        share = share @ move
    return float(share[2] + share[3]), None


def configured_delays_ms(hops: list[Mapping[str, Any]], draws: int = DRAWS) -> np.ndarray:
    """The delay a frame meets on a path of `hops` (checked netem parameters each), drawn from
    netem's model, `draws` frames: the earliest of its copies, the hops' delays added (a
    reordered copy's is 0); lost frames give none."""
    if not any(h["delay_ms"] or h["jitter_ms"] for h in hops):
        return np.zeros(1)
    models = [Impairments(values, seed=1 + index) for index, values in enumerate(hops)]
    delays = []
    for _ in range(draws):
        arrivals = [0.0]
        for model in models:
            arrivals = [before + copy.delay_s for before in arrivals for copy in model.frame()]
        if arrivals:
            delays.append(1e3 * min(arrivals))
    return np.array(delays)
