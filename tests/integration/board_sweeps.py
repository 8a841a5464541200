"""The small sweep that the ssh and enoslib backends' tests run on the boards of
`checks.boards`, and the rate of its link."""

from __future__ import annotations

from typing import Any

from checks.boards import Lab

RATE_MBIT = 5.0  # the boards' link in the small sweeps


def small_experiment(lab: Lab | None = None, **changes: Any) -> dict[str, Any]:
    """A small sweep (vit-tiny, Voltage and Trace-b) as an experiment mapping, `changes`
    laid over it; with `lab`, on its boards through the ssh backend."""
    experiment = {
        "name": "ssh-small",
        "model": {"name": "vit-tiny"},
        "devices": {"count": [2], "cpus": 1, "memory_mb": 1024},
        "link": {"profile": "ideal", "bandwidth_mbit": [RATE_MBIT]},
        "methods": [{"name": "voltage"}, {"name": "trace-b", "K": 16}],
        "bundle": {"calibration_inputs": 4},
        "repeats": 2,
        "warmup": 1,
        "timeout_s": 180,
        **changes,
    }
    if lab is not None:
        experiment.update(backend="ssh", inventory=lab.inventory())
    return experiment
