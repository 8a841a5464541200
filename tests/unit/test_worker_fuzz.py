"""A worker that trusts no peer: a scripted peer, over real TCP on 127.0.0.1, sends random
bytes, malformed handshakes (wrong types, missing keys, deep nesting, huge lengths and
strings, NaN), truncated frames and messages, out-of-range codebook indices and non-finite
activations to a real device (`devices.device.Device`, the object `python -m devices.worker`
runs, in a thread of the test). Every case must end within TIME_LIMIT_S (generous for a
loaded two-core host) in the typed error that names the peer (its rank and address, or the
address it connects from before it has a valid rank) and, once the session runs, the block
and the inference. A few cases run the real `python -m devices.worker` to check the CLI's
one line and exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_worker_protocol import free_ports

import tracevq
from devices.device import Device
from devices.errors import ConnectError, PeerLostError, ProtocolError
from devices.frames import CLOCK_RANGE_NS, FRAME_HEADER, CountingSocket
from devices.handshake import (
    CLOCK_ROUNDS,
    HandshakeSide,
    clock_answer,
    ping,
    round_mark,
    shake,
)
from devices.spec import MethodRun, RunSpec
from devices.worker import load_methods
from tracevq.bundle import FitSettings, fit_bundle
from tracevq.codec import encode_trace_message

REPO = Path(__file__).resolve().parents[2]
MODEL = "vit-tiny"
K = 12  # not a power of two: 4-bit indices reach 15, tree levels of 2, 3, 6 and 12 codewords
BATCH = 2
TIME_LIMIT_S = 20
CONNECT_TIMEOUT_S = 5  # a peer that says too little is given up on after this

RUNS = {
    "voltage": MethodRun(id="v", method="voltage"),
    "prism": MethodRun(id="p", method="prism", params={"segment": 4}),
    "astra": MethodRun(id="a", method="astra", params={"K": K}),
    "astra-packed": MethodRun(id="ap", method="astra", params={"K": K, "packed": True}),
    "trace-b": MethodRun(id="t", method="trace-b", params={"K": K, "level_k": 3}),
}


@pytest.fixture(scope="module")
def model():
    return tracevq.build_model(MODEL)


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory, model) -> Path:
    calibration = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    bundle = fit_bundle(model, calibration, FitSettings(K, families=("astra", "trace-b")))
    return bundle.save(tmp_path_factory.mktemp("bundle") / "b.pt")


def make_spec(
    tmp_path: Path, rank: int, peers: list[str], case: str, bundle: Path, **extra: Any
) -> RunSpec:
    run = RUNS[case]
    if run.method != "voltage" and run.method != "prism":
        run = run.model_copy(update={"bundle": bundle})
    return RunSpec(
        rank=rank,
        peers=peers,
        model=MODEL,
        runs=[run],
        batch=BATCH,
        out=tmp_path / f"device{rank}",
        connect_timeout_s=CONNECT_TIMEOUT_S,
        recv_timeout_s=10,
        **extra,
    )


class Worker:
    """A real device of the session, run in a thread: `outcome()` is its exception."""

    def __init__(self, spec: RunSpec, model: Any):
        self.device = Device(spec, model, load_methods(spec, model))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.began = time.monotonic()
        self.thread.start()

    def _run(self) -> None:
        try:
            self.device.run()
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            self.error = error

    def outcome(self) -> BaseException | None:
        self.thread.join(TIME_LIMIT_S)
        assert not self.thread.is_alive(), f"the worker hung for {TIME_LIMIT_S} s"
        assert time.monotonic() - self.began < TIME_LIMIT_S
        return self.error


def connect(port: int) -> socket.socket:
    """The scripted peer's connection to the worker, once it listens."""
    deadline = time.monotonic() + TIME_LIMIT_S
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=TIME_LIMIT_S)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline, "the worker never listened"
            time.sleep(0.05)


def frame(payload: object) -> bytes:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return FRAME_HEADER.pack(len(body)) + body


def valid_hello(worker: Worker, rank: int) -> dict[str, Any]:
    """What the worker's peer of `rank` would say: the worker's own hello, but that rank (and
    a nonce, which `shake` adds to every connection's hello)."""
    return {**worker.device.hello(), "rank": rank, "nonce": "0" * 32}


def with_batch(hello: dict[str, Any], text: str) -> bytes:
    """A frame of `hello` whose batch is the raw JSON `text`."""
    return frame(json.dumps({**hello, "batch": "@"}).replace('"@"', text).encode())


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


# case -> (what the scripted peer sends given a valid hello, pattern of the worker's error)
HELLO_CASES = {
    "random-bytes": (lambda h: random.Random(7).randbytes(64), r"frame of (at least )?\d+ bytes"),
    "huge-length": (
        lambda h: FRAME_HEADER.pack(2**32 - 1),
        r"frame of at least 4278190080 bytes \(limit",
    ),
    "huge-length-under-2^24": (
        lambda h: FRAME_HEADER.pack(2**24 - 1),
        r"frame of 16777215 bytes \(limit",
    ),
    "not-json": (lambda h: frame(b"\xff\xfe{rank"), "handshake frame is not JSON"),
    "json-array": (lambda h: frame([h]), "handshake frame is a JSON list, not an object"),
    "nan": (lambda h: with_batch(h, "NaN"), "NaN is not a JSON number"),
    "overflowing-float": (lambda h: with_batch(h, "1e999"), "overflows a double"),
    "deep-nesting": (lambda h: frame(b"[" * 200_000 + b"]" * 200_000), "nested too deeply"),
    "nested-field": (lambda h: frame({**h, "runs": nested(500)}), r"malformed hello: runs\.0"),
    "missing-key": (
        lambda h: frame({k: v for k, v in h.items() if k != "runs"}),
        "malformed hello: runs: Field required",
    ),
    "string-rank": (
        lambda h: frame({**h, "rank": "1"}),
        "malformed hello: rank: Input should be a valid integer",
    ),
    "bool-batch": (lambda h: frame({**h, "batch": True}), "malformed hello: batch"),
    "huge-int": (lambda h: frame({**h, "rank": 10**4000}), "rank: Input should be less than"),
    "too-many-digits": (lambda h: with_batch(h, "9" * 5000), "handshake frame is not JSON"),
    "huge-string": (
        lambda h: frame({**h, "model": "x" * 500_000}),
        "model: String should have at most",
    ),
    "unknown-key": (lambda h: frame({**h, "extra": {}}), "extra: Extra inputs are not permitted"),
    "params-not-scalar": (
        lambda h: frame({**h, "runs": [{**h["runs"][0], "params": {"K": [1]}}]}),
        r"runs\.0\.params\.K",
    ),
    "wrong-rank": (lambda h: frame({**h, "rank": 0}), "says it is device 0, expected device 1"),
    "wrong-protocol": (
        lambda h: frame({**h, "protocol": [[[]]]}),
        "speaks protocol version a JSON list",
    ),
    "truncated-frame": (lambda h: frame(h)[:40], "closed the connection during the handshake"),
    "silence": (lambda h: b"", r"did not finish in time"),
    "trickle": (lambda h: FRAME_HEADER.pack(1000), r"did not finish in time"),
}


@pytest.mark.parametrize("case", list(HELLO_CASES))
def test_a_malformed_hello_is_refused_naming_the_peer(tmp_path, model, bundle_path, case):
    """The worker (device 0) accepts the scripted peer's connection: the peer sends the
    case's bytes instead of a valid hello; truncated and silent peers close or stall."""
    ports = free_ports(2)
    peers = [f"127.0.0.1:{port}" for port in ports]
    worker = Worker(make_spec(tmp_path, 0, peers, "voltage", bundle_path), model)
    payload, expected = HELLO_CASES[case]
    with connect(ports[0]) as sock:
        sock.sendall(payload(valid_hello(worker, 1)))
        if case == "truncated-frame":
            sock.shutdown(socket.SHUT_WR)
        if case == "trickle":  # one byte every 0.2 s: each read would wait, never the whole
            while worker.thread.is_alive() and time.monotonic() - worker.began < TIME_LIMIT_S:
                try:
                    sock.sendall(b" ")
                except OSError:
                    break
                time.sleep(0.2)
        error = worker.outcome()
    assert isinstance(error, ProtocolError | ConnectError), repr(error)
    text = str(error)
    assert "a device connecting from 127.0.0.1:" in text, text
    if isinstance(error, ProtocolError):
        assert text.startswith("handshake with a device connecting from 127.0.0.1:"), text
    if case == "random-bytes":  # the length prefix is random: too long, or never all sent
        expected = f"{expected}|did not finish in time"
    assert re.search(expected, text), text
    assert "Traceback" not in text and "\n" not in text


@contextlib.contextmanager
def connecting_worker(tmp_path, model, bundle_path) -> Iterator[tuple[Worker, socket.socket, list]]:
    """The worker as device 1, connected to the scripted device 0 listening on its port:
    (the worker, the scripted side's socket, the peers' addresses)."""
    ports = free_ports(2)
    peers = [f"127.0.0.1:{port}" for port in ports]
    with socket.create_server(("127.0.0.1", ports[0])) as server:
        worker = Worker(make_spec(tmp_path, 1, peers, "voltage", bundle_path), model)
        server.settimeout(TIME_LIMIT_S)
        sock, _ = server.accept()
        with sock:
            yield worker, sock, peers


def test_the_connecting_side_refuses_a_malformed_hello_naming_the_device(
    tmp_path, model, bundle_path
):
    """The worker is device 1 and connects to the scripted device 0, which answers with a
    hello whose runs are nested 5,000 deep (deeper than the JSON parser goes)."""
    with connecting_worker(tmp_path, model, bundle_path) as (worker, sock, peers):
        body = json.dumps({**valid_hello(worker, 0), "runs": "@"})
        sock.sendall(frame(body.replace('"@"', "[" * 5000 + "]" * 5000).encode()))
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    assert (
        str(error) == f"handshake with device 0 ({peers[0]}): handshake frame is nested too deeply"
    )


def test_a_peer_from_another_address_is_refused(tmp_path, model, bundle_path):
    """A valid hello claiming device 1, from an address that is not device 1's."""
    ports = free_ports(2)
    peers = [f"127.0.0.1:{ports[0]}", f"127.0.0.9:{ports[1]}"]
    worker = Worker(make_spec(tmp_path, 0, peers, "voltage", bundle_path), model)
    with connect(ports[0]) as sock:
        sock.sendall(frame(valid_hello(worker, 1)))
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    assert (
        f"device 1 ({peers[1]}) connects from 127.0.0.1, but the spec gives that device "
        "127.0.0.9" in str(error)
    )


def estimate(**changes: Any) -> dict[str, Any]:
    """A clock estimate that is valid but for `changes`."""
    valid = {"offset_ns": 0, "uncertainty_ns": 0, "round_trips_ns": [0] * CLOCK_ROUNDS}
    return {**valid, "latency_ns": 0, **changes}


@pytest.mark.parametrize(
    ("verdict", "estimate", "expected"),
    [
        ({"ok": "yes", "error": None}, None, "malformed verdict: ok: Input should be a valid"),
        ({"ok": False, "error": "x" * 100_000}, None, "malformed verdict: error: String"),
        (
            None,
            {"offset_ns": 1.5, "uncertainty_ns": 0, "round_trips_ns": [0] * CLOCK_ROUNDS},
            "malformed clock estimate: offset_ns",
        ),
        (
            None,
            {"offset_ns": 0, "uncertainty_ns": 0, "round_trips_ns": [0] * 10**5},
            "malformed clock estimate: round_trips_ns",
        ),
        (
            None,
            {"offset_ns": 2**70, "uncertainty_ns": 0, "round_trips_ns": [0] * CLOCK_ROUNDS},
            "malformed clock estimate: offset_ns",
        ),
        (
            None,
            {"offset_ns": 0, "uncertainty_ns": 0, "round_trips_ns": [0] * CLOCK_ROUNDS},
            "malformed clock estimate: latency_ns",
        ),
        # within int64, beyond what the measuring side's own answers (0..2^62) can give
        (None, estimate(offset_ns=2**63 - 1), "malformed clock estimate: offset_ns: Input"),
        (None, estimate(offset_ns=-(2**63) + 1), "malformed clock estimate: offset_ns: Input"),
        (None, estimate(uncertainty_ns=CLOCK_RANGE_NS), "malformed clock estimate: uncertainty"),
        (
            None,
            estimate(round_trips_ns=[0] * (CLOCK_ROUNDS - 1) + [2**63 - 1]),
            f"malformed clock estimate: round_trips_ns.{CLOCK_ROUNDS - 1}: Input",
        ),
        (None, estimate(latency_ns=-CLOCK_RANGE_NS), "malformed clock estimate: latency_ns: Input"),
    ],
    ids=[
        "verdict-type",
        "verdict-huge",
        "offset-float",
        "round-trips-long",
        "offset-huge",
        "latency-missing",
        "offset-int64-max",
        "offset-int64-min",
        "uncertainty-2^62",
        "round-trip-int64-max",
        "latency-minus-2^62",
    ],
)
def test_a_malformed_verdict_or_clock_estimate_is_refused(
    tmp_path, model, bundle_path, verdict, estimate, expected
):
    """A valid hello, then a bad verdict, or a good verdict, the clock ping-pong and a bad
    estimate; the worker names device 1 with its address."""
    ports = free_ports(2)
    peers = [f"127.0.0.1:{port}" for port in ports]
    worker = Worker(make_spec(tmp_path, 0, peers, "voltage", bundle_path), model)
    with connect(ports[0]) as sock:
        sock.sendall(frame(valid_hello(worker, 1)))
        sock.sendall(frame(verdict or {"ok": True, "error": None}))
        if estimate is not None:
            for index in range(CLOCK_ROUNDS):
                sock.sendall(ping(index))
                sock.recv(len(clock_answer(index, 0, 0)), socket.MSG_WAITALL)
            sock.sendall(frame(estimate))
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    assert str(error).startswith(f"handshake with device 1 ({peers[1]}): {expected}"), str(error)


# Messages, after a valid handshake: (run, block-0 message of the scripted device 1, pattern)
def voltage_with(value: float) -> bytes:
    x = np.zeros((BATCH, 8, 64), dtype="<f4")  # vit-tiny: 8 tokens on device 1, dim 64
    x[1, 3, 5] = value
    return x.tobytes()


MESSAGE_CASES = {
    "voltage-nan": (
        "voltage",
        voltage_with(float("nan")),
        "voltage message from {peer} for block 0: 1 values are not finite",
    ),
    "voltage-inf": ("voltage", voltage_with(float("-inf")), "1 values are not finite"),
    "prism-nan": (
        "prism",
        np.full((BATCH, 2, 64), np.nan, dtype="<f4").tobytes(),
        "prism message from {peer} for block 0: 256 values are not finite",
    ),
    "astra-word": (
        "astra",
        np.full(BATCH * 8, 40_000, dtype="<u2").tobytes(),
        "astra message from {peer} for block 0: index 40000 out of range for K = 12",
    ),
    "astra-random": (
        "astra",
        random.Random(3).randbytes(2 * BATCH * 8),
        "astra message from {peer} for block 0: index \\d+ out of range for K = 12",
    ),
    "astra-packed": ("astra-packed", bytes([0xFF]) * 8, "index 15 out of range for K = 12"),
    "trace-level": (
        "trace-b",
        encode_trace_message(np.full(BATCH * 8, 3), 2, 1, 0),
        "trace-b message from {peer} for block 0: index 3 out of range for level 1",
    ),
    "trace-finest": (
        "trace-b",
        encode_trace_message(np.arange(BATCH * 8), 4, 3, 0),
        "index 15 out of range for level 3's K_m = 12",
    ),
}


def session_with_scripted_peer(
    tmp_path: Path, model: Any, bundle_path: Path, case: str
) -> tuple[Device, list[str]]:
    """A fake device 1 (the real mesh and handshake) whose session the worker joins."""
    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    spec = make_spec(tmp_path / "fake", 1, peers, case, bundle_path)
    return Device(spec, model, load_methods(spec, model)), peers


def open_fake(fake: Device) -> None:
    side = HandshakeSide(fake.hello(), [fake.mesh.name(p) for p in range(2)], fake.clock)
    fake.mesh.open(
        TIME_LIMIT_S, lambda conn, wanted, connected: shake(conn, side, wanted, connected)
    )
    fake.mesh.barrier(TIME_LIMIT_S)


def peer_sees_the_end(sock: socket.socket) -> bool:
    """The refusing worker closed its connection: its peer reads the end within 5 s (so a
    real peer fails at once, naming the worker, instead of waiting for its timeout)."""
    deadline = time.monotonic() + 5
    try:
        while time.monotonic() < deadline:  # past the worker's own messages, to the end
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            if sock.recv(1 << 16) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


@pytest.mark.parametrize("case", list(MESSAGE_CASES))
def test_a_bad_message_is_refused_naming_peer_block_and_inference(
    tmp_path, model, bundle_path, case
):
    run, message, expected = MESSAGE_CASES[case]
    fake, peers = session_with_scripted_peer(tmp_path, model, bundle_path, run)
    worker = Worker(make_spec(tmp_path, 0, peers, run, bundle_path), model)
    with fake.mesh:
        open_fake(fake)
        fake.mesh.links[0].sock.sendall(message)
        error = worker.outcome()
        assert peer_sees_the_end(fake.mesh.links[0].sock)
    assert isinstance(error, ProtocolError), repr(error)
    run_id = RUNS[run].id
    prefix = f"inference 0 of run {run_id}: "
    assert str(error).startswith(prefix), str(error)
    pattern = expected.replace("{peer}", rf"device 1 \({peers[1]}\)")
    assert re.search(pattern, str(error)), str(error)


def test_a_truncated_message_names_peer_block_and_inference(tmp_path, model, bundle_path):
    """Half a Voltage message, then the peer closes."""
    fake, peers = session_with_scripted_peer(tmp_path, model, bundle_path, "voltage")
    worker = Worker(make_spec(tmp_path, 0, peers, "voltage", bundle_path), model)
    with fake.mesh:
        open_fake(fake)
        fake.mesh.links[0].sock.sendall(voltage_with(0.0)[:1000])
        fake.mesh.links[0].close()
        error = worker.outcome()
    assert isinstance(error, PeerLostError), repr(error)
    assert str(error) == (
        f"lost device 1 ({peers[1]}) before its message for block 0 of inference 0 of run v: "
        "the connection was closed mid-message after 1000 bytes"
    )


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            "voltage-nan",
            "voltage message from device 1 ({peer}) for block 0: 1 values are not finite (NaN/inf)",
        ),
        (
            "astra-word",
            "astra message from device 1 ({peer}) for block 0: index 40000 out of range for K = 12",
        ),
        (
            "trace-level",
            "trace-b message from device 1 ({peer}) for block 0: index 3 out of "
            "range for level 1's K_m = 3",
        ),
    ],
    ids=["voltage-nan", "astra-word", "trace-level"],
)
def test_the_worker_process_exits_non_zero_with_one_line(
    tmp_path, model, bundle_path, case, expected
):
    """`python -m devices.worker` itself: one line naming peer, block and inference, exit 1."""
    run, message, _ = MESSAGE_CASES[case]
    fake, peers = session_with_scripted_peer(tmp_path, model, bundle_path, run)
    path = make_spec(tmp_path, 0, peers, run, bundle_path).write(tmp_path / "spec0.json")
    began = time.monotonic()
    worker = subprocess.Popen(
        [sys.executable, "-m", "devices.worker", str(path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with fake.mesh:
            open_fake(fake)
            fake.mesh.links[0].sock.sendall(message)
            _, stderr = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert worker.returncode == 1
    line = f"worker 0: inference 0 of run {RUNS[run].id}: {expected.format(peer=peers[1])}\n"
    assert stderr == line
    assert time.monotonic() - began < 60


def secret_file(path: Path, secret: bytes) -> Path:
    path.write_text(secret.hex())
    return path


def test_devices_sharing_the_run_secret_run_and_another_secret_is_refused(
    tmp_path, model, bundle_path
):
    """Two real devices with the same secret file finish their session; a third session's
    device 1 holds another secret: both sides refuse, naming each other."""
    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    key = secret_file(tmp_path / "run.key", bytes(range(16)))
    workers = [
        Worker(make_spec(tmp_path, rank, peers, "voltage", bundle_path, secret_file=key), model)
        for rank in (0, 1)
    ]
    assert [worker.outcome() for worker in workers] == [None, None]
    session = json.loads((tmp_path / "device0" / "session.json").read_text())
    assert session["status"] == "done" and session["handshakes"]["1"]["hello"]["authenticated"]
    assert bytes(range(16)).hex() not in json.dumps(session)  # the path only, never the secret

    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    other = secret_file(tmp_path / "other.key", bytes(16))
    workers = [
        Worker(
            make_spec(tmp_path / "b", rank, peers, "voltage", bundle_path, secret_file=file), model
        )
        for rank, file in enumerate((key, other))
    ]
    errors = [worker.outcome() for worker in workers]
    assert all(isinstance(error, ProtocolError) for error in errors), errors
    assert str(errors[0]).startswith(f"handshake with device 1 ({peers[1]}): its proof of the run")
    assert str(errors[1]).startswith(f"handshake with device 0 ({peers[0]}): its proof of the run")


@pytest.mark.parametrize("sent", ["f" * 64, None], ids=["wrong-proof", "no-proof"])
def test_a_peer_that_cannot_prove_the_secret_is_refused(tmp_path, model, bundle_path, sent):
    """The scripted peer copies the worker's hello (claiming a secret, with a nonce) but
    cannot compute the proof."""
    ports = free_ports(2)
    peers = [f"127.0.0.1:{port}" for port in ports]
    key = secret_file(tmp_path / "run.key", bytes(range(16)))
    spec = make_spec(tmp_path, 0, peers, "voltage", bundle_path, secret_file=key)
    worker = Worker(spec, model)
    with connect(ports[0]) as sock:
        sock.sendall(frame(valid_hello(worker, 1)))
        sock.sendall(frame({"ok": True, "error": None, "proof": sent}))
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    wrong = "wrong" if sent else "missing"
    assert str(error) == (
        f"handshake with device 1 ({peers[1]}): its proof of the run secret is {wrong}: it "
        "does not know this run's secret"
    )


# The holes a hostile peer found after the cases above: a reset right after the handshake,
# finite values too large for the model, messages sent twice, text that drives a terminal,
# clock answers that are not times.


def test_a_peer_that_resets_right_after_the_handshake_is_named(tmp_path, model, bundle_path):
    """The scripted device 1 finishes the handshake, then resets its connection (SO_LINGER
    0) instead of sending the start signal: the worker's barrier names it, whichever of its
    send and its read meets the reset."""
    fake, peers = session_with_scripted_peer(tmp_path, model, bundle_path, "voltage")
    worker = Worker(make_spec(tmp_path, 0, peers, "voltage", bundle_path), model)
    side = HandshakeSide(fake.hello(), [fake.mesh.name(p) for p in range(2)], fake.clock)
    with fake.mesh:
        fake.mesh.open(
            TIME_LIMIT_S, lambda conn, wanted, connected: shake(conn, side, wanted, connected)
        )
        sock = fake.mesh.links[0].sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        error = worker.outcome()
    assert isinstance(error, PeerLostError), repr(error)
    assert str(error).startswith(f"lost device 1 ({peers[1]}) before the session started ("), error


@pytest.mark.parametrize(
    ("run", "message", "problem"),
    [
        ("voltage", np.full((BATCH, 8, 64), 3e38, "<f4"), "its keys and values are not finite"),
        # Prism's means are projected without a LayerNorm: finite keys and values whose
        # attention stays finite and whose FFN overflows
        (
            "prism",
            np.full((BATCH, 2, 64), 1e30, "<f4"),
            "block 0's FFN overflows (values not finite)",
        ),
    ],
    ids=["voltage-layernorm", "prism-ffn"],
)
def test_finite_values_too_large_for_the_model_name_the_peer(
    tmp_path, model, bundle_path, run, message, problem
):
    """3e38 is finite, and overflows the receiver's LayerNorm; 1e30 as Prism's means
    overflows its FFN: the worker refuses the block before it sends anything made from it,
    naming the peer, the block, the inference and the run."""
    fake, peers = session_with_scripted_peer(tmp_path, model, bundle_path, run)
    worker = Worker(make_spec(tmp_path, 0, peers, run, bundle_path), model)
    with fake.mesh:
        open_fake(fake)
        fake.mesh.links[0].sock.sendall(message.tobytes())
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    assert str(error) == (
        f"inference 0 of run {RUNS[run].id}: {run} message from device 1 ({peers[1]}) for "
        f"block 0: {problem}"
    )


def test_a_peer_that_sends_every_message_twice_is_refused_at_the_end(tmp_path, model, bundle_path):
    """Voltage messages carry no block number: the copies pass for the next blocks'
    messages, and what is left after the last one is the protocol error."""
    fake, peers = session_with_scripted_peer(tmp_path, model, bundle_path, "voltage")
    worker = Worker(make_spec(tmp_path, 0, peers, "voltage", bundle_path), model)
    expected = len(list(worker.device._formats(1, worker.device.slots())))
    with fake.mesh:
        open_fake(fake)
        sock = fake.mesh.links[0].sock
        for _ in range(expected):
            sock.sendall(voltage_with(0.5) * 2)
        sock.shutdown(socket.SHUT_WR)
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    assert str(error) == (
        f"device 1 ({peers[1]}) sent data after its last message (b'\\x00'...): the peers "
        "are out of step"
    )
    session = json.loads((tmp_path / "device0" / "session.json").read_text())
    assert session["status"] == "failed" and "sent data after its last message" in session["error"]


TERMINAL_TRICK = "\x1b]0;owned\x07\x1b[2K\rworker 0: all good"


@pytest.mark.parametrize("where", ["hello-model", "refusal"])
def test_text_a_peer_controls_is_escaped(tmp_path, model, bundle_path, where):
    """A hello's model and a refusal's reason reach the error line as escapes, never as the
    escape sequences, carriage returns and bells that would drive a terminal."""
    ports = free_ports(2)
    peers = [f"127.0.0.1:{port}" for port in ports]
    worker = Worker(make_spec(tmp_path, 0, peers, "voltage", bundle_path), model)
    with connect(ports[0]) as sock:
        hello = valid_hello(worker, 1)
        if where == "hello-model":
            sock.sendall(frame({**hello, "model": TERMINAL_TRICK}))
        else:
            sock.sendall(frame(hello))
            sock.sendall(frame({"ok": False, "error": TERMINAL_TRICK}))
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    text = str(error)
    assert text.isprintable(), repr(text)
    assert "\\x1b]0;owned\\x07\\x1b[2K\\rworker 0: all good" in text, text


def accepted_until_the_first_ping(worker: Any, sock: socket.socket) -> None:
    """As the scripted device 0 of a worker that is device 1: hello and verdict exchanged,
    then the worker's first clock ping read."""
    sock.settimeout(TIME_LIMIT_S)
    sock.sendall(frame(valid_hello(worker, 0)))
    sock.sendall(frame({"ok": True, "error": None}))
    conn = CountingSocket(sock)
    conn.recv_frame(), conn.recv_frame()  # its hello and its verdict
    assert conn.recv_exact(len(ping(0))) == ping(0)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (lambda t0: (-(2**63), 0), "gives times -9223372036854775808 and 0 ns, outside 0..2^62"),
        (lambda t0: (t0, t0 + 10**10), "spends 10000000000 ns between the ping and its answer"),
    ],
    ids=["int64-min", "turnaround-past-the-round-trip"],
)
def test_clock_answers_that_are_not_times_are_refused(
    tmp_path, model, bundle_path, answer, expected
):
    """The worker is device 1 and drives the clock ping-pong with the scripted device 0,
    whose first answer is not a time: refused before it becomes an offset."""
    with connecting_worker(tmp_path, model, bundle_path) as (worker, sock, peers):
        accepted_until_the_first_ping(worker, sock)
        sock.sendall(clock_answer(0, *answer(time.time_ns())))
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    assert str(error).startswith(
        f"handshake with device 0 ({peers[0]}): clock answer 0 {expected}"
    ), str(error)


# The last holes: a peer's key a megabyte long, a clock estimate anywhere in int64 (above), a
# peer out of step in the clock rounds, a Prism overflow without its inference.

MEGABYTE_KEY = "k" * 1_000_000


@pytest.mark.parametrize("where", ["params", "top-level"])
def test_a_huge_key_in_a_hello_is_shortened_in_the_error(tmp_path, model, bundle_path, where):
    """A key of 10^6 characters (the frame holds it) is a field's path in the error: the
    error line and session.json keep a few dozen characters of it."""
    ports = free_ports(2)
    worker = Worker(
        make_spec(tmp_path, 0, [f"127.0.0.1:{p}" for p in ports], "voltage", bundle_path), model
    )
    hello = valid_hello(worker, 1)
    if where == "params":
        hello["runs"] = [{**hello["runs"][0], "params": {MEGABYTE_KEY: 1}}]
    else:
        hello[MEGABYTE_KEY] = 1
    with connect(ports[0]) as sock:
        sock.sendall(frame(hello))
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    text = str(error)
    shown = "k" * 37 + "..."
    expected = {
        "params": f"runs.0.params.{shown}.[key]: String should have at most 1000 characters",
        "top-level": f"{shown}: Extra inputs are not permitted",
    }[where]
    assert text.startswith("handshake with a device connecting from 127.0.0.1:"), text[:300]
    assert text.endswith(f": malformed hello: {expected}"), text[:300]
    assert len(text) < 500, len(text)
    session = json.loads((tmp_path / "device0" / "session.json").read_text())
    assert session["status"] == "failed" and session["error"] == text


def answer_rounds(sock: socket.socket, rounds: int) -> None:
    """The scripted side that connects: `rounds` clock rounds as they should be."""
    for index in range(rounds):
        sock.sendall(ping(index))
        sock.recv(len(clock_answer(index, 0, 0)), socket.MSG_WAITALL)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("small-pings", "clock round 1 out of step (it opens with b'p', not b'q')"),
        ("large-first", "clock round 1 out of step (it opens with b'\\x00', not b'q')"),
        ("extra-round", "handshake frame of at least 2013265920 bytes (limit"),
    ],
)
def test_a_peer_out_of_step_in_the_clock_rounds_is_refused_at_once(
    tmp_path, model, bundle_path, case, expected
):
    """The scripted device 1 connects and sends a small ping in every round, or a large ping
    first, or a ninth round where its estimate is due, then waits for the answer: the worker
    refuses it at the first byte that is out of step, never at the set-up's deadline
    (CONNECT_TIMEOUT_S, which ends in a ConnectError)."""
    ports = free_ports(2)
    peers = [f"127.0.0.1:{port}" for port in ports]
    worker = Worker(make_spec(tmp_path, 0, peers, "voltage", bundle_path), model)
    with connect(ports[0]) as sock:
        sock.sendall(frame(valid_hello(worker, 1)))
        sock.sendall(frame({"ok": True, "error": None}))
        if case == "small-pings":
            answer_rounds(sock, 1)
            sock.sendall(round_mark(0))
        elif case == "large-first":
            sock.sendall(round_mark(0) + ping(1)[1:])  # round 0's mark, round 1's padding
            sock.recv(len(clock_answer(0, 0, 0)), socket.MSG_WAITALL)
        else:
            answer_rounds(sock, CLOCK_ROUNDS)
            sock.sendall(round_mark(CLOCK_ROUNDS))
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    assert str(error).startswith(f"handshake with device 1 ({peers[1]}): {expected}"), str(error)


def test_a_peer_that_answers_out_of_step_is_refused_at_once(tmp_path, model, bundle_path):
    """The worker is device 1 and drives the clock rounds; the scripted device 0 answers round
    0 with a large answer (round 1's size): the worker refuses it at round 1's first byte."""
    with connecting_worker(tmp_path, model, bundle_path) as (worker, sock, peers):
        accepted_until_the_first_ping(worker, sock)
        now = time.time_ns()
        large = clock_answer(1, now, now)
        sock.sendall(round_mark(0) + large[1:])
        error = worker.outcome()
    assert isinstance(error, ProtocolError), repr(error)
    assert str(error) == (
        f"handshake with device 0 ({peers[0]}): clock round 1 out of step (it opens with "
        "b'\\x00', not b'q')"
    )
