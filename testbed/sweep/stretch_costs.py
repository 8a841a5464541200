"""This host's stretch costs: what every paced stretch of a device's compute costs on a warm
core at full speed (devices.pace), kept from run to run.

A worker learns the costs of the stretches it has no reference for from its warm-ups and
writes them to `references.json`; the testbed keeps the first it learns of each kind (a
model, method, parameters, tokens, batch and threads) from at least LEAST_SAMPLES samples,
in `.cache/stretch-costs.json` by CPU model, and gives them to every later worker on this
host: two runs of one experiment then pace to the same costs, whatever the host is doing that
day (a run's own warm-ups move with it: docs/devices.md, Virtual time). Delete the file to
learn them again (a new kernel, a new torch). Boards over SSH learn their own in each
session (their CPU is not this one).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from devices.pace import LEAST_SAMPLES
from devices.records import REFERENCES_FILE
from testbed.atomic import write_atomically
from testbed.source import CACHE_DIR
from testbed.sweep.host_rate import cpu_model

log = logging.getLogger(__name__)

CACHE_FILE = CACHE_DIR / "stretch-costs.json"


def _read(cache: Path) -> dict[str, dict[str, float]]:
    """Every CPU's costs in the cache (none where it is missing or unreadable)."""
    try:
        return json.loads(cache.read_text()) if cache.is_file() else {}
    except (OSError, ValueError):
        return {}


def known(model: str, cache: Path = CACHE_FILE) -> dict[str, float]:
    """This CPU's stretch costs for `model` (CPU s per unit of work, by kind)."""
    mine = _read(cache).get(cpu_model(), {})
    return {kind: float(cost) for kind, cost in mine.items() if kind.startswith(f"{model}|")}


def keep(outs: list[Path], cache: Path = CACHE_FILE) -> int:
    """The costs the workers in `outs` learned, added where this CPU has none yet (the
    first learned is kept); how many were added."""
    every = _read(cache)
    mine = every.setdefault(cpu_model(), {})
    added = 0
    for out in outs:
        try:
            learned = json.loads((out / REFERENCES_FILE).read_text())
        except (OSError, ValueError):
            continue  # a worker that failed before its end learned nothing to keep
        for kind, found in learned.items():
            if kind not in mine and found["samples"] >= LEAST_SAMPLES:
                mine[kind] = found["per_unit_s"]
                added += 1
    if added:
        cache.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(every, indent=1, sort_keys=True)
        write_atomically(cache, lambda path: path.write_text(text))
        log.debug("stretch costs: %d kept in %s", added, cache)
    return added
