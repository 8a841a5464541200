"""u32 filters (pure, no kernel): traffic to a peer's address into its htb class, and all
traffic arriving on an interface redirected (action mirred) to its ifb."""

from __future__ import annotations

INGRESS_HANDLE = "ffff:"


def u32_destination_argv(interface: str, address: str, class_minor: int) -> list[str]:
    """IPv4 packets to `address` go to htb class 1:<minor>."""
    return (
        ["tc", "filter", "add", "dev", interface, "parent", "1:"]
        + ["protocol", "ip", "prio", "1", "u32"]
        + ["match", "ip", "dst", f"{address}/32", "flowid", f"1:{class_minor:x}"]
    )


def u32_redirect_argv(interface: str, target: str) -> list[str]:
    """Every packet the ingress qdisc of `interface` sees, redirected to `target`'s egress."""
    return (
        ["tc", "filter", "add", "dev", interface, "parent", INGRESS_HANDLE, "protocol", "all"]
        + ["prio", "1", "u32", "match", "u32", "0", "0"]
        + ["action", "mirred", "egress", "redirect", "dev", target]
    )
