"""The local backend for real: namespaces, veths and a bridge, processes pinned and killed.

Traffic goes only between the run's own namespaces. Every backend is stopped, and whatever its
run id names is removed, in fixture finalisers, also when a test fails. Whether anything
remains is checked with iproute2 (`ip netns list`, `ip link`), not with the code under test.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pyroute2 import NetNS

from testbed.backends.base import Device, DeviceSpec
from testbed.backends.local import LocalBackend
from testbed.errors import DeviceError
from testbed.kernel.names import run_tag
from testbed.kernel.netns import NETNS_DIR, pids_in, remove_leftovers

pytestmark = pytest.mark.netns

PORT = 5201
PAYLOAD_BYTES = 48 * 1024
TIMEOUT_S = 10.0

LISTENER = """
import hashlib, socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
server.settimeout(10)
conn, peer = server.accept()
conn.settimeout(10)
data = b""
while chunk := conn.recv(65536):
    data += chunk
print(len(data), hashlib.sha256(data).hexdigest(), peer[0])
"""

CLIENT = """
import socket, sys, time
payload = bytes(range(256)) * (int(sys.argv[3]) // 256)
deadline = time.monotonic() + 10
while True:  # until the listener is up
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
conn.sendall(payload)
conn.close()
"""

AFFINITY = """
import os
cores = ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))
print(cores, os.environ["OMP_NUM_THREADS"])
"""
CPUS_ALLOWED = (
    "print([l.split()[1] for l in open('/proc/self/status') if 'Cpus_allowed_list' in l])"
)


def leftovers(run_id: str) -> list[str]:
    """Lines of `ip netns list` and `ip -o link` that name something of the run."""
    tag = run_tag(run_id)
    lines = []
    for argv in (["ip", "netns", "list"], ["ip", "-o", "link", "show"]):
        output = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        lines += [line for line in output.splitlines() if tag in line]
    return lines


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def make_backend(root: None, tmp_path: Path) -> Iterator[Callable[..., LocalBackend]]:
    """Makes backends and removes all they (and their run ids) hold when the test ends."""
    made: list[LocalBackend] = []

    def make(run_id: str | None = None) -> LocalBackend:
        backend = LocalBackend(run_id or uuid.uuid4().hex, tmp_path / f"run-{len(made)}")
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.stop()
        remove_leftovers(backend.run_id)


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBackend]:
    backend = LocalBackend(uuid.uuid4().hex, tmp_path_factory.mktemp("three"))
    try:
        backend.start(DeviceSpec(count=3, cpus=1, memory_mb=512))
        yield backend
    finally:
        backend.stop()
        remove_leftovers(backend.run_id)


def test_each_device_has_its_address_on_eth0(three: LocalBackend) -> None:
    assert [device.rank for device in three.devices] == [0, 1, 2]
    assert len({device.address for device in three.devices}) == 3
    for device in three.devices:
        assert device.interface == "eth0"
        assert Path(device.netns_path).exists()
        assert device.netns_path == f"/var/run/netns/{device.name}"
        with NetNS(device.netns_path, flags=0) as ipr:  # as the shaping layer opens it
            eth0 = ipr.link_lookup(ifname="eth0")[0]
            assert ipr.get_links(eth0)[0].get("state") == "up"
            addresses = [(a.get("address"), a["prefixlen"]) for a in ipr.get_addr(index=eth0)]
            assert ipr.get_addr(family=socket.AF_INET6, index=eth0) == ()
            lo = ipr.get_links(ipr.link_lookup(ifname="lo")[0])[0]
        assert addresses == [(device.address, 24)]
        assert lo["flags"] & 1  # IFF_UP


def test_devices_have_no_way_out(three: LocalBackend) -> None:
    for device in three.devices:
        with NetNS(device.name, flags=0) as ipr:
            routes = [(r.get("dst"), r["dst_len"]) for r in ipr.get_routes(family=socket.AF_INET)]
        assert routes and all(prefix > 0 for _, prefix in routes), routes
    with NetNS(three.names.switch_netns, flags=0) as ipr:
        bridge = ipr.link_lookup(ifname=three.names.bridge)[0]
        assert ipr.get_addr(index=bridge) == ()
        assert len(ipr.get_links()) == 1 + 1 + 3  # lo, the bridge, one port per device
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert run_tag(three.run_id) not in host_links


def test_device_0_sends_a_payload_to_device_2_over_tcp(three: LocalBackend) -> None:
    d0, d2 = three.devices[0], three.devices[2]
    listener = three.spawn(d2, [three.python, "-c", LISTENER, d2.address, str(PORT)])
    client = three.run(
        d0, [three.python, "-c", CLIENT, d2.address, str(PORT), str(PAYLOAD_BYTES)], TIMEOUT_S
    )
    assert client.ok, client.tail()
    received = listener.wait(TIMEOUT_S)
    assert received.ok, received.tail()
    payload = bytes(range(256)) * (PAYLOAD_BYTES // 256)
    assert received.stdout.split() == [
        str(PAYLOAD_BYTES),
        hashlib.sha256(payload).hexdigest(),
        d0.address,
    ]


def test_run_returns_exit_code_stdout_and_stderr(three: LocalBackend) -> None:
    code = "import os, sys; print(os.environ['OMP_NUM_THREADS']); sys.stderr.write('boom'); exit(3)"
    result = three.run(three.devices[1], [three.python, "-c", code], TIMEOUT_S)
    assert (result.returncode, result.stdout, result.stderr) == (3, "1\n", "boom")
    assert three.run(three.devices[1], ["true"]).ok


GROUPS = """
import sys
groups = dict(line.strip().split(":")[1:] for line in open("/proc/self/cgroup"))
print(groups["memory"], groups["cpuset"], groups["cpu"], groups["freezer"])
"""


def test_every_process_of_a_device_is_in_its_control_groups(three: LocalBackend) -> None:
    device = three.devices[0]
    result = three.run(device, [three.python, "-c", GROUPS], TIMEOUT_S)
    assert result.stdout.split() == [f"/testbed/{device.name}"] * 4, result.tail()
    memory = Path(f"/sys/fs/cgroup/memory/testbed/{device.name}/memory.limit_in_bytes")
    assert int(memory.read_text()) == 512 * 2**20


def test_a_device_over_its_memory_is_killed_by_the_kernel(
    make_backend: Callable[..., LocalBackend],
) -> None:
    backend = make_backend()
    (device,) = backend.start(DeviceSpec(count=1, cpus=1, memory_mb=64))
    grow = "b = []\nwhile True: b.append(bytearray(2**20))"
    result = backend.run(device, [backend.python, "-c", grow], TIMEOUT_S)
    assert result.returncode == -9 and backend.out_of_memory(device)


def test_a_fractional_device_gets_a_cpu_quota(make_backend: Callable[..., LocalBackend]) -> None:
    backend = make_backend()
    devices = backend.start(DeviceSpec(count=2, cpus=[0.5, 1], memory_mb=512))
    cpu = Path(f"/sys/fs/cgroup/cpu/testbed/{devices[0].name}")
    assert int((cpu / "cpu.cfs_quota_us").read_text()) == 50_000
    assert int((cpu / "cpu.cfs_period_us").read_text()) == 100_000


# written whole (a new file renamed over the old): a reader, or a freeze between the
# truncation and the write, never leaves it empty
COUNTER = """
import os, sys, time
for n in range(100000):
    with open(sys.argv[1] + ".new", "w") as out:
        out.write(str(n))
    os.replace(sys.argv[1] + ".new", sys.argv[1])
    time.sleep(0.01)
"""


def test_pause_freezes_a_device_and_resume_thaws_it(three: LocalBackend, tmp_path: Path) -> None:
    device, counter = three.devices[2], tmp_path / "counter"
    process = three.spawn(device, [three.python, "-c", COUNTER, str(counter)])
    state = Path(f"/sys/fs/cgroup/freezer/testbed/{device.name}/freezer.state")
    deadline = time.monotonic() + TIMEOUT_S
    while not counter.exists() or not counter.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    three.pause(device)
    assert state.read_text().strip() == "FROZEN"
    frozen = counter.read_text()
    time.sleep(0.3)
    assert counter.read_text() == frozen
    three.resume(device)
    time.sleep(0.3)
    assert state.read_text().strip() == "THAWED" and int(counter.read_text()) > int(frozen) + 5
    process.kill()


def test_kill_ends_a_long_sleep_and_run_kills_on_timeout(three: LocalBackend) -> None:
    process = three.spawn(three.devices[1], ["sleep", "60"])
    with pytest.raises(TimeoutError):
        process.wait(0.3)
    begin = time.monotonic()
    process.kill()
    assert process.wait(5).returncode == -9
    assert time.monotonic() - begin < 2
    with pytest.raises(TimeoutError):
        three.run(three.devices[2], ["sleep", "60"], timeout_s=0.3)
    assert three.processes[-1].wait(5).returncode == -9


def test_pinned_devices_get_one_core_each(make_backend: Callable[..., LocalBackend]) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 host cores")
    backend = make_backend()
    d0, d1 = backend.start(DeviceSpec(count=2, cpus=1))
    assert not backend.oversubscribed and (d0.cpuset, d1.cpuset) == ("0", "1")
    for device, core in ((d0, 0), (d1, 1)):
        affinity = backend.run(device, [backend.python, "-c", AFFINITY], TIMEOUT_S)
        assert affinity.stdout.split() == [str(core), "1"], affinity.tail()
        allowed = backend.run(device, [backend.python, "-c", CPUS_ALLOWED], TIMEOUT_S)
        assert allowed.stdout.strip() == f"['{core}']"


def test_oversubscribed_devices_are_not_pinned(make_backend: Callable[..., LocalBackend]) -> None:
    cores = os.cpu_count() or 1
    backend = make_backend()
    devices = backend.start(DeviceSpec(count=2, cpus=cores))
    assert backend.oversubscribed and [device.cpuset for device in devices] == [None, None]
    result = backend.run(devices[1], [backend.python, "-c", AFFINITY], TIMEOUT_S)
    assert result.stdout.split() == [
        ",".join(str(core) for core in sorted(os.sched_getaffinity(0))),
        str(cores),
    ]


def test_stop_removes_everything_and_is_idempotent(
    make_backend: Callable[..., LocalBackend],
) -> None:
    backend = make_backend()
    devices = backend.start(DeviceSpec(count=2))
    assert len(leftovers(backend.run_id)) == 2 + 1  # two device namespaces, the switch
    sleeper = backend.spawn(devices[0], ["sleep", "60"])
    backend.stop()
    assert leftovers(backend.run_id) == []
    assert sleeper.wait(1).returncode == -9
    backend.stop()
    with pytest.raises(DeviceError, match="not a running device"):
        backend.spawn(devices[0], ["true"])


def test_context_manager_cleans_up_after_an_exception(tmp_path: Path, root: None) -> None:
    run_id = uuid.uuid4().hex
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with LocalBackend(run_id, tmp_path) as backend:
                devices = backend.start(DeviceSpec(count=2))
                sleeper = backend.spawn(devices[1], ["sleep", "60"])
                raise RuntimeError("inside the with")
        assert leftovers(run_id) == []
        assert not alive(sleeper.pid)
    finally:
        remove_leftovers(run_id)


@pytest.mark.parametrize("error", [DeviceError("injected"), KeyboardInterrupt()])
def test_a_failure_or_ctrl_c_inside_start_leaves_nothing(
    make_backend: Callable[..., LocalBackend],
    monkeypatch: pytest.MonkeyPatch,
    error: BaseException,
) -> None:
    create_device = LocalBackend._create_device

    def fail_on_rank_1(self: LocalBackend, rank: int, spec: DeviceSpec) -> Device:
        if rank == 1:
            raise error
        return create_device(self, rank, spec)

    monkeypatch.setattr(LocalBackend, "_create_device", fail_on_rank_1)
    backend = make_backend()
    with pytest.raises(type(error)):
        backend.start(DeviceSpec(count=3))
    assert backend.namespaces == [] and leftovers(backend.run_id) == []


def test_a_second_backend_with_the_same_run_id_is_refused(
    make_backend: Callable[..., LocalBackend],
) -> None:
    first = make_backend()
    devices = first.start(DeviceSpec(count=1))
    with pytest.raises(DeviceError, match="already exist"):
        make_backend(first.run_id).start(DeviceSpec(count=1))
    assert first.run(devices[0], ["true"]).ok


def test_remove_leftovers_clears_a_crashed_run_only(
    make_backend: Callable[..., LocalBackend],
) -> None:
    crashed, other = make_backend(), make_backend()
    devices = crashed.start(DeviceSpec(count=2))
    other.start(DeviceSpec(count=1))
    sleeper = crashed.spawn(devices[1], ["sleep", "60"])
    # a crashed run's processes are in their namespaces; this one may still be `ip netns
    # exec` before its setns (CI once removed the namespace first, and the sleep lived on)
    deadline = time.monotonic() + 5
    while sleeper.pid not in pids_in(NETNS_DIR / devices[1].name):
        assert time.monotonic() < deadline, "the sleeper never entered its namespace"
        time.sleep(0.01)
    removed = remove_leftovers(crashed.run_id)
    assert f"namespace {devices[0].name}" in removed
    assert f"namespace {crashed.names.switch_netns}" in removed
    assert leftovers(crashed.run_id) == []
    assert sleeper.wait(5).returncode == -9
    assert len(leftovers(other.run_id)) == 2
    assert other.run(other.devices[0], ["true"]).ok
