"""What the ssh backend refuses before anything starts, from the experiment alone: fewer boards
than devices, a known_hosts file or a key file that is not there (no inventory at all: every
backend's rule, `Backend.refusal`).
Nothing is connected to: the boards themselves are checked when the backend starts
(`testbed.backends.ssh.checks`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from testbed.backends.ssh.inventory import Inventory

if TYPE_CHECKING:
    from testbed.experiment.schema import Experiment


class HostKeyCheck(Protocol):
    """What a section says of its boards' host keys: an `Inventory`, or the enoslib backend's
    `Provider`."""

    known_hosts: str
    accept_new_host_keys: bool


def inventory_refusal(experiment: Experiment) -> str | None:
    """Why the experiment's inventory cannot carry its devices (one line naming the field),
    or None (also where it gives none: `Backend.refusal` says so first)."""
    inventory = experiment.section(Inventory.section)
    if not isinstance(inventory, Inventory):
        return None
    most = max(experiment.devices.count)
    if most > len(inventory.boards):
        return (
            f"devices.count: {most} devices, but the inventory has {len(inventory.boards)} "
            "boards (one device per board)"
        )
    refused = known_hosts_refusal(Inventory.section, inventory, "the boards' host keys")
    if refused is not None:
        return refused
    for index, board in enumerate(inventory.boards[:most]):
        if board.key_file is not None and not Path(board.key_file).is_file():
            return (
                f"inventory.boards[{index}].key_file: file not found: {board.key_file} (leave "
                "key_file out to use ssh-agent and ~/.ssh/id_*)"
            )
    return None


def known_hosts_refusal(key: str, section: HostKeyCheck, keys: str) -> str | None:
    """Why the section's known_hosts file cannot check `keys` (its boards'), or None."""
    if section.accept_new_host_keys or Path(section.known_hosts).is_file():
        return None
    return (
        f"{key}.known_hosts: file not found: {section.known_hosts}; record {keys} "
        "(`ssh-keyscan -p PORT ADDRESS >> FILE`), or say accept_new_host_keys: true for a "
        "first connection"
    )
