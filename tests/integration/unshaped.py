"""A session's links where nothing shapes them, for the tests that run one session by hand
(`testbed.sweep.sessions.run_session`) without a `Links`: test_run_secret, test_ssh_backend."""

from __future__ import annotations

from dataclasses import dataclass

from testbed.backends.base import Device
from testbed.link.emulator import LinkCounters


@dataclass
class UnshapedLinks:
    """The backend's own devices, no bytes counted, no emulator to die."""

    devices: list[Device]

    def counters(self) -> dict[int, LinkCounters]:
        return {device.rank: LinkCounters(0) for device in self.devices}

    def gone(self) -> str | None:
        return None
