"""What a device measured: typed records, written by the worker and read back by the testbed.

A device's output directory holds
- `session.json`: `SessionFacts`, written when the session starts ("running") and again when
  it ends ("done" or "failed", with the error): the resolved spec, the clock offset of every
  peer (from the handshake), the level each run chose, byte counts, threads, versions.
- `records.jsonl`: the measured `InferenceRecord`s, `BlockRecord`s and `ArrivalRecord`s of
  every run of the session (warm-ups are not recorded): a line of column names, then one
  line per inference as it ends (`RecordLog`: a session of any length holds none of them in
  memory), renamed into place when the session ends.
- `logits/<run id>.npy` (device 0): the logits of a run's measured inferences,
  (inferences, batch, classes).

Every mark (`*_ns`) is CLOCK_REALTIME in nanoseconds on the device's own clock
(devices.clock); `ArrivalRecord.kernel_ns` is the kernel's receive timestamp. To compare
marks of two devices, add the handshake's offset (`SessionFacts.clock_offset_ns`).
Durations (`*_ms`) are the device's own. stdlib only: the testbed reads these without torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SESSION_FILE = "session.json"
RECORDS_FILE = "records.jsonl"
REFERENCES_FILE = "references.json"  # the stretch costs the session learned (devices.pace)


@dataclass
class BlockRecord:
    """Block `block` of one inference of run `run` on this device.

    The message of a record is the one this device sent for block `block`, i.e. the one its
    peers need at block `block`'s attention. Voltage, Prism and Astra make it at the start of
    the block; Trace makes it for block b >= 1 right after block b - 1's attention, so that
    it travels during block b - 1's FFN (the overlap), and for block 0 at the start.

    compute_ms: from the block's start to the end of its FFN, less wait_ms.
    wait_ms: time the compute thread was blocked until the peers' messages had been read.
    payload_bits: the method's bits of the message (docs/method.md, The five methods); 0 when
        none was sent.
    message_bytes: bytes of the message, one copy (each peer gets one).
    received_bytes: bytes of the peers' messages for this block, all peers together.
    departed_ns: the first byte of the message was offered to the kernel (first copy).
    written_ns: the kernel had accepted the last byte of the last copy.
    wait_start_ns, wait_end_ns: the compute thread blocked for the peers' messages
    (None without peers); attention starts at wait_end_ns.
    unique_remote_keys: with `dedup`, the remote keys each input's attention used: the
    distinct codebook rows of all peers' tokens (the union over the batch), or the peers'
    tokens themselves when the union is not smaller (tracevq.engine); None without dedup.
    """

    run: str
    inference: int
    block: int
    compute_ms: float
    wait_ms: float
    payload_bits: int
    message_bytes: int
    received_bytes: int
    start_ns: int
    departed_ns: int | None
    written_ns: int | None
    wait_start_ns: int | None
    wait_end_ns: int | None
    ffn_start_ns: int
    ffn_end_ns: int
    unique_remote_keys: int | None = None


@dataclass
class ArrivalRecord:
    """A peer's message for block `block`, as this device received it.

    kernel_ns: the kernel's receive timestamp of its last byte (None where the kernel gives
    none); read_ns: the receiver thread had read it off the socket; sent_ns: its departure on
    the sender's clock, which a stamped message carries (`level_k: auto`; None otherwise);
    echo_ps_per_byte: the stamp's echo, the peer's measure of this device's messages to it
    (link time per frame byte, ps; None when it had none yet).
    """

    run: str
    inference: int
    block: int
    peer: int
    message_bytes: int
    kernel_ns: int | None
    read_ns: int
    sent_ns: int | None = None
    echo_ps_per_byte: int | None = None


@dataclass
class InferenceRecord:
    """One measured inference of run `run` on this device.

    effective_ms: wall time from the start (input in hand) to the device's output: the logits
    on device 0, the end of the last block elsewhere. compute_ms = effective_ms - wait_ms
    (embedding and head included). level, level_k, r_bits: the Trace tree level in use, its
    codewords and bits per index. est_rate_mbit: with `level_k: auto`, the link rate this
    device estimated from the previous inference's messages, from which it chose the level
    (devices.level.LiveLevel; None before the first estimate). predicted: device 0's classes;
    correct: how many matched the labels (when the inputs have labels). tcp_retransmits: TCP
    segments this device's kernel retransmitted to its peers during the inference (TCP_INFO).
    speed: the device's speed when the inference started (devices.pace; 1.0: its cores').
    overruns: its stretches of compute that ended later than their reference cost / speed
    allowed (devices.pace): the host could not give the device its speed.
    """

    run: str
    inference: int
    start_ns: int
    end_ns: int
    compute_ms: float
    wait_ms: float
    effective_ms: float
    level: int | None = None
    level_k: int | None = None
    r_bits: int | None = None
    est_rate_mbit: float | None = None
    predicted: list[int] | None = None
    correct: int | None = None
    tcp_retransmits: int | None = None  # segments the kernel resent to every peer meanwhile
    speed: float = 1.0
    overruns: int = 0  # stretches of compute the host did not deliver by their target


@dataclass
class SessionFacts:
    """A session's facts. clock_offset_ns / clock_uncertainty_ns: per peer rank, the peer's
    clock minus this device's, within +- half the best ping-pong round trip."""

    status: str
    rank: int
    devices: int
    spec: dict[str, Any]
    error: str | None = None
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # run id -> method, level
    partition: list[int] = field(default_factory=list)
    inputs: str = ""
    model_fingerprint: str = ""
    clock_offset_ns: dict[int, int] = field(default_factory=dict)
    clock_uncertainty_ns: dict[int, int] = field(default_factory=dict)
    kernel_timestamps: bool | None = None  # the kernel stamps received segments
    handshakes: dict[int, dict[str, Any]] = field(default_factory=dict)
    bytes: dict[str, Any] = field(default_factory=dict)
    threads: dict[str, int] = field(default_factory=dict)
    timing_s: dict[str, float] = field(default_factory=dict)
    host: str = ""
    versions: dict[str, str] = field(default_factory=dict)


@dataclass
class DeviceRecords:
    """Everything one device wrote."""

    session: SessionFacts
    inferences: list[InferenceRecord]
    blocks: list[BlockRecord]
    arrivals: list[ArrivalRecord]


def write_atomic(path: Path, write: Any) -> Path:
    """`write(tmp)` then rename into place: a reader never sees half a file, nor a temporary
    one after a failed write (a full disk), which raises."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path, payload: Any) -> Path:
    """Written atomically (`write_atomic`); dataclasses become objects."""
    if dataclasses.is_dataclass(payload):
        payload = dataclasses.asdict(payload)
    text = json.dumps(payload, indent=1, default=str) + "\n"
    return write_atomic(path, lambda tmp: tmp.write_text(text))


RECORD_KINDS = {"inferences": InferenceRecord, "blocks": BlockRecord, "arrivals": ArrivalRecord}


class RecordLog:
    """The session's records, one line per measured inference as it ends; written to a
    temporary file and renamed into place when the session ends, so a reader never sees part
    of a line. Use as a context manager. A session that fails (a peer left, SIGTERM) still
    publishes the inferences it finished; its session.json says it failed, and only a reader
    that knows why (a device's departure on the timeline) takes them."""

    def __init__(self, out: Path):
        self.path = Path(out) / RECORDS_FILE
        self.tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        self.stream = self.tmp.open("w")
        columns = {kind: _names(record) for kind, record in RECORD_KINDS.items()}
        try:
            self.stream.write(json.dumps({"columns": columns}) + "\n")
        except OSError:
            self.__exit__(OSError)
            raise

    def add(
        self, inference: InferenceRecord, blocks: list[BlockRecord], arrivals: list[ArrivalRecord]
    ) -> None:
        line = {
            "inferences": [dataclasses.astuple(inference)],
            "blocks": [dataclasses.astuple(r) for r in blocks],
            "arrivals": [dataclasses.astuple(r) for r in arrivals],
        }
        self.stream.write(json.dumps(line, default=str) + "\n")

    def __enter__(self) -> RecordLog:
        return self

    def __exit__(self, kind: type | None, *_: object) -> None:
        published = False
        try:
            self.stream.close()  # flushes: a full disk raises here too
            os.replace(self.tmp, self.path)
            published = True
        finally:
            if not published:
                self.tmp.unlink(missing_ok=True)


def _names(kind: type) -> list[str]:
    return [f.name for f in dataclasses.fields(kind)]


def read_session(out: Path) -> SessionFacts:
    """A device's session facts (JSON keys of per-peer maps become ints again)."""
    data = json.loads((Path(out) / SESSION_FILE).read_text())
    for key in ("clock_offset_ns", "clock_uncertainty_ns", "handshakes"):
        data[key] = {int(peer): value for peer, value in data.get(key, {}).items()}
    return SessionFacts(**data)


def read_records(out: Path) -> DeviceRecords:
    """Everything a device wrote to `out`, typed. Raises OSError/ValueError on a bad file."""
    path = Path(out) / RECORDS_FILE
    rows: dict[str, list[Any]] = {kind: [] for kind in RECORD_KINDS}
    with path.open() as lines:
        columns = json.loads(next(lines, "{}")).get("columns")
        if columns != {kind: _names(record) for kind, record in RECORD_KINDS.items()}:
            raise ValueError(f"{path}: written by another version (columns differ)")
        for line in lines:
            data = json.loads(line)
            for kind, record in RECORD_KINDS.items():
                rows[kind] += [record(*values) for values in data[kind]]
    return DeviceRecords(read_session(out), rows["inferences"], rows["blocks"], rows["arrivals"])
