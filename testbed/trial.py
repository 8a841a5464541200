"""One trial: P workers of one method on already started and shaped devices, and its rows.

The workers write their records into the run directory (shared with the devices); this
module turns them into the trial's rows. `comm_ms` is measured across devices: per message,
from the moment the sender queued it to the moment the slowest peer had read it off its
socket (devices on one host share the monotonic clock; across hosts the handshake's clock
offsets apply). `send_ms` is the sender-side figure (until its last `sendall` returned).
"""

from __future__ import annotations

import csv
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.backends.base import Backend, Device, ExecResult
from testbed.bundles import RunFiles
from testbed.link import LinkState
from testbed.plan import Trial
from testbed.results import trial_dir, write_text
from testbed.schema import Experiment

log = logging.getLogger(__name__)

WORKER_PORT = 7100


@dataclass
class TrialOutcome:
    trials: pd.DataFrame
    layers: pd.DataFrame
    ok: bool
    error: str = ""


def worker_argv(
    backend: Backend,
    experiment: Experiment,
    trial: Trial,
    device: Device,
    peers: str,
    out: Path,
    files: RunFiles,
    link: LinkState,
) -> list[str]:
    argv = [
        backend.python, "-m", "devices.worker",
        "--rank", str(device.rank),
        "--peers", peers,
        "--model", experiment.model.name,
        "--model-seed", str(experiment.model.seed),
        "--method", trial.method,
        "--batch", str(experiment.batch),
        "--warmup", str(experiment.warmup),
        "--inferences", str(files.batches or experiment.repeats),
        "--threads", str(device.threads),
        "--out", backend.device_path(out),
        "--connect-timeout-s", "60",
        "--recv-timeout-s", str(experiment.timeout_s),
        "--rate-mbit", str(link.measured_mbit.get(device.rank, link.rate_mbit)),
    ]  # fmt: skip
    for key, value in trial.params:
        argv += ["--param", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    optional = {"--bundle": files.bundle_for(trial), "--checkpoint": files.checkpoint,
                "--inputs": files.inputs}  # fmt: skip
    for flag, path in optional.items():
        if path is not None:
            argv += [flag, backend.device_path(path)]
    return argv


def run_workers(backend: Backend, argvs: list[list[str]], timeout_s: float) -> list[ExecResult]:
    """Start every worker, wait for all; a failure or the deadline kills the rest."""
    processes = [
        backend.spawn(device, argv) for device, argv in zip(backend.devices, argvs, strict=True)
    ]
    deadline = time.monotonic() + timeout_s
    results: list[ExecResult | None] = [None] * len(processes)
    try:
        for rank, process in enumerate(processes):
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                results[rank] = process.wait(remaining)
            except TimeoutError:
                results[rank] = ExecResult(
                    -1, "", f"worker {rank}: no result within {timeout_s:g} s (timeout_s)"
                )
                break
    finally:
        for process in processes:
            process.kill()
    for rank, process in enumerate(processes):
        if results[rank] is None:
            try:
                results[rank] = process.wait(5)
            except TimeoutError:
                results[rank] = ExecResult(-1, "", f"worker {rank}: killed")
    return [r for r in results if r is not None]


def _read_csv(path: Path) -> list[dict[str, Any]]:
    with open(path, newline="") as stream:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(stream)]


def _number(text: str) -> Any:
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def arrival_comm_ms(
    layers: dict[int, list[dict[str, Any]]], starts: dict[int, dict[int, float]]
) -> dict[tuple[int, int, int], float]:
    """(rank, inference, block) -> ms from queueing a message to its last peer's arrival."""
    out = {}
    for rank, rows in layers.items():
        for row in rows:
            if row["send_start_ms"] is None:
                continue
            inference, block = row["inference"], row["block"]
            sent = starts[rank][inference] + row["send_start_ms"] / 1000
            arrivals = [
                starts[peer][inference] + peer_row["recv_end_ms"] / 1000
                for peer, peer_rows in layers.items() if peer != rank
                for peer_row in peer_rows
                if peer_row["inference"] == inference and peer_row["block"] == block
                and peer_row["recv_end_ms"] is not None
            ]  # fmt: skip
            if arrivals:
                out[(rank, inference, block)] = round(1000 * (max(arrivals) - sent), 4)
    return out


def collect_rows(
    outs: dict[int, Path], base: dict[str, Any], plan: dict[int, dict[str, Any]], link: LinkState
) -> tuple[pd.DataFrame, pd.DataFrame]:
    inferences = {rank: _read_csv(out / "inferences.csv") for rank, out in outs.items()}
    layers = {rank: _read_csv(out / "layers.csv") for rank, out in outs.items()}
    starts = {
        rank: {r["inference"]: r["start_clock_s"] for r in rows}
        for rank, rows in inferences.items()
    }
    comm = arrival_comm_ms(layers, starts)
    peers = len(outs) - 1
    trial_rows, layer_rows = [], []
    for rank, rows in inferences.items():
        identity = {
            **base,
            **plan[rank],
            "rank": rank,
            "measured_mbit": link.measured_mbit.get(rank),
            "measured_wire_mbit": link.wire_mbit(rank),
            "rate_flagged": link.flagged(rank) if peers else False,
        }
        for row in rows:
            blocks = [
                comm.get((rank, row["inference"], b["block"]))
                for b in layers[rank]
                if b["inference"] == row["inference"]
            ]
            trial_rows.append({
                **identity,
                "repeat": row["inference"],
                "compute_ms": row["compute_ms"],
                "comm_ms": sum(c for c in blocks if c is not None),
                "send_ms": row["comm_ms"],
                "wait_ms": row["wait_ms"],
                "effective_ms": row["effective_ms"],
                "payload_bits": row["payload_bits"],
                "wire_bytes": row["wire_bytes"] * peers,
                "received_bytes": row["received_bytes"],
                "correct": row["correct"],
                "level_k": plan[rank]["level_k"],
                "r_bits": row["r_bits"] if row["r_bits"] is not None else plan[rank]["r_bits"],
                "status": "ok",
                "error": "",
            })  # fmt: skip
        for row in layers[rank]:
            key = (rank, row["inference"], row["block"])
            layer_rows.append(
                {
                    **identity,
                    "repeat": row["inference"],
                    **row,
                    "comm_ms": comm.get(key),
                    "send_ms": row["comm_ms"],
                }
            )
    return pd.DataFrame(trial_rows), pd.DataFrame(layer_rows).drop(columns=["inference"])


def failed_rows(
    base: dict[str, Any], plan: dict[int, dict[str, Any]], link: LinkState, error: str
) -> pd.DataFrame:
    rows = []
    for rank in plan:
        measured = {
            "measured_mbit": link.measured_mbit.get(rank),
            "measured_wire_mbit": link.wire_mbit(rank),
        }
        rows.append(
            {
                **base,
                **plan[rank],
                "rank": rank,
                **measured,
                "repeat": -1,
                "status": "failed",
                "error": error,
            }
        )
    return pd.DataFrame(rows)


def run_trial(
    backend: Backend,
    experiment: Experiment,
    trial: Trial,
    index: int,
    base: dict[str, Any],
    plan: dict[int, dict[str, Any]],
    link: LinkState,
    files: RunFiles,
) -> TrialOutcome:
    directory = trial_dir(backend.run_dir, trial.trial_id)
    port = WORKER_PORT + index % 1000
    peers = ",".join(f"{d.address}:{port}" for d in backend.devices)
    outs = {d.rank: directory / f"rank{d.rank}" for d in backend.devices}
    for out in outs.values():
        out.mkdir(parents=True, exist_ok=True)
    argvs = [
        worker_argv(backend, experiment, trial, d, peers, outs[d.rank], files, link)
        for d in backend.devices
    ]
    write_text(directory / "commands.json", json.dumps(argvs, indent=1))
    started = time.monotonic()
    results = run_workers(backend, argvs, experiment.timeout_s)
    for device in backend.devices:
        backend.collect(device, outs[device.rank])
    base = {**base, "trial_s": round(time.monotonic() - started, 3)}
    for rank, result in enumerate(results):
        write_text(
            directory / f"rank{rank}.log",
            f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}",
        )
    failures = [r for r in results if not r.ok]
    if failures:
        error = failures[0].tail(1) or f"exit status {failures[0].returncode}"
        return TrialOutcome(failed_rows(base, plan, link, error), pd.DataFrame(), False, error)
    trials, layers = collect_rows(outs, base, plan, link)
    return TrialOutcome(trials, layers, True)
