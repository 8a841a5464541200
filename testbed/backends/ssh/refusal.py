"""What the ssh backend refuses before anything starts, from the experiment alone: no
inventory, fewer boards than devices, a known_hosts file or a key file that is not there.
Nothing is connected to: the boards themselves are checked when the backend starts
(`testbed.backends.ssh.checks`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from testbed.experiment.inventory import Inventory

if TYPE_CHECKING:
    from testbed.experiment.schema import Experiment


def inventory_refusal(experiment: Experiment, backend: str) -> str | None:
    """Why `backend` cannot run on the experiment's inventory (one line naming the field), or
    None."""
    inventory = experiment.section(Inventory.section)
    if not isinstance(inventory, Inventory):
        return (
            f"inventory: backend '{backend}' needs an inventory of boards (a file's path or "
            "inline; see experiments/ssh-smoke.yaml)"
        )
    most = max(experiment.devices.count)
    if most > len(inventory.boards):
        return (
            f"devices.count: {most} devices, but the inventory has {len(inventory.boards)} "
            "boards (one device per board)"
        )
    if not inventory.accept_new_host_keys and not Path(inventory.known_hosts).is_file():
        return (
            f"inventory.known_hosts: file not found: {inventory.known_hosts}; record the "
            "boards' host keys (`ssh-keyscan -p PORT ADDRESS >> FILE`), or say "
            "accept_new_host_keys: true for a first connection"
        )
    for index, board in enumerate(inventory.boards[:most]):
        if board.key_file is not None and not Path(board.key_file).is_file():
            return (
                f"inventory.boards[{index}].key_file: file not found: {board.key_file} (leave "
                "key_file out to use ssh-agent and ~/.ssh/id_*)"
            )
    return None
