"""The ingress qdisc (pure, no kernel): where a device's received packets can be filtered, here
to be redirected to an ifb (`testbed.kernel.ifb`) and shaped there as its downlink."""

from __future__ import annotations

from testbed.kernel.u32 import INGRESS_HANDLE


def ingress_argv(interface: str) -> list[str]:
    return ["tc", "qdisc", "add", "dev", interface, "handle", INGRESS_HANDLE, "ingress"]


def ingress_clear_argv(interface: str) -> list[str]:
    """Removes the ingress qdisc and its filters (fails harmlessly when there is none)."""
    return ["tc", "qdisc", "del", "dev", interface, "ingress"]
