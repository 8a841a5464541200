"""The records a device writes to its output directory (stdlib CSV and JSON only).

- `layers.csv`: one row per block per measured inference (`LayerRecord`).
- `inferences.csv`: one row per measured inference (`InferenceRecord`).
- `session.json`: the resolved spec, handshakes (clock offsets), method, level choice, byte
  counts of handshake / control / payload, thread count, status ("running", "done", "failed").
- `logits.npy` (device 0): the logits of the measured inferences, (inferences, batch, classes).

Times are milliseconds of time.perf_counter (the monotonic clock), relative to the start of
the inference (`InferenceRecord.start_clock_s` is that start on the device's own clock;
session.json gives every peer's clock offset to align devices).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class LayerRecord:
    """Block `block` of one inference on this device.

    The message of a row is the one this device sent for block `block`, i.e. the one its
    peers need at block `block`'s attention. Voltage, Prism and Astra queue it at the start of
    the block; Trace queues it for block b >= 1 right after block b - 1's attention, so that it
    travels during block b - 1's FFN (the overlap), and for block 0 at the start of block 0.

    compute_ms: block_end - block_start - wait_ms (this thread's time outside recv waits).
    comm_ms: send_end_ms - send_start_ms.
    wait_ms: time blocked until the peers' messages for this block had arrived.
    payload_bits: analytic bits of the message (method.payload_bits).
    wire_bytes: bytes written to one peer's socket for the message (each peer gets a copy).
    received_bytes: bytes of the peers' messages for this block, all peers together.
    send_start_ms: the message was queued for the sender threads.
    send_end_ms: the last peer's copy was written (sendall returned; data in the kernel).
    recv_end_ms: the last peer's message for this block had been read off its socket.
    """

    inference: int
    block: int
    compute_ms: float
    comm_ms: float | None
    wait_ms: float
    payload_bits: int
    wire_bytes: int
    received_bytes: int
    block_start_ms: float
    send_start_ms: float | None
    send_end_ms: float | None
    recv_end_ms: float | None
    attn_start_ms: float
    ffn_start_ms: float
    ffn_end_ms: float


@dataclass
class InferenceRecord:
    """One measured inference on this device.

    effective_ms: wall time from the start (input in hand) to the device's output: the
    logits on device 0, the end of the last block elsewhere. compute_ms = effective_ms -
    wait_ms (embedding and head included). comm_ms, payload_bits, wire_bytes: sums over the
    device's messages. predicted: device 0's classes, space-separated; correct: how many
    matched the labels (when the inputs have labels).
    """

    inference: int
    start_clock_s: float
    compute_ms: float
    comm_ms: float
    wait_ms: float
    effective_ms: float
    payload_bits: int
    wire_bytes: int
    received_bytes: int
    level: int | None
    r_bits: int | None
    predicted: str | None
    correct: int | None


def write_csv(path: Path, rows: list[Any], kind: type) -> Path:
    """Rows of a record dataclass as CSV (header from the dataclass; None as empty)."""
    names = [field.name for field in dataclasses.fields(kind)]
    with open(path, "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(names)
        for row in rows:
            values = dataclasses.astuple(row)
            writer.writerow(["" if value is None else value for value in values])
    return path


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path
