"""Traffic control: the qdiscs on a device's egress, as its backend hands them out
(`Backend.traffic_control`, one per backend). The run's links (`testbed.link`) are what shapes
through it; the rest of the testbed only reads it (`stats`, `support`).

It knows how to apply a shaping plan (`testbed.kernel.shaping`) to a device's interface,
change it in place, show its statistics and say which qdiscs the devices' kernel can attach.
It does not know why a plan is what it is (the emulator's business) nor how devices start
(the backend's). `TrafficControl` reaches the kernel of this host, in each device's network
namespace; a backend whose devices have kernels of their own hands out its own (boards over
SSH: `testbed.backends.ssh.traffic_control`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from testbed.kernel.shaping import ShapingPlan


class Shaped(Protocol):
    """What traffic control needs of a device (`testbed.backends.base.Device` has it): its rank
    and name, the interface that carries its traffic and the host path of its network
    namespace."""

    @property
    def rank(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def interface(self) -> str: ...

    @property
    def netns_path(self) -> str | None: ...


class TrafficControl:
    """The qdiscs of devices on this host, through netlink in each device's namespace
    (`testbed.kernel.netlink`)."""

    def apply(self, device: Shaped, plan: ShapingPlan) -> None:
        """Shapes the device's egress as planned (replacing any earlier plan)."""
        from testbed.kernel import netlink

        netlink.apply(device.netns_path, device.interface, plan, self.support())

    def change(self, device: Shaped, plan: ShapingPlan) -> None:
        """Changes the rate of the device's shaped egress in place (`netlink.change`)."""
        from testbed.kernel import netlink

        netlink.change(device.netns_path, device.interface, plan)

    def stats(self, device: Shaped) -> str:
        """`tc -s qdisc show` of the device's interface, as text."""
        from testbed.kernel import netlink

        return netlink.qdisc_stats(device.netns_path, device.interface)

    def support(self) -> dict[str, bool]:
        """Which qdiscs the devices' kernel can attach (see `testbed.kernel.support`)."""
        from testbed.kernel.support import qdisc_support

        return qdisc_support()
