"""The worker's protocol pieces in one process: handshake, clock estimate, mesh set-up, links,
kernel receive timestamps."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from devices import transport
from devices.clock import Clock
from devices.errors import ConnectError, PeerLostError, ProtocolError
from devices.frames import CountingSocket
from devices.handshake import CLOCK_ROUNDS, HandshakeSide, make_hello, shake
from devices.mesh import Mesh
from devices.transport import MessageFormat, Outgoing


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


RUN = {
    "id": "t",
    "method": "trace-b",
    "params": {"K": 16},
    "bundle_fingerprint": "bb",
    "inferences": 1,
}
FIELDS = dict(
    devices=2,
    runs=[RUN],
    partition=[9, 8],
    batch=2,
    model="vit-tiny",
    model_fingerprint="aa",
    warmup=0,
    inputs="generated seed 0",
    authenticated=False,
)
NAMES = ["device 0 (a:1)", "device 1 (b:2)"]


def run_pair(
    hello0: dict,
    hello1: dict,
    clocks: tuple[Clock, Clock] = (Clock(), Clock()),
    secrets: tuple[bytes | None, bytes | None] = (None, None),
) -> tuple[object, object]:
    """Handshake over a socket pair; device 1 is the side that connected. Returns each side's
    result or the exception it raised."""
    left, right = socket.socketpair()
    results: list[object] = [None, None]

    def side(index: int, sock: socket.socket, hello: dict, expected: set[int]) -> None:
        sock.settimeout(10)
        try:
            side = HandshakeSide(hello, NAMES, clocks[index], secret=secrets[index])
            results[index] = shake(CountingSocket(sock), side, expected, index == 1)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            results[index] = error

    threads = [
        threading.Thread(target=side, args=(0, left, hello0, {1})),
        threading.Thread(target=side, args=(1, right, hello1, {0})),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    left.close()
    right.close()
    return results[0], results[1]


@pytest.mark.parametrize("skew_s", [0.0, -3.5, 1234.25])
def test_handshake_agrees_and_estimates_the_clock_offset(skew_s):
    """Device 0's clock runs `skew_s` ahead of device 1's: both sides learn that offset
    within the uncertainty (half the best round trip)."""
    hellos = make_hello(0, **FIELDS), make_hello(1, **FIELDS)
    first, second = run_pair(*hellos, clocks=(Clock(skew_s), Clock()))
    assert first.peer == 1 and second.peer == 0
    assert len(second.round_trips_ns) == CLOCK_ROUNDS
    assert second.clock_uncertainty_ns == min(second.round_trips_ns) // 2
    assert abs(second.clock_offset_ns - skew_s * 1e9) <= second.clock_uncertainty_ns + 1e5
    assert first.clock_offset_ns == -second.clock_offset_ns
    assert first.clock_uncertainty_ns == second.clock_uncertainty_ns


def test_handshake_names_the_differing_field_on_both_sides():
    other = {**FIELDS, "runs": [{**RUN, "bundle_fingerprint": "cc"}]}
    first, second = run_pair(make_hello(0, **FIELDS), make_hello(1, **other))
    assert isinstance(first, ProtocolError) and isinstance(second, ProtocolError)
    assert "device 1 has runs (method, parameters, bundle fingerprint, inferences)" in str(first)
    assert "'bundle_fingerprint': 'cc'" in str(first) and "'bb'" in str(second)
    assert str(first).startswith("handshake with device 1 (b:2)")


def test_handshake_refuses_a_peer_claiming_the_wrong_rank():
    first, second = run_pair(make_hello(0, **FIELDS), make_hello(0, **FIELDS))
    assert "says it is device 0, expected device 1" in str(first)
    assert "refused the handshake" in str(second) or "expected device 0" in str(second)


def test_mesh_of_three_connects_exchanges_and_counts_bytes():
    """Three meshes in threads: set-up without deadlock, the start barrier, then messages of
    header-derived size (first byte = payload length) with exact byte counts."""
    addresses = [("127.0.0.1", port) for port in free_ports(3)]
    meshes = [Mesh(rank, addresses, Clock()) for rank in range(3)]
    errors: list[BaseException] = []

    def setup(mesh: Mesh) -> None:
        names = [mesh.name(p) for p in range(3)]
        side = HandshakeSide(make_hello(mesh.rank, **FIELDS), names, mesh.clock)
        try:
            mesh.open(10, lambda conn, expected, connected: shake(conn, side, expected, connected))
            mesh.barrier(10)
            mesh.start(lambda peer: iter([MessageFormat(1, lambda header: 1 + header[0])]))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=setup, args=(mesh,)) for mesh in meshes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    try:
        assert not errors, errors
        for mesh in meshes:
            assert sorted(mesh.links) == [r for r in range(3) if r != mesh.rank]
            assert mesh.control_bytes == {"sent": 2, "received": 2}
        messages = [Outgoing(0, bytes([rank + 1]) + bytes(rank + 1), 2) for rank in range(3)]
        for mesh, message in zip(meshes, messages, strict=True):
            mesh.post(message)
        for mesh in meshes:
            for peer, link in mesh.links.items():
                incoming = link.take(5, "block 0")
                assert incoming.message == messages[peer].message
                # the kernel stamped the last byte before the receiver thread read it
                assert link.kernel_timestamps and incoming.kernel_ns is not None
                assert 0 <= incoming.read_ns - incoming.kernel_ns < 1e9
                assert incoming.kernel_ns >= min(messages[peer].departed_ns.values())
        for message in messages:
            assert message.done.wait(5) and not message.errors
            assert set(message.bytes_written.values()) == {len(message.message)}
            for peer, departed in message.departed_ns.items():
                assert departed <= message.written_ns[peer]
        assert meshes[0].links[2].bytes_received == 4
    finally:  # graceful closes wait for the peers' EOFs: close all three at once
        closers = [threading.Thread(target=mesh.close, args=(True, 5)) for mesh in meshes]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(10)


def connected_pair() -> list[Mesh]:
    """Two meshes on free local ports, connected (handshakes done), not started."""
    addresses = [("127.0.0.1", port) for port in free_ports(2)]
    meshes = [Mesh(rank, addresses, Clock()) for rank in range(2)]

    def handshake(rank: int):
        side = HandshakeSide(make_hello(rank, **FIELDS), NAMES, Clock())
        return lambda c, e, k: shake(c, side, e, k)

    threads = [
        threading.Thread(target=mesh.open, args=(10, handshake(mesh.rank))) for mesh in meshes
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    return meshes


def test_lost_peer_is_named_with_the_context():
    meshes = connected_pair()
    for mesh in meshes:
        mesh.start(lambda peer: iter([MessageFormat(0, lambda header: 4)] * 10))
    meshes[1].close(graceful=False)
    with pytest.raises(
        PeerLostError,
        match=r"lost device 1 \(127.0.0.1:\d+\) before its "
        r"message for block 3 of inference 7",
    ):
        meshes[0].links[1].take(5, "block 3 of inference 7")
    meshes[0].close(graceful=False)


def test_data_after_the_last_expected_message_is_named():
    """The receiver follows the agreed schedule: a peer that sends more is out of step."""
    meshes = connected_pair()
    try:
        meshes[0].start(lambda peer: iter([MessageFormat(0, lambda header: 2)]))
        meshes[1].links[0].sock.sendall(b"okX")
        assert meshes[0].links[1].take(5, "block 0").message == b"ok"
        with pytest.raises(PeerLostError, match=r"sent data after its last message \(b'X'\.\.\.\)"):
            meshes[0].links[1].take(5, "block 1")
    finally:
        for mesh in meshes:
            mesh.close(graceful=False)


def test_a_message_no_peer_takes_names_the_peer():
    """A copy the kernel never took within the receive timeout (the peer stopped reading):
    the error names the peer that did not take it."""
    import tracevq
    from devices.session import Session
    from tracevq.methods import make_method

    meshes = connected_pair()
    try:
        method = make_method("voltage", tracevq.build_model("vit-tiny"))
        session = Session(method, 0, meshes[0], batch=1, recv_timeout_s=0.1)
        stuck = Outgoing(block=3, message=b"x", peers=1)
        with pytest.raises(PeerLostError) as raised:
            session._await_sends({3: stuck}, "inference 0 of run v")
        assert str(raised.value) == (
            f"the message for block 3 of inference 0 of run v was not written to "
            f"{meshes[0].name(1)} within 0.1 s (the peer stopped reading)"
        )
    finally:
        for mesh in meshes:
            mesh.close(graceful=False)


def test_a_mesh_listens_on_its_own_address_only():
    """Device 0 at 127.0.0.2 is not reachable at 127.0.0.1 (it would be on 0.0.0.0), and a
    device whose spec address is not the host's stops at once, naming the address."""
    (port,) = free_ports(1)
    mesh = Mesh(0, [("127.0.0.2", port), ("127.0.0.1", free_ports(1)[0])], Clock())
    accepted: list[str] = []

    def handshake(conn, expected, connected):
        accepted.append(conn.sock.getpeername()[0])
        raise TimeoutError  # ends the set-up: a ConnectError in the thread

    def open_mesh() -> None:
        with pytest.raises(ConnectError):
            mesh.open(3, handshake)

    opened = threading.Thread(target=open_mesh, daemon=True)
    opened.start()
    try:
        deadline = time.monotonic() + 10
        while mesh._listener is None:
            assert time.monotonic() < deadline and opened.is_alive(), "never listened"
            time.sleep(0.01)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    finally:
        opened.join(10)
        mesh.close(graceful=False)
    assert len(accepted) == 1  # the connection to 127.0.0.2
    foreign = Mesh(0, [("192.0.2.1", port), ("127.0.0.1", port)], Clock())
    with pytest.raises(ConnectError, match=r"cannot listen on 192\.0\.2\.1:\d+: Cannot assign"):
        foreign.open(3, None)


SECRET = bytes(range(16))


def test_devices_that_share_the_run_secret_agree():
    hellos = [make_hello(rank, **{**FIELDS, "authenticated": True}) for rank in (0, 1)]
    first, second = run_pair(*hellos, secrets=(SECRET, SECRET))
    assert first.peer == 1 and second.peer == 0
    assert first.hello["nonce"] != second.hello["nonce"]  # fresh per connection


def test_a_device_with_another_secret_is_refused_on_both_sides():
    hellos = [make_hello(rank, **{**FIELDS, "authenticated": True}) for rank in (0, 1)]
    first, second = run_pair(*hellos, secrets=(SECRET, bytes(16)))
    assert isinstance(first, ProtocolError) and isinstance(second, ProtocolError)
    assert str(first) == (
        "handshake with device 1 (b:2): its proof of the run secret is wrong: it does not "
        "know this run's secret"
    )
    assert str(second).startswith("handshake with device 0 (a:1): its proof of the run secret")


def test_a_device_without_the_secret_is_refused_by_name():
    first, second = run_pair(
        make_hello(0, **{**FIELDS, "authenticated": True}),
        make_hello(1, **FIELDS),
        secrets=(SECRET, None),
    )
    assert (
        str(first)
        == "handshake with device 1 (b:2): device 1 has run secret False, device 0 has True"
    )
    assert (
        str(second)
        == "handshake with device 0 (a:1): device 0 has run secret True, device 1 has False"
    )


def test_a_connection_that_reaches_itself_is_not_a_peer(monkeypatch):
    """TCP's simultaneous open: a connection to a port of the ephemeral range that nothing
    listens on may get that port as its own and reach itself (once in CI, a worker's test
    device met its own hello). connect() drops such a socket and tries again."""
    made = []

    def self_connected(address, timeout=None, source_address=None):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.connect(sock.getsockname())  # a real self-connection, as the race makes one
        made.append(sock)
        return sock

    monkeypatch.setattr(transport.socket, "create_connection", self_connected)
    with pytest.raises(ConnectError, match="last error: connected to itself"):
        transport.connect(("127.0.0.1", 9), time.perf_counter() + 0.3, "device 0")
    assert made and all(sock.fileno() == -1 for sock in made)  # every one closed
