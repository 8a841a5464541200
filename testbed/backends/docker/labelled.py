"""What the Docker backend makes is labelled `testbed.run=<run id>` (LABEL): its containers and
its network. By that label `testbed.clean` finds, by run, what a dead run left in the engine,
and removes it (`DockerBackend.leftovers`, `DockerBackend.remove`).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

LABEL = "testbed.run"


def by_run(client: Any) -> dict[str, list[str]]:
    """Containers and networks labelled by a run, by the run id of their label."""
    found: dict[str, list[str]] = {}
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        run_id = container.labels.get(LABEL, "")
        found.setdefault(run_id, []).append(f"container {container.name}")
    for network in client.networks.list(filters={"label": LABEL}):
        run_id = (network.attrs.get("Labels") or {}).get(LABEL, "")
        found.setdefault(run_id, []).append(f"network {network.name}")
    return found


def remove(client: Any, run_id: str | None = None) -> list[str]:
    """Removes the containers and networks a run (or every run) left; returns what went."""
    selector = f"{LABEL}={run_id}" if run_id else LABEL
    removed = []
    for container in client.containers.list(all=True, filters={"label": selector}):
        log.debug("docker rm -f %s", container.name)
        container.remove(force=True)
        removed.append(f"container {container.name}")
    for network in client.networks.list(filters={"label": selector}):
        log.debug("docker network rm %s", network.name)
        network.remove()
        removed.append(f"network {network.name}")
    return removed
