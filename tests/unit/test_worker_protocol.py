"""The worker's protocol pieces in one process: handshake, clock estimate, mesh set-up, links."""

from __future__ import annotations

import socket
import threading

import pytest

from devices.errors import PeerLostError, ProtocolError
from devices.handshake import CLOCK_ROUNDS, make_hello, shake
from devices.mesh import Mesh
from devices.transport import CountingSocket, Outgoing


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


FIELDS = dict(
    devices=2,
    method="trace-b",
    params={"K": 16},
    partition=[9, 8],
    batch=2,
    model="vit-tiny",
    model_fingerprint="aa",
    bundle_fingerprint="bb",
    warmup=0,
    inferences=1,
    inputs="generated seed 0",
)
NAMES = ["device 0 (a:1)", "device 1 (b:2)"]


def run_pair(hello0: dict, hello1: dict) -> tuple[object, object]:
    """Handshake over a socket pair; device 1 is the side that connected. Returns each side's
    result or the exception it raised."""
    left, right = socket.socketpair()
    results: list[object] = [None, None]

    def side(index: int, sock: socket.socket, hello: dict, expected: set[int]) -> None:
        sock.settimeout(10)
        try:
            results[index] = shake(CountingSocket(sock), hello, expected, index == 1, NAMES)
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


def test_handshake_agrees_and_estimates_the_clock_offset():
    first, second = run_pair(make_hello(0, **FIELDS), make_hello(1, **FIELDS))
    assert first.peer == 1 and second.peer == 0
    assert len(second.round_trips_s) == CLOCK_ROUNDS
    assert second.clock_uncertainty_s == pytest.approx(min(second.round_trips_s) / 2)
    # one process, one clock: the offset is zero within the uncertainty
    assert abs(second.clock_offset_s) <= second.clock_uncertainty_s + 1e-4
    assert first.clock_offset_s == pytest.approx(-second.clock_offset_s)


def test_handshake_names_the_differing_field_on_both_sides():
    other = {**FIELDS, "bundle_fingerprint": "cc"}
    first, second = run_pair(make_hello(0, **FIELDS), make_hello(1, **other))
    assert isinstance(first, ProtocolError) and isinstance(second, ProtocolError)
    assert "device 1 has bundle fingerprint cc, device 0 has bb" in str(first)
    assert "device 0 has bundle fingerprint bb, device 1 has cc" in str(second)
    assert str(first).startswith("handshake with device 1 (b:2)")


def test_handshake_refuses_a_peer_claiming_the_wrong_rank():
    first, second = run_pair(make_hello(0, **FIELDS), make_hello(0, **FIELDS))
    assert "says it is device 0, expected device 1" in str(first)
    assert "refused the handshake" in str(second) or "expected device 0" in str(second)


def test_mesh_of_three_connects_exchanges_and_counts_bytes():
    """Three meshes in threads: set-up without deadlock, the start barrier, then messages of
    header-derived size (first byte = payload length) with exact byte counts."""
    addresses = [("127.0.0.1", port) for port in free_ports(3)]
    meshes = [Mesh(rank, addresses) for rank in range(3)]
    errors: list[BaseException] = []

    def setup(mesh: Mesh) -> None:
        hello = make_hello(mesh.rank, **FIELDS)
        names = [mesh.name(p) for p in range(3)]
        try:
            mesh.open(
                10, lambda conn, expected, connected: shake(conn, hello, expected, connected, names)
            )
            mesh.barrier(10)
            mesh.start(1, lambda peer: lambda header: 1 + header[0])
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
                assert link.take(5, "block 0").message == messages[peer].message
        for message in messages:
            assert message.done.wait(5) and not message.errors
            assert set(message.bytes_written.values()) == {len(message.message)}
        assert meshes[0].links[2].bytes_received == 4
    finally:  # graceful closes wait for the peers' EOFs: close all three at once
        closers = [threading.Thread(target=mesh.close, args=(True, 5)) for mesh in meshes]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(10)


def test_lost_peer_is_named_with_the_context():
    addresses = [("127.0.0.1", port) for port in free_ports(2)]
    meshes = [Mesh(rank, addresses) for rank in range(2)]
    threads = [
        threading.Thread(
            target=mesh.open,
            args=(10, lambda c, e, k, r=mesh.rank: shake(c, make_hello(r, **FIELDS), e, k, NAMES)),
        )
        for mesh in meshes
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    for mesh in meshes:
        mesh.start(0, lambda peer: lambda header: 4)
    meshes[1].close(graceful=False)
    with pytest.raises(
        PeerLostError,
        match=r"lost device 1 \(127.0.0.1:\d+\) before its "
        r"message for block 3 of inference 7",
    ):
        meshes[0].links[1].take(5, "block 3 of inference 7")
    meshes[0].close(graceful=False)
