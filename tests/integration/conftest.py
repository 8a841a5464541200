"""Fixtures of the serial link's netns tests: two device namespaces and a switch between
them (test_serial_link_netns, test_impairments_netns)."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from testbed.link.serial.switch import ProgramOptions, SerialSwitch

SUBNET = ipaddress.IPv4Network("10.214.77.0/24")


@dataclass(frozen=True)
class Devices:
    names: tuple[str, str]
    paths: tuple[str, str]  # as given to the switch


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.strip()}


@pytest.fixture
def devices(root: None) -> Iterator[Devices]:
    """Namespaces `tbsl-<pid>-a|b`, lo up; b held by a process, given by its /proc path."""
    names = (f"tbsl-{os.getpid()}-a", f"tbsl-{os.getpid()}-b")
    holder = None
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
            subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=10)
        holder = subprocess.Popen(["ip", "netns", "exec", names[1], "sleep", "120"])
        yield Devices(names, (f"/var/run/netns/{names[0]}", f"/proc/{holder.pid}/ns/net"))
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        assert not set(names) & namespaces(), "device namespaces left behind"


@pytest.fixture
def switch(request: pytest.FixtureRequest, devices: Devices) -> Iterator[SerialSwitch]:
    """The switch at 1 Mbit/s, its per-frame loop the test module's `SWITCH_CORE` (c,
    python; the program's default where it names none); stopped, and checked gone, whether
    the test passed or not."""
    core = getattr(request.module, "SWITCH_CORE", None)
    tag = f"{os.getpid() & 0xFFFFFFFF:08x}"
    serial = SerialSwitch(tag, devices.paths, SUBNET, 1, program=ProgramOptions(core=core))
    try:
        yield serial.start()
    finally:
        serial.stop()
        assert serial.netns not in namespaces(), "switch namespace left behind"
