"""A device's session from set-up to records: mesh, handshake, levels, inferences, files.

The hello a device sends (devices.handshake) is built here from what it loaded, so a peer
with other weights, codebooks, partition or runs is refused before any payload moves. The
runs' inferences are interleaved (`RunSpec.schedule`): warm-ups of every run first, then one
measured inference of each run in turn.
"""

from __future__ import annotations

import functools
import itertools
import logging
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from devices.clock import Clock
from devices.errors import WorkerError
from devices.handshake import HandshakeSide, make_hello, shake
from devices.inputs import InputSource
from devices.level import LiveLevel, choose_level
from devices.mesh import Mesh
from devices.pace import PROGRESS_FILE, Control, Pace, Progress, run_kind
from devices.records import REFERENCES_FILE, RecordLog, SessionFacts, write_atomic, write_json
from devices.session import Session, stamped
from devices.spec import MethodRun, RunSpec, read_secret
from devices.transport import MessageFormat
from tracevq.bundle import Bundle, model_fingerprint
from tracevq.methods import Method
from tracevq.partition import partition_ranges

log = logging.getLogger(__name__)


def save_array(path: Path, array: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with tmp.open("wb") as stream:
            np.save(stream, array)

    write_atomic(path, write)


class Device:
    """One device of the session described by `spec`, with its runs' methods loaded."""

    def __init__(self, spec: RunSpec, model: Any, methods: dict[str, tuple[Method, Bundle | None]]):
        self.spec, self.model, self.methods = spec, model, methods
        config = model.config
        ranges = partition_ranges(config.tokens, spec.devices, spec.partition)
        self.sizes = [stop - start for start, stop in ranges]
        self.control = None if spec.control_file is None else Control(spec.control_file)
        self.pace = Pace(spec.speed, self.control, spec.threads, spec.turn_file)
        self.pace.give(spec.references)
        self.pace.kinds = {run.id: self._kind(run) for run in spec.runs}
        self.progress: Progress | None = None
        self.held = 0  # holds released so far
        self.inputs = InputSource(config, spec.batch, spec.input_seed, spec.inputs)
        self.timing_s: dict[str, float] = {}
        self.levels: dict[str, dict[str, Any]] = {}
        self.clock = Clock(spec.clock_skew_s)
        self.mesh = Mesh(spec.rank, spec.addresses, self.clock)
        self.secret = None if spec.secret_file is None else read_secret(spec.secret_file)
        spec.out.mkdir(parents=True, exist_ok=True)

    def _kind(self, run: MethodRun) -> str:
        spec, params = self.spec, self.methods[run.id][0].spec.params()
        tokens = self.sizes[spec.rank]
        return run_kind(spec.model, run.method, params, tokens, spec.batch, spec.threads)

    def hello(self) -> dict[str, Any]:
        spec = self.spec
        # each bundle hashed once: several runs share one (Trace-b's levels)
        bundles = {id(b): b for _, b in self.methods.values() if b is not None}
        fingerprints = {key: bundle.fingerprint for key, bundle in bundles.items()}
        return make_hello(
            spec.rank,
            devices=spec.devices,
            runs=[self._run_hello(run, fingerprints) for run in spec.runs],
            partition=self.sizes,
            batch=spec.batch,
            model=self.model.config.name,
            model_fingerprint=model_fingerprint(self.model),
            warmup=spec.warmup,
            inputs=self.inputs.description,
            authenticated=self.secret is not None,
        )

    def _run_hello(self, run: MethodRun, fingerprints: dict[int, str]) -> dict[str, Any]:
        method, bundle = self.methods[run.id]
        uses_bundle = method.spec.uses_codebooks and bundle is not None
        return {
            "id": run.id,
            "method": method.name,
            "params": method.spec.params(),
            "bundle_fingerprint": fingerprints[id(bundle)] if uses_bundle else None,
            "inferences": run.inferences,
        }

    def run(self) -> None:
        spec = self.spec
        try:
            tokens = self.sizes[spec.rank]
            for run in spec.runs:
                method = self.methods[run.id][0]
                self.levels[run.id] = choose_level(
                    method, tokens, spec.batch, spec.rate_mbit, self.pace.speed
                )
            hello = self.hello()
            names = [self.mesh.name(peer) for peer in range(spec.devices)]
            hosts = [host for host, _ in spec.addresses]
            side = HandshakeSide(hello, names, self.clock, hosts, self.secret)
            with self.mesh:
                began = time.perf_counter()
                self.mesh.open(
                    spec.connect_timeout_s,
                    lambda conn, expected, connected: shake(conn, side, expected, connected),
                )
                self.timing_s["connect_s"] = time.perf_counter() - began
                self.write_session("running")
                self.mesh.barrier(spec.recv_timeout_s)
                began = time.perf_counter()
                self._infer_all()
                self.timing_s["inferences_s"] = time.perf_counter() - began
        except BaseException as error:
            self.write_session("failed", error=" ".join(str(error).split()))
            raise
        self.write_session("done")

    def slots(self) -> Iterator[tuple[MethodRun, int, bool]]:
        """Every inference of the session in order: (run, index, measured). Warm-ups of each
        run first, then the measured ones round-robin. Every device runs the same order (the
        handshake agreed on the runs), so a message's size is known before it arrives. A new
        iterator per call: the compute loop and each peer's receiver walk it on their own."""
        spec = self.spec
        warmups = ((run, index, False) for run in spec.runs for index in range(spec.warmup))
        measured = ((spec.runs[r], index, True) for r, index in spec.schedule())
        return itertools.chain(warmups, measured)

    def _infer_all(self) -> None:
        spec = self.spec
        sessions = {
            run.id: Session(
                self.methods[run.id][0],
                spec.rank,
                self.mesh,
                spec.batch,
                spec.recv_timeout_s,
                self.sizes,
                self.pace,
            )
            for run in spec.runs
        }
        if self.control is not None:
            self.progress = Progress(spec.out / PROGRESS_FILE)
        round_index = -1
        live = self._live_levels()
        self.mesh.start(lambda peer: self._formats(peer, self.slots()))
        # device 0's logits of each run, (inferences, batch, classes), filled as they come
        logits: dict[str, np.ndarray] = {}
        with RecordLog(spec.out) as records:
            for run, index, measured in self.slots():
                if measured and self.pace.learning:
                    self.pace.learned()  # the warm-ups gave each stretch its reference
                if measured and index != round_index:
                    round_index = index
                    self._start_round(index)
                inputs, labels = self.inputs.get(index)
                label = f"{'inference' if measured else 'warm-up'} {index} of run {run.id}"
                session = sessions[run.id]
                record, rows, arrived, output = session.infer(run.id, index, inputs, label)
                if run.id in live:
                    record.est_rate_mbit = live[run.id].rate_mbit
                    live[run.id].update(arrived, rows)  # the level of this run's next inference
                if not measured:
                    continue
                if output is not None:
                    predicted = output.argmax(dim=-1)
                    record.predicted = predicted.tolist()
                    if labels is not None:
                        record.correct = int((predicted == labels).sum())
                    shape = (run.inferences, *output.shape)
                    logits.setdefault(run.id, np.zeros(shape, np.float32))[index] = output
                records.add(record, rows, arrived)
        self.timing_s["paced_sleep_s"] = round(self.pace.slept_s, 3)
        self.timing_s["overruns"] = self.pace.overruns
        write_json(spec.out / REFERENCES_FILE, self.pace.new_references())
        self._write_logits(logits)

    def _start_round(self, index: int) -> None:
        """Says that measured round `index` starts, first waiting for the orchestrator's
        release where an event comes before it (`RunSpec.holds`)."""
        if self.progress is None:
            return
        self.progress.write(index, self.clock.now_ns())
        if index in self.spec.holds:
            assert self.control is not None, "the spec checks that holds have a control file"
            self.held += 1
            if not self.control.wait_released(self.held, self.spec.recv_timeout_s):
                raise WorkerError(
                    f"no release before measured round {index} within "
                    f"{self.spec.recv_timeout_s:g} s (an event was due there)"
                )

    def _live_levels(self) -> dict[str, LiveLevel]:
        """The level choosers of the runs with `level_k: auto`, by run id."""
        handshakes = self.mesh.handshakes
        offsets = {peer: h.clock_offset_ns for peer, h in handshakes.items()}
        latencies = {peer: h.latency_ns for peer, h in handshakes.items()}
        tokens, batch = self.sizes[self.spec.rank], self.spec.batch

        def echo(peer: int, ns_per_byte: float) -> None:
            self.mesh.links[peer].echo_ps_per_byte = round(1000 * ns_per_byte)

        given = self.spec.rate_mbit is not None
        return {
            run.id: LiveLevel(method, tokens, batch, offsets, echo, latencies, given)
            for run in self.spec.runs
            if stamped(method := self.methods[run.id][0])
        }

    def _formats(
        self, peer: int, slots: Iterator[tuple[MethodRun, int, bool]]
    ) -> Iterator[MessageFormat]:
        """How to delimit each message `peer` will send, in order: one per block of every
        inference where the method exchanges."""
        tokens, batch = self.sizes[peer], self.spec.batch
        for run, _, _ in slots:
            method = self.methods[run.id][0]
            size = functools.partial(method.message_bytes, tokens, batch)
            for block in range(self.model.config.depth):
                if method.exchanges_at(block):
                    yield MessageFormat(method.header_bytes, size, stamped(method))

    def _write_logits(self, logits: dict[str, np.ndarray]) -> None:
        folder = self.spec.out / "logits"
        for run_id, array in logits.items():
            folder.mkdir(exist_ok=True)
            save_array(folder / f"{run_id}.npy", array)  # (I, B, C)

    def _describe(self, run: MethodRun) -> dict[str, Any]:
        return {**self.methods[run.id][0].describe(), "level_choice": self.levels.get(run.id)}

    def write_session(self, status: str, error: str | None = None) -> None:
        spec, mesh = self.spec, self.mesh
        links = list(mesh.links.values())
        handshakes = mesh.handshakes
        facts = SessionFacts(
            status=status,
            error=error,
            rank=spec.rank,
            devices=spec.devices,
            spec=spec.model_dump(mode="json"),
            runs={run.id: self._describe(run) for run in spec.runs},
            partition=self.sizes,
            inputs=self.inputs.description,
            model_fingerprint=model_fingerprint(self.model),
            clock_offset_ns={p: h.clock_offset_ns for p, h in handshakes.items()},
            clock_uncertainty_ns={p: h.clock_uncertainty_ns for p, h in handshakes.items()},
            kernel_timestamps=all(link.kernel_timestamps for link in links) if links else None,
            handshakes={p: h.summary() for p, h in handshakes.items()},
            bytes={
                "handshake": mesh.handshake_bytes,
                "control": mesh.control_bytes,
                "stamps": {
                    way: sum(link.stamp_bytes[way] for link in links)
                    for way in ("sent", "received")
                },
                "payload": {
                    "sent": sum(link.bytes_sent for link in links),
                    "received": sum(link.bytes_received for link in links),
                },
            },
            threads={"requested": spec.threads, "torch": torch.get_num_threads()},
            timing_s=self.timing_s,
            host=platform.node(),
            versions={"python": platform.python_version(), "torch": torch.__version__},
        )
        write_json(spec.out / "session.json", facts)
