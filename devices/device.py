"""A device's session from set-up to records: mesh, handshake, level, inferences, files.

The hello a device sends (devices.handshake) is built here from what it loaded, so a peer
with other weights, codebooks, partition or method is refused before any payload moves.
"""

from __future__ import annotations

import logging
import platform
import time
from typing import Any

import numpy as np
import torch

from devices.handshake import make_hello, shake
from devices.inputs import InputSource
from devices.level import choose_level
from devices.mesh import Mesh
from devices.records import InferenceRecord, LayerRecord, write_csv, write_json
from devices.session import Session
from devices.spec import RunSpec
from tracevq.bundle import Bundle, model_fingerprint
from tracevq.methods import Method
from tracevq.partition import partition_sizes

log = logging.getLogger(__name__)


class Device:
    """One device of the session described by `spec`, with its method loaded."""

    def __init__(self, spec: RunSpec, method: Method, bundle: Bundle | None):
        self.spec, self.method, self.bundle = spec, method, bundle
        config = method.model.config
        self.sizes = partition_sizes(config.tokens, spec.devices)
        self.inputs = InputSource(config, spec.batch, spec.input_seed, spec.inputs)
        self.facts: dict[str, Any] = {}
        self.mesh = Mesh(spec.rank, spec.addresses)
        spec.out.mkdir(parents=True, exist_ok=True)

    def hello(self) -> dict[str, Any]:
        spec, method = self.spec, self.method
        uses_bundle = method.spec.uses_codebooks and self.bundle is not None
        return make_hello(
            spec.rank,
            devices=spec.devices,
            method=method.name,
            params=method.spec.params(),
            partition=self.sizes,
            batch=spec.batch,
            model=method.model.config.name,
            model_fingerprint=model_fingerprint(method.model),
            bundle_fingerprint=self.bundle.fingerprint if uses_bundle else None,
            warmup=spec.warmup,
            inferences=spec.inferences,
            inputs=self.inputs.description,
        )

    def run(self) -> None:
        spec = self.spec
        try:
            tokens = self.sizes[spec.rank]
            self.facts["level"] = choose_level(self.method, tokens, spec.batch, spec.rate_mbit)
            hello = self.hello()
            names = [self.mesh.name(peer) for peer in range(spec.devices)]
            with self.mesh:
                began = time.perf_counter()
                self.mesh.open(
                    spec.connect_timeout_s,
                    lambda conn, expected, connected: shake(
                        conn, hello, expected, connected, names
                    ),
                )
                self.facts["connect_s"] = time.perf_counter() - began
                self.write_session("running")
                self.mesh.barrier(spec.recv_timeout_s)
                self.mesh.start(self.method.header_bytes, self._message_bytes)
                records, layers, logits = self._infer_all()
        except BaseException as error:
            self.write_session("failed", error=" ".join(str(error).split()))
            raise
        self._write_records(records, layers, logits)
        self.write_session("done")

    def _message_bytes(self, peer: int) -> Any:
        tokens, batch = self.sizes[peer], self.spec.batch
        return lambda header: self.method.message_bytes(tokens, batch, header)

    def _infer_all(self) -> tuple[list[InferenceRecord], list[LayerRecord], list[torch.Tensor]]:
        spec = self.spec
        session = Session(self.method, spec.rank, self.mesh, spec.batch, spec.recv_timeout_s)
        for index in range(spec.warmup):
            session.infer(index, self.inputs.get(index)[0], f"warm-up {index}")
        records, layers, logits = [], [], []
        for index in range(spec.inferences):
            inputs, labels = self.inputs.get(index)
            record, rows, output = session.infer(index, inputs, f"inference {index}")
            if output is not None:
                predicted = output.argmax(dim=-1)
                record.predicted = " ".join(str(c) for c in predicted.tolist())
                if labels is not None:
                    record.correct = int((predicted == labels).sum())
                logits.append(output)
            records.append(record)
            layers.extend(rows)
        return records, layers, logits

    def _write_records(
        self, records: list[InferenceRecord], layers: list[LayerRecord], logits: list[torch.Tensor]
    ) -> None:
        out = self.spec.out
        write_csv(out / "inferences.csv", records, InferenceRecord)
        write_csv(out / "layers.csv", layers, LayerRecord)
        if logits:
            np.save(out / "logits.npy", torch.stack(logits).numpy())  # (I, B, classes)

    def write_session(self, status: str, error: str | None = None) -> None:
        spec, mesh = self.spec, self.mesh
        links = mesh.links.values()
        payload = {
            "status": status,
            "error": error,
            "rank": spec.rank,
            "devices": spec.devices,
            "spec": spec.model_dump(mode="json"),
            "method": self.method.describe(),
            "level": self.facts.get("level"),
            "partition": self.sizes,
            "inputs": self.inputs.description,
            "model_fingerprint": model_fingerprint(self.method.model),
            "bundle_fingerprint": self.bundle.fingerprint if self.bundle else None,
            "threads": {"requested": spec.threads, "torch": torch.get_num_threads()},
            "handshakes": {str(p): h.summary() for p, h in mesh.handshakes.items()},
            "bytes": {
                "handshake": mesh.handshake_bytes,
                "control": mesh.control_bytes,
                "payload": {
                    "sent": sum(link.bytes_sent for link in links),
                    "received": sum(link.bytes_received for link in links),
                },
                "payload_per_peer": {
                    str(link.peer): {"sent": link.bytes_sent, "received": link.bytes_received}
                    for link in links
                },
            },
            "timing": {key: value for key, value in self.facts.items() if key != "level"},
            "host": platform.node(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
        }
        write_json(self.spec.out / "session.json", payload)
