"""The inference loop of one device: drives `tracevq.engine.DeviceRun` over the mesh.

Per block b the compute thread calls begin_block (its message goes to the sender threads at
once), projects its own tokens' Q/K/V, takes the peers' messages for b from the receiver
threads (blocking only if they have not arrived: that time is `wait`), runs attention
(Trace's message for b + 1 is queued right away) and the FFN, during which the sender
threads write the queued message.

Timing definitions (DESIGN 4), all from time.perf_counter:
- compute: time the compute thread is not blocked waiting for peers' messages.
- wait: time blocked until the peers' messages for a block had arrived.
- comm: per message, from queueing to the moment the copy to the slowest peer had been
  written (sendall returned). It measures the link only while the kernel's send buffer is
  full: a small message on a fast link is "written" as soon as it is copied to the kernel.
  Across shaped links, compare with the receiver's recv_end and the analytic bits / rate.
- effective: wall time from the inference's start to the device's output.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from devices.errors import PeerLostError, ProtocolError
from devices.mesh import Mesh
from devices.records import InferenceRecord, LayerRecord
from devices.transport import Outgoing
from tracevq.engine import DeviceRun
from tracevq.methods import Method, TraceMethod
from tracevq.partition import partition_sizes

LOSS_GRACE_S = 0.3


class Session:
    """Runs inferences of `method` as device `rank` of the mesh's devices."""

    def __init__(self, method: Method, rank: int, mesh: Mesh, batch: int, recv_timeout_s: float):
        self.method, self.rank, self.mesh = method, rank, mesh
        self.batch, self.recv_timeout_s = batch, recv_timeout_s
        self.devices = len(mesh.addresses)
        self.sizes = partition_sizes(method.model.config.tokens, self.devices)
        self.depth = method.model.config.depth

    @torch.no_grad()
    def infer(
        self, index: int, inputs: Tensor, label: str
    ) -> tuple[InferenceRecord, list[LayerRecord], Tensor | None]:
        """One inference; `label` ("inference 3", "warm-up 0") names it in errors."""
        start = time.perf_counter()
        run = DeviceRun(self.method, self.rank, self.devices, inputs)
        outgoing: dict[int, Outgoing] = {}
        blocks = []
        for block in range(self.depth):
            context = f"block {block} of {label}"
            block_start = time.perf_counter()
            self._post(outgoing, block, run.begin_block(block), context)
            run.project_local(block)  # while the peers' messages for this block travel
            messages, wait_s, recv_end, received = self._collect(block, context)
            attn_start = time.perf_counter()
            try:
                message = run.attend(block, messages)
            except ProtocolError as error:  # the receiver names the peer and the block
                raise ProtocolError(f"{label}: {error}") from None
            self._post(outgoing, block + 1, message, context)
            ffn_start = time.perf_counter()
            run.finish_block(block)
            ffn_end = time.perf_counter()
            blocks.append((block_start, wait_s, recv_end, received, attn_start, ffn_start, ffn_end))
        logits = run.logits() if self.rank == 0 else None
        end = time.perf_counter()
        self._await_sends(outgoing, label)
        layers = [
            self._layer_record(index, b, start, outgoing.get(b), times)
            for b, times in enumerate(blocks)
        ]
        return self._inference_record(index, start, end, layers), layers, logits

    def _post(
        self, outgoing: dict[int, Outgoing], block: int, message: bytes | None, context: str
    ) -> None:
        if message is None or not self.mesh.links:
            return
        for link in self.mesh.links.values():
            if link.send_error is not None:
                raise PeerLostError(f"lost {link.name} at {context}: {link.send_error}")
        outgoing[block] = Outgoing(block, message, len(self.mesh.links))
        self.mesh.post(outgoing[block])

    def _collect(
        self, block: int, context: str
    ) -> tuple[dict[int, bytes], float, float | None, int]:
        """The peers' messages for `block`, the time spent waiting, the last arrival, bytes."""
        messages, wait_s, arrivals = {}, 0.0, []
        for peer, link in sorted(self.mesh.links.items()):
            began = time.perf_counter()
            try:
                incoming = link.take(self.recv_timeout_s, context)
            except PeerLostError as error:
                raise self._first_loss(context) or error from None
            wait_s += time.perf_counter() - began
            messages[peer] = incoming.message
            arrivals.append(incoming.arrived_at)
        received = sum(len(m) for m in messages.values())
        return messages, wait_s, max(arrivals) if arrivals else None, received

    def _first_loss(self, context: str) -> PeerLostError | None:
        """When several peers are gone (one died, another quit because of it), name the one
        whose connection closed first, the cause, and list the others. The others' closures
        get LOSS_GRACE_S to be noticed first."""
        links = self.mesh.links.values()
        deadline = time.perf_counter() + LOSS_GRACE_S
        while time.perf_counter() < deadline and not all(link.closed for link in links):
            time.sleep(0.01)
        closed = sorted((link for link in links if link.closed), key=lambda link: link.closed.at)
        if not closed:
            return None
        error = closed[0].lost(context)
        if len(closed) > 1:
            others = ", ".join(f"device {link.peer}" for link in closed[1:])
            error = PeerLostError(f"{error} (then lost {others})")
        return error

    def _await_sends(self, outgoing: dict[int, Outgoing], label: str) -> None:
        for block, message in sorted(outgoing.items()):
            if not message.done.wait(self.recv_timeout_s):
                raise PeerLostError(
                    f"the message for block {block} of {label} was not written "
                    f"to every peer within {self.recv_timeout_s:g} s"
                )
            for peer, error in message.errors.items():
                raise PeerLostError(
                    f"lost {self.mesh.name(peer)} at block {block} of {label}: {error}"
                )

    def _layer_record(
        self, index: int, block: int, start: float, message: Outgoing | None, times: tuple
    ) -> LayerRecord:
        block_start, wait_s, recv_end, received, attn_start, ffn_start, ffn_end = times

        def ms(t: float | None) -> float | None:
            return None if t is None else round(1000 * (t - start), 4)

        tokens = self.sizes[self.rank]
        return LayerRecord(
            inference=index,
            block=block,
            compute_ms=round(1000 * (ffn_end - block_start - wait_s), 4),
            comm_ms=None
            if message is None
            else round(1000 * (message.send_end - message.queued_at), 4),
            wait_ms=round(1000 * wait_s, 4),
            payload_bits=0 if message is None else self.method.payload_bits(tokens, self.batch),
            wire_bytes=0 if message is None else max(message.bytes_written.values()),
            received_bytes=received,
            block_start_ms=ms(block_start),
            send_start_ms=None if message is None else ms(message.queued_at),
            send_end_ms=None if message is None else ms(message.send_end),
            recv_end_ms=ms(recv_end),
            attn_start_ms=ms(attn_start),
            ffn_start_ms=ms(ffn_start),
            ffn_end_ms=ms(ffn_end),
        )

    def _inference_record(
        self, index: int, start: float, end: float, layers: list[LayerRecord]
    ) -> InferenceRecord:
        effective_ms = 1000 * (end - start)
        wait_ms = sum(layer.wait_ms for layer in layers)
        trace = isinstance(self.method, TraceMethod)
        return InferenceRecord(
            inference=index,
            start_clock_s=start,
            compute_ms=round(effective_ms - wait_ms, 4),
            comm_ms=round(sum(layer.comm_ms or 0.0 for layer in layers), 4),
            wait_ms=round(wait_ms, 4),
            effective_ms=round(effective_ms, 4),
            payload_bits=sum(layer.payload_bits for layer in layers),
            wire_bytes=sum(layer.wire_bytes for layer in layers),
            received_bytes=sum(layer.received_bytes for layer in layers),
            level=self.method.level if trace else None,
            r_bits=self.method.level_bits[self.method.level] if trace else None,
            predicted=None,
            correct=None,
        )
