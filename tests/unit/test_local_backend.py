"""Pure parts of the local backend: names, subnet choice, device command lines, processes.

None of these needs root: the names and the subnet are pure functions, and LocalProcess is
exercised on a plain `sleep` child of the test.
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from testbed.backends import local
from testbed.backends.base import DeviceSpec
from testbed.backends.local import LocalBackend, LocalProcess
from testbed.errors import DeviceError
from testbed.experiment.devices_section import MAX_DEVICES
from testbed.kernel.addresses import choose_subnet
from testbed.kernel.names import IFNAME_MAX_CHARS, LINK_PATTERN, NETNS_PATTERN, RunNames, run_tag

RUN_IDS = [uuid.uuid4().hex for _ in range(200)] + ["2024-05-01T12:00:00 sweep/α", "x", ""]
ALL_CANDIDATES = ipaddress.IPv4Network("10.192.0.0/10")  # holds 10.200.0.0 ... 10.254.255.0


def net(text: str) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(text)


def test_interface_names_fit_the_kernel_limit_for_every_rank() -> None:
    for run_id in RUN_IDS[:20] + RUN_IDS[-3:]:
        names = RunNames.for_run(run_id)
        assert len(names.bridge) <= IFNAME_MAX_CHARS
        for rank in range(MAX_DEVICES):
            assert len(names.port(rank)) <= IFNAME_MAX_CHARS


def test_a_port_name_that_would_be_too_long_is_refused() -> None:
    with pytest.raises(ValueError, match="too long"):
        RunNames("0" * 8).port(100_000)


def test_names_are_unique_per_run_and_rank() -> None:
    namespaces, links = set(), set()
    for run_id in RUN_IDS:
        names = RunNames.for_run(run_id)
        namespaces.add(names.switch_netns)
        links.add(names.bridge)
        for rank in range(4):
            namespaces.add(names.device_netns(rank))
            links.add(names.port(rank))
    assert len(namespaces) == len(RUN_IDS) * 5
    assert len(links) == len(RUN_IDS) * 5


def test_names_are_stable_and_follow_the_documented_shape() -> None:
    names = RunNames.for_run("run-1")
    assert names == RunNames.for_run("run-1")
    tag = run_tag("run-1")
    assert len(tag) == 8 and int(tag, 16) >= 0
    assert names.device_netns(2) == f"tb-{tag}-d2"
    assert names.switch_netns == f"tb-{tag}-sw"
    assert names.bridge == f"tb{tag}"
    assert names.port(7) == f"tb{tag}h7"


def test_leftover_patterns_match_our_names_only() -> None:
    names = RunNames.for_run("run-1")
    for name in (names.switch_netns, names.device_netns(0), names.device_netns(253)):
        assert NETNS_PATTERN.match(name)["tag"] == names.tag
    assert LINK_PATTERN.match(names.bridge)["port"] is None
    assert LINK_PATTERN.match(names.port(3))["port"] == "h3"
    for foreign in ("tbx-a", "tb-1234567-d0", "tb-0123456789-d0", "testbed-x", "eth0", "tb"):
        assert NETNS_PATTERN.match(foreign) is None
    for foreign in ("tbx0", "tb1234567", "tb0123456789", "docker0", "tb01234567p0", "eth0"):
        assert LINK_PATTERN.match(foreign) is None


def test_subnet_is_a_private_24_in_the_documented_range() -> None:
    for run_id in RUN_IDS:
        subnet = choose_subnet(run_id, [])
        assert subnet.prefixlen == 24 and subnet.subnet_of(ALL_CANDIDATES)
        assert 200 <= subnet.network_address.packed[1] <= 254


def test_subnet_is_stable_per_run_and_spread_across_runs() -> None:
    assert choose_subnet("run-1", []) == choose_subnet("run-1", [])
    assert len({choose_subnet(run_id, []) for run_id in RUN_IDS}) > 0.95 * len(RUN_IDS)


def test_subnet_avoids_the_networks_in_use() -> None:
    for run_id in RUN_IDS[:50]:
        preferred = choose_subnet(run_id, [])
        used = [preferred, net("172.17.0.0/16"), net("192.0.2.0/24")]
        chosen = choose_subnet(run_id, used)
        assert not any(chosen.overlaps(network) for network in used)


def test_subnet_avoids_a_covering_route_and_a_host_address() -> None:
    preferred = choose_subnet("run-1", [])
    covering = preferred.supernet(new_prefix=12)
    host = net(f"{choose_subnet('run-1', [covering]).network_address + 7}/32")
    chosen = choose_subnet("run-1", [covering, host])
    assert not chosen.overlaps(covering) and not chosen.overlaps(host)


def test_subnet_choice_ignores_default_routes() -> None:
    assert choose_subnet("run-1", [net("0.0.0.0/0")]) == choose_subnet("run-1", [])


def test_subnet_choice_wraps_around_to_the_last_free_network() -> None:
    free = net("10.200.0.0/24")  # the first candidate: reached only by wrapping for most runs
    used = [n for n in ALL_CANDIDATES.subnets(new_prefix=16) if n != net("10.200.0.0/16")]
    used += [n for n in net("10.200.0.0/16").subnets(new_prefix=24) if n != free]
    assert choose_subnet("run-1", used) == free


def test_no_free_subnet_is_a_device_error() -> None:
    with pytest.raises(DeviceError, match="no /24"):
        choose_subnet("run-1", [net("10.0.0.0/8")])


def test_start_without_root_is_a_device_error_and_creates_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(local.os, "geteuid", lambda: 1000)
    created = []
    monkeypatch.setattr(LocalBackend, "_create_namespace", lambda self, name: created.append(name))
    backend = LocalBackend("run-1", tmp_path / "run")
    with pytest.raises(DeviceError, match="needs root"):
        backend.start(DeviceSpec(count=2))
    assert created == [] and backend.namespaces == []


def test_start_without_iproute2_is_a_device_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(local.os, "geteuid", lambda: 0)
    monkeypatch.setattr(local.shutil, "which", lambda name: None)
    with pytest.raises(DeviceError, match="iproute2"):
        LocalBackend("run-1", tmp_path).start(DeviceSpec(count=2))


def test_process_wait_kill_and_result(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = (
        "import pathlib, sys, time; sys.stderr.write('err'); print('out', flush=True); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(30)"
    )
    popen = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    process = LocalProcess(popen, "test")
    with pytest.raises(TimeoutError, match="still running"):
        process.wait(0.2)
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    begin = time.monotonic()
    process.kill()
    result = process.wait(5)
    assert time.monotonic() - begin < 2
    assert result.returncode == -9 and result.stdout == "out\n" and result.stderr == "err"
    process.kill()  # a second kill of an ended group is harmless
