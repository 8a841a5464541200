"""ifb, the intermediate functional block (pure, no kernel): a device that re-queues what the
ingress filter redirects to it, so a device's downlink is shaped on the ifb's egress like an
uplink (a tbf at the downlink rate). One per shaped device, inside its namespace."""

from __future__ import annotations

from testbed.kernel.names import IFNAME_MAX_CHARS


def ifb_name(interface: str) -> str:
    """The ifb that carries `interface`'s downlink: `ifb-<interface>`, cut to 15 characters."""
    return f"ifb-{interface}"[:IFNAME_MAX_CHARS]


def ifb_add_argv(name: str) -> list[str]:
    return ["ip", "link", "add", name, "type", "ifb"]


def ifb_up_argv(name: str) -> list[str]:
    return ["ip", "link", "set", "dev", name, "up"]


def ifb_del_argv(name: str) -> list[str]:
    """Deletes the ifb with its qdiscs (fails harmlessly when there is none)."""
    return ["ip", "link", "del", name]
