"""The network worker against the in-process simulation: real processes on 127.0.0.1.

Each session is a set of `python -m devices.worker` subprocesses on free local ports (vit-tiny,
a K=16 bundle, batch 2, one inference). The network path must change timing only: the logits
equal `tracevq.simulate`'s, every message is the analytic payload rounded up to bytes, and the
records show Trace-b's message leaving before the FFN it hides behind while the other methods
send only when a block starts. Every subprocess wait has a timeout; processes are killed in a
`finally` so that a failing test never leaves workers behind.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch

import tracevq
from devices.device import Device
from devices.handshake import shake
from devices.inputs import generated_batch
from devices.spec import resolve_spec
from devices.worker import load_method
from tracevq.bundle import fit_bundle
from tracevq.codec import encode_trace_message

REPO = Path(__file__).resolve().parents[2]
MODEL = "vit-tiny"
K = 16
BATCH = 2
SESSION_TIMEOUT_S = 60

METHODS = {
    "voltage": {},
    "prism": {"segment": 4},
    "astra": {"K": K},
    "trace-b": {"K": K},
    "trace-b-chain": {"K": K, "buffers": False},
    "trace-nb": {"K": K},
}


def method_name(case: str) -> str:
    return "trace-b" if case == "trace-b-chain" else case


def free_ports(count: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def worker_args(
    rank: int,
    peers: list[str],
    out: Path,
    method: str,
    params: dict,
    bundle: Path | None,
    *extra: str,
) -> list[str]:
    args = [
        sys.executable,
        "-m",
        "devices.worker",
        "--rank",
        str(rank),
        "--peers",
        ",".join(peers),
        "--model",
        MODEL,
        "--method",
        method,
        "--batch",
        str(BATCH),
        "--inferences",
        "1",
        "--threads",
        "1",
        "--out",
        str(out / f"device{rank}"),
        "--connect-timeout-s",
        "30",
        "--recv-timeout-s",
        "20",
    ]
    if bundle is not None:
        args += ["--bundle", str(bundle)]
    for key, value in params.items():
        args += ["--param", f"{key}={json.dumps(value)}"]
    return args + list(extra)


def start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(processes: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str]]:
    """(exit status, stderr) of each process; kills them all if one overruns."""
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for process in processes:
            _, stderr = process.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results.append((process.returncode, stderr))
    finally:
        kill_all(processes)
    return results


def kill_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.communicate()


def run_session(
    tmp_path: Path, devices: int, method: str, params: dict, bundle: Path | None, *extra: str
) -> list[tuple[int, str]]:
    peers = [f"127.0.0.1:{port}" for port in free_ports(devices)]
    processes = []
    try:
        for rank in range(devices):
            processes.append(
                start(worker_args(rank, peers, tmp_path, method, params, bundle, *extra))
            )
    finally:
        results = finish(processes, SESSION_TIMEOUT_S)
    return results


def read_csv(path: Path) -> list[dict[str, float | str | None]]:
    def value(text: str) -> float | str | None:
        if text == "":
            return None
        try:
            return float(text)
        except ValueError:
            return text

    with open(path, newline="") as stream:
        rows = list(csv.DictReader(stream))
    # classes stay text ("3 7"); everything else is a number or empty
    return [{k: t if k == "predicted" else value(t) for k, t in row.items()} for row in rows]


@pytest.fixture(scope="module")
def model():
    return tracevq.build_model(MODEL)


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory, model) -> Path:
    calibration = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return fit_bundle(model, calibration, K=K).save(tmp_path_factory.mktemp("bundle") / "b.pt")


def simulate(model, bundle_path: Path, method: str, params: dict, devices: int):
    """The reference, with the workers' thread count (same reduction order, same VQ picks)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bundle = tracevq.Bundle.load(bundle_path)
        inputs = generated_batch(model.config, BATCH, seed=0, index=0)
        return tracevq.simulate(model, inputs, method, devices, bundle=bundle, **params)
    finally:
        torch.set_num_threads(threads)


def check_bytes(layers: list[dict], reference, rank: int, devices: int) -> None:
    """Each message put ceil(payload_bits / 8) bytes on each peer's socket, as simulated."""
    for row in layers:
        block = int(row["block"])
        assert row["wire_bytes"] == math.ceil(row["payload_bits"] / 8)
        assert row["payload_bits"] == reference.payload_bits[block, rank]
        assert row["wire_bytes"] == reference.wire_bytes[block, rank]
        peers = [p for p in range(devices) if p != rank]
        assert row["received_bytes"] == sum(reference.wire_bytes[block, p] for p in peers)


def check_order(layers: list[dict], trace: bool) -> None:
    """Within a device: where each message is queued relative to the FFNs."""
    for row in layers:
        assert row["block_start_ms"] <= row["attn_start_ms"] <= row["ffn_start_ms"]
        assert row["ffn_start_ms"] <= row["ffn_end_ms"]
        assert row["recv_end_ms"] <= row["attn_start_ms"]  # peers' data in before attention
        assert row["send_start_ms"] <= row["send_end_ms"]
    for before, row in zip(layers, layers[1:], strict=False):
        if trace:
            # the message for block b + 1 is queued before block b's FFN starts: it travels
            # while the FFN runs
            assert row["send_start_ms"] <= before["ffn_start_ms"] < before["ffn_end_ms"]
        else:
            # queued only when block b + 1 starts, after block b's FFN: nothing to hide behind
            assert before["ffn_end_ms"] <= row["send_start_ms"] <= row["attn_start_ms"]


def check_transfers_before_ffn(outs: list[Path], devices: int) -> None:
    """Voltage/Prism/Astra, across devices (one host: one clock): every message for block b
    travels from its queueing on the sender (after the sender's FFN of block b - 1, see
    check_order) to its arrival at the receiver, which precedes the receiver's FFN of block b.
    So no FFN of either end overlaps the transfer: the payload is on the critical path."""
    starts = [read_csv(out / "inferences.csv")[0]["start_clock_s"] * 1000 for out in outs]
    rows = [read_csv(out / "layers.csv") for out in outs]
    for block in range(len(rows[0])):
        for sender in range(devices):
            queued = starts[sender] + rows[sender][block]["send_start_ms"]
            for receiver in set(range(devices)) - {sender}:
                arrived = starts[receiver] + rows[receiver][block]["recv_end_ms"]
                ffn = starts[receiver] + rows[receiver][block]["ffn_start_ms"]
                assert queued <= arrived <= ffn


@pytest.mark.parametrize("devices", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", list(METHODS))
def test_worker_matches_simulation(tmp_path, model, bundle_path, case, devices):
    method, params = method_name(case), METHODS[case]
    bundle = bundle_path if method in ("astra", "trace-b", "trace-nb") else None
    results = run_session(tmp_path, devices, method, params, bundle)
    for rank, (status, stderr) in enumerate(results):
        assert status == 0, f"worker {rank} failed: {stderr}"
    reference = simulate(model, bundle_path, method, params, devices)
    logits = np.load(tmp_path / "device0" / "logits.npy")  # (inferences, B, classes)
    assert logits.shape == (1, BATCH, model.config.num_classes)
    np.testing.assert_allclose(logits[0], reference.logits.numpy(), atol=1e-5, rtol=0)

    outs = [tmp_path / f"device{rank}" for rank in range(devices)]
    for rank, out in enumerate(outs):
        layers = read_csv(out / "layers.csv")
        assert [int(row["block"]) for row in layers] == list(range(model.config.depth))
        check_bytes(layers, reference, rank, devices)
        check_order(layers, trace=method.startswith("trace"))
        (record,) = read_csv(out / "inferences.csv")
        assert record["effective_ms"] == pytest.approx(
            record["compute_ms"] + record["wait_ms"], abs=1e-3
        )
        assert record["wire_bytes"] == sum(row["wire_bytes"] for row in layers)
        session = json.loads((out / "session.json").read_text())
        assert session["status"] == "done"
        assert session["threads"] == {"requested": 1, "torch": 1}
        assert session["bytes"]["payload"]["sent"] == record["wire_bytes"] * (devices - 1)
        assert session["bytes"]["handshake"]["sent"] > 0
        assert set(session["handshakes"]) == {str(p) for p in range(devices) if p != rank}
        if rank == 0:
            predicted = [int(c) for c in record["predicted"].split()]
            assert predicted == reference.logits.argmax(-1).tolist()
    if not method.startswith("trace"):
        check_transfers_before_ffn(outs, devices)


def test_auto_level_picks_coarsest_on_a_slow_link(tmp_path, model, bundle_path):
    """level_k=auto with a 100 bit/s link: nothing fits under the FFN (even level 0's 24 bits
    take 240 ms, far more than a loaded machine's FFN of this model), so level 0 (1 bit); the
    logits are those of the simulation at that level. Two threads, recorded."""
    params = {"K": K, "level_k": "auto"}
    results = run_session(
        tmp_path, 2, "trace-b", params, bundle_path, "--rate-mbit", "0.0001", "--threads", "2"
    )
    for rank, (status, stderr) in enumerate(results):
        assert status == 0, f"worker {rank} failed: {stderr}"
    reference = simulate(model, bundle_path, "trace-b", {"K": K, "level_k": 2}, 2)
    logits = np.load(tmp_path / "device0" / "logits.npy")
    np.testing.assert_allclose(logits[0], reference.logits.numpy(), atol=1e-5, rtol=0)
    for rank in range(2):
        out = tmp_path / f"device{rank}"
        session = json.loads((out / "session.json").read_text())
        assert session["level"]["mode"] == "auto" and session["level"]["level"] == 0
        assert session["level"]["ffn_ms"] > 0
        assert session["threads"]["torch"] == 2
        (record,) = read_csv(out / "inferences.csv")
        assert (record["level"], record["r_bits"]) == (0, 1)


def test_mismatched_bundle_is_refused_on_both_sides(tmp_path, model, bundle_path):
    other = fit_bundle(model, torch.randn(4, 3, 32, 32), K=K, families=("astra",), seed=1)
    other_path = other.save(tmp_path / "other.pt")
    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    processes = []
    try:
        for rank, bundle in enumerate((bundle_path, other_path)):
            processes.append(start(worker_args(rank, peers, tmp_path, "astra", {"K": K}, bundle)))
    finally:
        results = finish(processes, SESSION_TIMEOUT_S)
    for rank, (status, stderr) in enumerate(results):
        assert status != 0
        (line,) = stderr.strip().splitlines()  # one line, no traceback
        assert line.startswith(f"worker {rank}: ")
        assert "bundle fingerprint" in line and f"device {1 - rank}" in line


def test_peer_that_never_starts_times_out_naming_it(tmp_path):
    lonely_connector = [f"127.0.0.1:{port}" for port in free_ports(2)]  # rank 0 never runs
    lonely_listener = [f"127.0.0.1:{port}" for port in free_ports(2)]  # rank 1 never runs
    began = time.monotonic()
    processes = [
        start(
            worker_args(
                1, lonely_connector, tmp_path / "a", "voltage", {}, None, "--connect-timeout-s", "1"
            )
        ),
        start(
            worker_args(
                0, lonely_listener, tmp_path / "b", "voltage", {}, None, "--connect-timeout-s", "1"
            )
        ),
    ]
    (status_a, stderr_a), (status_b, stderr_b) = finish(processes, SESSION_TIMEOUT_S)
    assert time.monotonic() - began < 30
    assert status_a != 0 and status_b != 0
    assert f"worker 1: device 0 ({lonely_connector[0]})" in stderr_a
    assert "did not accept a connection" in stderr_a
    assert f"worker 0: device 1 ({lonely_listener[1]}) did not connect within 1 s" in stderr_b


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_stopped_worker_fails_the_others_promptly(tmp_path, bundle_path, stop):
    """Stop device 1 mid-session: devices 0 and 2 exit non-zero within a few seconds, naming
    the lost device and the block they needed its message for. On SIGTERM device 1 itself
    unwinds: one line, status 143, session.json says failed."""
    peers = [f"127.0.0.1:{port}" for port in free_ports(3)]
    processes = []
    try:
        for rank in range(3):
            args = worker_args(rank, peers, tmp_path, "trace-b", {"K": K}, bundle_path)
            processes.append(start(args + ["--inferences", "1000000"]))
        sessions = [tmp_path / f"device{rank}" / "session.json" for rank in range(3)]
        deadline = time.monotonic() + SESSION_TIMEOUT_S
        while not all(path.exists() for path in sessions):
            assert time.monotonic() < deadline, "the session did not start"
            assert all(p.poll() is None for p in processes), "a worker exited early"
            time.sleep(0.1)
        time.sleep(1.0)  # well into the inferences
        processes[1].send_signal(stop)
        stopped_at = time.monotonic()
        results = finish(processes, 10)
        assert time.monotonic() - stopped_at < 5
    finally:
        kill_all(processes)
    for rank in (0, 2):
        status, stderr = results[rank]
        assert status != 0
        assert stderr.startswith(f"worker {rank}: lost device 1 ({peers[1]})"), stderr
        assert "block" in stderr and "inference" in stderr
        session = json.loads(sessions[rank].read_text())
        assert session["status"] == "failed" and "device 1" in session["error"]
    if stop == signal.SIGTERM:
        assert results[1] == (143, "worker 1: terminated by SIGTERM\n")
        assert json.loads(sessions[1].read_text())["status"] == "failed"


def corrupted(case: str) -> bytes:
    """What the fake device 1 (8 tokens x batch 2, 4-bit indices) sends for block 0."""
    valid = encode_trace_message(np.zeros(16, dtype=np.int64), 4, 3, 0)
    if case == "block-counter":
        return encode_trace_message(np.zeros(16, dtype=np.int64), 4, 3, 5)
    if case == "too-long":
        return valid + bytes(16)  # the extra bytes become block 1's "message"
    if case == "unknown-level":
        return bytes([0x0F]) + valid[1:]  # level 15: the tree has levels 0..3
    return valid[:-1]  # too short: the worker waits for the last byte until its timeout


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            "block-counter",
            r"inference 0: trace-b message from device 1 for block 0: block counter "
            r"mismatch: expected 0 .* received 5",
        ),
        (
            "too-long",
            r"inference 0: trace-b message from device 1 for block 1: block counter "
            r"mismatch: expected 1",
        ),
        (
            "unknown-level",
            r"inference 0: trace-b message from device 1 for block 0: level 15 not in the "
            r"codebook tree",
        ),
        ("too-short", r"no message from device 1 .* for block 0 of inference 0 within 3 s"),
    ],
    ids=["block-counter", "too-long", "unknown-level", "too-short"],
)
def test_corrupted_message_fails_the_worker_naming_peer_and_block(
    tmp_path, bundle_path, case, expected
):
    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    spec = resolve_spec(
        None,
        {
            "rank": 1,
            "peers": ",".join(peers),
            "model": MODEL,
            "bundle": bundle_path,
            "method": "trace-b",
            "batch": 2,
            "out": tmp_path / "fake",
        },
        [f"K={K}"],
    )
    method, bundle = load_method(spec, tracevq.build_model(MODEL))
    fake = Device(spec, method, bundle)
    hello, names = fake.hello(), [fake.mesh.name(p) for p in range(2)]
    worker = start(
        worker_args(0, peers, tmp_path, "trace-b", {"K": K}, bundle_path, "--recv-timeout-s", "3")
    )
    try:
        with fake.mesh as mesh:
            mesh.open(
                30, lambda conn, wanted, connected: shake(conn, hello, wanted, connected, names)
            )
            mesh.barrier(30)
            mesh.links[0].sock.sendall(corrupted(case))
            ((status, stderr),) = finish([worker], 30)
    finally:
        kill_all([worker])
    assert status != 0
    assert stderr.startswith("worker 0: ") and len(stderr.strip().splitlines()) == 1
    assert re.search(expected, stderr), stderr


def test_single_device_with_checkpoint_and_inputs_file_records_accuracy(tmp_path):
    """P = 1: no peers, no messages; the logits are the plain model's, with the weights of a
    checkpoint. Inputs from a file with labels: batch i is rows 2i, 2i + 1; device 0 records
    predictions and hits."""
    model = tracevq.build_model(MODEL, seed=3)
    torch.save(model.state_dict(), tmp_path / "weights.pth")
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(images)
    labels = expected.argmax(-1).clone()
    labels[0] = (labels[0] + 1) % model.config.num_classes  # one miss in the first batch
    torch.save({"inputs": images, "labels": labels}, tmp_path / "inputs.pt")
    ((status, stderr),) = run_session(
        tmp_path,
        1,
        "voltage",
        {},
        None,
        "--inputs",
        str(tmp_path / "inputs.pt"),
        "--inferences",
        "2",
        "--checkpoint",
        str(tmp_path / "weights.pth"),
    )
    assert status == 0, stderr
    logits = np.load(tmp_path / "device0" / "logits.npy")
    np.testing.assert_allclose(logits.reshape(4, -1), expected.numpy(), atol=1e-5, rtol=0)
    records = read_csv(tmp_path / "device0" / "inferences.csv")
    assert [r["correct"] for r in records] == [1, 2]
    predicted = " ".join(r["predicted"] for r in records).split()
    assert [int(c) for c in predicted] == expected.argmax(-1).tolist()
    layers = read_csv(tmp_path / "device0" / "layers.csv")
    assert all(row["wire_bytes"] == 0 and row["wait_ms"] == 0 for row in layers)
    session = json.loads((tmp_path / "device0" / "session.json").read_text())
    assert session["inputs"].startswith("file ")
