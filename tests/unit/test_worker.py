"""The network worker against the in-process simulation: real processes on 127.0.0.1.

Each session is a set of `python -m devices.worker SPEC` subprocesses on free local ports
(vit-tiny, a K=16 bundle, batch 2). The network path must change timing only: the logits of
every run equal `tracevq.simulate`'s, every message is the analytic payload rounded up to
bytes, and the records show Trace-b's message leaving before the FFN it hides behind while
the other methods send only when a block starts. Several runs share one session, their
inferences interleaved. Every subprocess wait has a timeout; processes are killed in a
`finally` so that a failing test never leaves workers behind.
"""

from __future__ import annotations

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
from typing import Any

import numpy as np
import pytest
import torch

import tracevq
from devices.device import Device
from devices.handshake import HandshakeSide, shake
from devices.inputs import generated_batch
from devices.pace import PROGRESS_FILE, read_progress, write_control
from devices.records import read_records, read_session
from devices.spec import MethodRun, RunSpec
from devices.transport import STAMP
from devices.worker import load_methods
from tracevq.bundle import FitSettings, fit_bundle
from tracevq.codec import encode_trace_message

REPO = Path(__file__).resolve().parents[2]
MODEL = "vit-tiny"
K = 16
BATCH = 2
SESSION_TIMEOUT_S = 90

METHODS = {
    "voltage": ("voltage", {}),
    "prism": ("prism", {"segment": 4}),
    "astra": ("astra", {"K": K}),
    "trace-b": ("trace-b", {"K": K}),
    "trace-b-chain": ("trace-b", {"K": K, "buffers": False}),
    "trace-nb": ("trace-nb", {"K": K}),  # placement 1 A.i: no message for block 0
    "trace-nb-1b-ffn": ("trace-nb", {"K": K, "placement": "1 B", "remote_ffn": True}),
    "trace-b-2a": ("trace-b", {"K": K, "placement": "2 A"}),
}


def free_ports(count: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def method_run(case: str, bundle: Path | None, inferences: int = 1) -> MethodRun:
    method, params = METHODS[case]
    uses_bundle = method in ("astra", "trace-b", "trace-nb")
    return MethodRun(
        id=case,
        method=method,
        params=params,
        bundle=bundle if uses_bundle else None,
        inferences=inferences,
    )


def write_spec(
    tmp_path: Path, rank: int, peers: list[str], runs: list[MethodRun], **extra: Any
) -> Path:
    fields = dict(
        rank=rank,
        peers=peers,
        model=MODEL,
        runs=runs,
        batch=BATCH,
        threads=1,
        out=tmp_path / f"device{rank}",
        connect_timeout_s=30,
        recv_timeout_s=20,
    )
    fields.update(extra)
    tmp_path.mkdir(parents=True, exist_ok=True)
    return RunSpec(**fields).write(tmp_path / f"spec{rank}.json")


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
    tmp_path: Path, devices: int, runs: list[MethodRun], **extra: Any
) -> list[tuple[int, str]]:
    peers = [f"127.0.0.1:{port}" for port in free_ports(devices)]
    paths = [write_spec(tmp_path, rank, peers, runs, **extra) for rank in range(devices)]
    processes = []
    try:
        for path in paths:
            processes.append(start([sys.executable, "-m", "devices.worker", str(path)]))
    finally:
        results = finish(processes, SESSION_TIMEOUT_S)
    return results


@pytest.fixture(scope="module")
def model():
    return tracevq.build_model(MODEL)


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory, model) -> Path:
    calibration = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return fit_bundle(model, calibration, FitSettings(K)).save(
        tmp_path_factory.mktemp("bundle") / "b.pt"
    )


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


def check_bytes(blocks, reference, rank: int, devices: int) -> None:
    """Each message put ceil(payload_bits / 8) bytes on each peer's socket, as simulated."""
    for row in blocks:
        assert row.message_bytes == math.ceil(row.payload_bits / 8)
        assert row.payload_bits == reference.payload_bits[row.block, rank]
        assert row.message_bytes == reference.wire_bytes[row.block, rank]
        peers = [p for p in range(devices) if p != rank]
        assert row.received_bytes == sum(reference.wire_bytes[row.block, p] for p in peers)


def check_unique_keys(blocks, method: str, params: dict, tokens: int) -> None:
    """dedup (on by default) records the distinct remote codewords of every block where the
    remote K/V depend on the index alone: astra, trace-b (2 A: not block 0, the exact
    embedding), trace-nb at 1 B's block 0 (1 A.i: nowhere)."""
    placement = params.get("placement")
    for row in blocks:
        deduped = (
            method == "astra"
            or (method == "trace-b" and (row.block > 0 or placement != "2 A"))
            or (method == "trace-nb" and placement == "1 B" and row.block == 0)
        )
        if deduped:
            assert 1 <= row.unique_remote_keys <= min(K, BATCH * tokens)
        else:
            assert row.unique_remote_keys is None


def check_order(blocks, trace: bool) -> None:
    """Within a device: where each message leaves relative to the FFNs."""
    for row in blocks:
        assert row.start_ns <= row.wait_start_ns <= row.wait_end_ns <= row.ffn_start_ns
        assert row.ffn_start_ns <= row.ffn_end_ns
        # exact-embedding placements send nothing for block 0
        assert row.departed_ns is None or row.departed_ns <= row.written_ns
    for before, row in zip(blocks, blocks[1:], strict=False):
        if trace:
            # the message for block b + 1 leaves before block b's FFN starts: it travels
            # while the FFN runs
            assert row.departed_ns <= before.ffn_start_ns < before.ffn_end_ns
        else:
            # it leaves only when block b + 1 starts, after block b's FFN: nothing to hide behind
            assert before.ffn_end_ns <= row.departed_ns <= row.wait_start_ns


def check_arrivals(records: list, run: str) -> None:
    """Across devices (one host, one clock): every message departs before the kernel stamps
    its arrival, which precedes the receiver thread's read and the receiver's attention."""
    departed = {
        (rank, b.inference, b.block): b.departed_ns
        for rank, r in enumerate(records)
        for b in r.blocks
        if b.run == run
    }
    for r in records:
        waits = {(b.inference, b.block): b.wait_end_ns for b in r.blocks if b.run == run}
        arrivals = [a for a in r.arrivals if a.run == run]
        assert arrivals and r.session.kernel_timestamps
        for a in arrivals:
            assert departed[(a.peer, a.inference, a.block)] <= a.kernel_ns <= a.read_ns
            assert a.read_ns <= waits[(a.inference, a.block)]


@pytest.mark.parametrize("devices", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_worker_matches_simulation(tmp_path, model, bundle_path, devices):
    """Every method in one session, two inferences each, interleaved round-robin."""
    runs = [method_run(case, bundle_path, inferences=2) for case in METHODS]
    results = run_session(tmp_path, devices, runs, warmup=1)
    for rank, (status, stderr) in enumerate(results):
        assert status == 0, f"worker {rank} failed: {stderr}"
    records = [read_records(tmp_path / f"device{rank}") for rank in range(devices)]
    order = [(r.run, r.inference) for r in records[0].inferences]
    assert order == [(case, i) for i in range(2) for case in METHODS]  # interleaved
    for case, (method, params) in METHODS.items():
        reference = simulate(model, bundle_path, method, params, devices)
        logits = np.load(tmp_path / "device0" / "logits" / f"{case}.npy")  # (I, B, classes)
        assert logits.shape == (2, BATCH, model.config.num_classes)
        for inference in range(2):  # the same input batch 0, 1 for every run
            expected = simulate_input(model, bundle_path, method, params, devices, inference)
            np.testing.assert_allclose(logits[inference], expected, atol=1e-5, rtol=0, err_msg=case)
        for rank, device in enumerate(records):
            blocks = [b for b in device.blocks if b.run == case and b.inference == 0]
            assert [b.block for b in blocks] == list(range(model.config.depth))
            check_bytes(blocks, reference, rank, devices)
            check_order(blocks, trace=method.startswith("trace"))
            check_unique_keys(blocks, method, params, model.config.tokens)
            for record in (r for r in device.inferences if r.run == case):
                assert record.effective_ms == pytest.approx(
                    record.compute_ms + record.wait_ms, abs=1e-3
                )
            if rank == 0:
                predicted = next(r for r in device.inferences if r.run == case).predicted
                assert predicted == reference.logits.argmax(-1).tolist()
        check_arrivals(records, case)
    for rank, device in enumerate(records):
        session = device.session
        assert session.status == "done"
        assert session.threads == {"requested": 1, "torch": 1}
        assert session.bytes["handshake"]["sent"] > 0
        assert set(session.clock_offset_ns) == {p for p in range(devices) if p != rank}
        sent = sum(b.message_bytes for b in device.blocks) * (devices - 1)
        warmups = session.bytes["payload"]["sent"] - sent  # one warm-up of each run
        assert warmups == sent / 2


def simulate_input(model, bundle_path, method, params, devices, index, levels=None):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bundle = tracevq.Bundle.load(bundle_path)
        inputs = generated_batch(model.config, BATCH, seed=0, index=index)
        return tracevq.simulate(
            model, inputs, method, devices, bundle=bundle, levels=levels, **params
        ).logits
    finally:
        torch.set_num_threads(threads)


def test_auto_level_starts_coarsest_on_a_slow_link_then_follows_the_messages(
    tmp_path, model, bundle_path
):
    """level_k=auto with a 100 bit/s link given at the start: nothing fits under the FFN (even
    level 0's 24 bits take 240 ms, far more than a loaded machine's FFN of this model), so the
    first inference runs at level 0 (1 bit), and so does the second: the start's level came
    from this device's own rate, and the peer's measure of its messages comes back with the
    peer's stamps of the second inference. From then on each device re-chooses from that
    echo; whatever it chose, the logits of every inference are the simulation's at the level
    that inference recorded, and the estimate it chose from is recorded. Two threads."""
    run = MethodRun(
        id="auto",
        method="trace-b",
        params={"K": K, "level_k": "auto"},
        bundle=bundle_path,
        inferences=3,
    )
    results = run_session(tmp_path, 2, [run], rate_mbit=0.0001, threads=2, warmup=0)
    for rank, (status, stderr) in enumerate(results):
        assert status == 0, f"worker {rank} failed: {stderr}"
    logits = np.load(tmp_path / "device0" / "logits" / "auto.npy")
    sizes = tracevq.Bundle.load(bundle_path).family("trace-b")[1][0].level_sizes
    for rank in range(2):
        device = read_records(tmp_path / f"device{rank}")
        choice = device.session.runs["auto"]["level_choice"]
        assert choice["mode"] == "auto" and choice["level"] == 0 and choice["ffn_ms"] > 0
        assert device.session.threads["torch"] == 2
        first, second, *later = device.inferences
        assert (first.level, first.level_k, first.r_bits, first.est_rate_mbit) == (0, 2, 1, None)
        assert (second.level, second.est_rate_mbit) == (0, None)
        assert later and all(r.est_rate_mbit is not None and r.est_rate_mbit > 0 for r in later)
        assert all(a.sent_ns is not None for a in device.arrivals)
        # the first inference's stamps echo nothing (nothing measured yet), later ones do
        echoes = {a.inference: a.echo_ps_per_byte for a in device.arrivals}
        assert echoes[0] is None and echoes[2] is not None and echoes[2] > 0
        assert device.session.bytes["stamps"]["sent"] == STAMP.size * model.config.depth * 3
    # each device chooses its own level; the simulation has one level for all, so inferences
    # where the two chose alike are checked (the first always: both start at level 0)
    levels = [
        [r.level for r in read_records(tmp_path / f"device{rank}").inferences] for rank in range(2)
    ]
    for index, (level, peer_level) in enumerate(zip(*levels, strict=True)):
        if level != peer_level:
            continue
        reference = simulate_input(
            model, bundle_path, "trace-b", {"K": K, "level_k": sizes[level]}, 2, index
        )
        np.testing.assert_allclose(logits[index], reference.numpy(), atol=1e-5, rtol=0)


def test_devices_at_different_levels_read_each_others_messages(tmp_path, model, bundle_path):
    """Devices of one session choose their levels on their own: here device 0 is given a
    100 bit/s link (level_k auto: the coarsest level), device 1 none (the finest). Each
    encodes at its own level and reads its peer's at the level in the header; the logits of
    every inference are the simulation's with each device at the level it recorded (after
    the first, each re-chooses from the messages: the levels may meet or stay apart)."""
    run = MethodRun(
        id="auto",
        method="trace-b",
        params={"K": K, "level_k": "auto"},
        bundle=bundle_path,
        inferences=2,
    )
    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    paths = [
        write_spec(tmp_path, 0, peers, [run], rate_mbit=0.0001, warmup=0),
        write_spec(tmp_path, 1, peers, [run], warmup=0),
    ]
    processes = [start([sys.executable, "-m", "devices.worker", str(path)]) for path in paths]
    for rank, (status, stderr) in enumerate(finish(processes, SESSION_TIMEOUT_S)):
        assert status == 0, f"worker {rank} failed: {stderr}"
    finest = len(tracevq.Bundle.load(bundle_path).family("trace-b")[1][0].level_sizes) - 1
    levels = [
        [r.level for r in read_records(tmp_path / f"device{rank}").inferences] for rank in range(2)
    ]
    assert (levels[0][0], levels[1][0]) == (0, finest), levels
    logits = np.load(tmp_path / "device0" / "logits" / "auto.npy")
    for index, pair in enumerate(zip(*levels, strict=True)):
        reference = simulate_input(
            model, bundle_path, "trace-b", {"K": K}, 2, index, levels=list(pair)
        )
        np.testing.assert_allclose(logits[index], reference.numpy(), atol=1e-5, rtol=0)


def test_mismatched_bundle_is_refused_on_both_sides(tmp_path, model, bundle_path):
    other = fit_bundle(
        model, torch.randn(4, 3, 32, 32), FitSettings(K, families=("astra",), seed=1)
    )
    other_path = other.save(tmp_path / "other.pt")
    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    processes = []
    try:
        for rank, bundle in enumerate((bundle_path, other_path)):
            path = write_spec(tmp_path, rank, peers, [method_run("astra", bundle)])
            processes.append(start([sys.executable, "-m", "devices.worker", str(path)]))
    finally:
        results = finish(processes, SESSION_TIMEOUT_S)
    for rank, (status, stderr) in enumerate(results):
        assert status != 0
        (line,) = stderr.strip().splitlines()  # one line, no traceback
        assert line.startswith(f"worker {rank}: ")
        assert "bundle_fingerprint" in line and f"device {1 - rank}" in line


def test_peer_that_never_starts_times_out_naming_it(tmp_path):
    lonely_connector = [f"127.0.0.1:{port}" for port in free_ports(2)]  # rank 0 never runs
    lonely_listener = [f"127.0.0.1:{port}" for port in free_ports(2)]  # rank 1 never runs
    runs = [method_run("voltage", None)]
    began = time.monotonic()
    paths = [
        write_spec(tmp_path / "a", 1, lonely_connector, runs, connect_timeout_s=1),
        write_spec(tmp_path / "b", 0, lonely_listener, runs, connect_timeout_s=1),
    ]
    processes = [start([sys.executable, "-m", "devices.worker", str(p)]) for p in paths]
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
    runs = [method_run("trace-b", bundle_path, inferences=1_000_000)]
    processes = []
    try:
        for rank in range(3):
            path = write_spec(tmp_path, rank, peers, runs)
            processes.append(start([sys.executable, "-m", "devices.worker", str(path)]))
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
        session = read_session(tmp_path / f"device{rank}")
        assert session.status == "failed" and "device 1" in session.error
    if stop == signal.SIGTERM:
        assert results[1] == (143, "worker 1: terminated by SIGTERM\n")
        assert read_session(tmp_path / "device1").status == "failed"


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
            r"inference 0 of run trace-b: trace-b message from device 1 \(127.0.0.1:\d+\) "
            r"for block 0: block counter mismatch: expected 0 .* received 5",
        ),
        (
            "too-long",
            r"inference 0 of run trace-b: trace-b message from device 1 \(127.0.0.1:\d+\) "
            r"for block 1: block counter mismatch: expected 1",
        ),
        (
            "unknown-level",
            r"inference 0 of run trace-b: trace-b message from device 1 \(127.0.0.1:\d+\) "
            r"for block 0: level 15 not in the codebook tree",
        ),
        (
            "too-short",
            r"no message from device 1 .* for block 0 of inference 0 of run trace-b within 3 s",
        ),
    ],
    ids=["block-counter", "too-long", "unknown-level", "too-short"],
)
def test_corrupted_message_fails_the_worker_naming_peer_and_block(
    tmp_path, bundle_path, case, expected
):
    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    runs = [method_run("trace-b", bundle_path)]
    spec = RunSpec.model_validate_json(write_spec(tmp_path / "fake", 1, peers, runs).read_text())
    model = tracevq.build_model(MODEL)
    fake = Device(spec, model, load_methods(spec, model))
    side = HandshakeSide(fake.hello(), [fake.mesh.name(p) for p in range(2)], fake.clock)
    worker_spec = write_spec(tmp_path, 0, peers, runs, recv_timeout_s=3)
    worker = start([sys.executable, "-m", "devices.worker", str(worker_spec)])
    try:
        with fake.mesh as mesh:
            mesh.open(
                30,
                lambda conn, wanted, connected: shake(conn, side, wanted, connected),
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
    run = MethodRun(id="single", method="voltage", inferences=2)
    ((status, stderr),) = run_session(
        tmp_path, 1, [run], inputs=tmp_path / "inputs.pt", checkpoint=tmp_path / "weights.pth"
    )
    assert status == 0, stderr
    logits = np.load(tmp_path / "device0" / "logits" / "single.npy")
    np.testing.assert_allclose(logits.reshape(4, -1), expected.numpy(), atol=1e-5, rtol=0)
    device = read_records(tmp_path / "device0")
    assert [r.correct for r in device.inferences] == [1, 2]
    predicted = [c for r in device.inferences for c in r.predicted]
    assert predicted == expected.argmax(-1).tolist()
    assert all(b.message_bytes == 0 and b.wait_ms == 0 for b in device.blocks)
    assert not device.arrivals
    assert device.session.inputs.startswith("file ")


def test_an_unequal_partition_at_half_speed_matches_the_simulation(tmp_path, model, bundle_path):
    """Devices of tokens [3, 9, 5] (vit-tiny has 17), device 1 at speed 0.5: every method's
    logits and every message's bytes are the simulation's at that partition; device 1 sleeps
    as long as it computes and records its speed."""
    sizes = [3, 9, 5]
    cases = ["voltage", "prism", "astra", "trace-b", "trace-nb"]
    runs = [method_run(case, bundle_path) for case in cases]
    peers = [f"127.0.0.1:{port}" for port in free_ports(3)]
    paths = [
        write_spec(tmp_path, rank, peers, runs, partition=sizes, speed=0.5 if rank == 1 else 1.0)
        for rank in range(3)
    ]
    processes = [start([sys.executable, "-m", "devices.worker", str(p)]) for p in paths]
    for rank, (status, stderr) in enumerate(finish(processes, SESSION_TIMEOUT_S)):
        assert status == 0, f"worker {rank} failed: {stderr}"
    records = [read_records(tmp_path / f"device{rank}") for rank in range(3)]
    bundle = tracevq.Bundle.load(bundle_path)
    inputs = generated_batch(model.config, BATCH, seed=0, index=0)
    for case in cases:
        method, params = METHODS[case]
        torch.set_num_threads(1)
        reference = tracevq.simulate(model, inputs, method, sizes, bundle=bundle, **params)
        logits = np.load(tmp_path / "device0" / "logits" / f"{case}.npy")
        np.testing.assert_allclose(logits[0], reference.logits, atol=1e-5, rtol=0, err_msg=case)
        for rank, device in enumerate(records):
            check_bytes([b for b in device.blocks if b.run == case], reference, rank, 3)
    assert {r.speed for r in records[1].inferences} == {0.5}
    assert {r.speed for r in records[0].inferences} == {1.0}
    slept = [read_session(tmp_path / f"device{rank}").timing_s["paced_sleep_s"] for rank in (0, 1)]
    assert slept[0] == 0 and slept[1] > 0


def test_a_held_worker_waits_for_its_release_and_takes_its_new_speed(tmp_path, bundle_path):
    """Device 0 holds before measured round 1 until the control file releases it; the speed
    written there before the release is the one its later inferences record."""
    runs = [method_run("trace-b", bundle_path, inferences=3)]
    control = tmp_path / "control"
    write_control(control, 1.0, 0)
    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    paths = [
        write_spec(tmp_path, 0, peers, runs, control_file=control, holds=[1]),
        write_spec(tmp_path, 1, peers, runs),
    ]
    processes = [start([sys.executable, "-m", "devices.worker", str(p)]) for p in paths]
    try:
        progress = tmp_path / "device0" / PROGRESS_FILE
        deadline = time.monotonic() + SESSION_TIMEOUT_S
        while (read_progress(progress) or (-1, 0))[0] < 1:
            assert time.monotonic() < deadline and processes[0].poll() is None
            time.sleep(0.01)
        time.sleep(0.5)
        assert read_progress(progress)[0] == 1  # held: round 2 has not started
        write_control(control, 0.5, 0)
        write_control(control, 0.5, 1)
    finally:
        results = finish(processes, SESSION_TIMEOUT_S)
    for rank, (status, stderr) in enumerate(results):
        assert status == 0, f"worker {rank} failed: {stderr}"
    records = read_records(tmp_path / "device0")
    assert [r.speed for r in records.inferences] == [1.0, 0.5, 0.5]
    assert read_progress(progress)[0] == 2


def test_a_hold_never_released_fails_the_worker_naming_the_round(tmp_path, bundle_path):
    runs = [method_run("voltage", None, inferences=2)]
    control = tmp_path / "control"
    write_control(control, 1.0, 0)
    peers = [f"127.0.0.1:{port}" for port in free_ports(2)]
    paths = [
        write_spec(tmp_path, 0, peers, runs, control_file=control, holds=[1], recv_timeout_s=2),
        write_spec(tmp_path, 1, peers, runs, recv_timeout_s=2),
    ]
    processes = [start([sys.executable, "-m", "devices.worker", str(p)]) for p in paths]
    (status, stderr), _ = finish(processes, SESSION_TIMEOUT_S)
    assert status != 0 and "no release before measured round 1 within 2 s" in stderr
