"""pfifo, a packet-counted drop-tail queue: the leaf under each htb class (pure, no kernel)."""

from __future__ import annotations


def pfifo_argv(
    interface: str, class_minor: int, limit_packets: int, action: str = "add"
) -> list[str]:
    """A pfifo under htb class 1:<minor>, with handle <minor>: (both in tc's hex)."""
    return (
        ["tc", "qdisc", action, "dev", interface]
        + ["parent", f"1:{class_minor:x}", "handle", f"{class_minor:x}:"]
        + ["pfifo", "limit", str(limit_packets)]
    )
