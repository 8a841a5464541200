"""The inference loop of one device: drives `tracevq.engine.DeviceRun` over the mesh.

Per block b the compute thread calls begin_block (its message leaves at once: the compute
thread hands it to the kernel itself when the socket takes it without blocking), projects its
own tokens' Q/K/V, takes the peers' messages for b from the receiver threads (blocking only if
they have not arrived: that time is `wait`), runs attention (Trace's message for b + 1 leaves
right away) and the FFN, during which the message travels.

Every mark is taken on the device's clock (devices.clock, ns); what the marks mean is in
devices.records. Communication is not timed here: a message's time on the link runs from its
departure on the sender to the kernel's receive timestamp on the receiver, two devices'
records that the testbed joins with the handshake's clock offsets.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from devices.clock import Clock
from devices.errors import MessageError, PeerLostError, ProtocolError
from devices.mesh import Mesh
from devices.pace import Pace
from devices.records import ArrivalRecord, BlockRecord, InferenceRecord
from devices.transport import Incoming, Outgoing, total_retransmits
from tracevq.engine import DeviceRun
from tracevq.methods import Method
from tracevq.partition import partition_sizes

LOSS_GRACE_S = 0.3


def stamped(method: Method) -> bool:
    """Whether the method's messages carry their departure time: a run with `level_k: auto`
    re-chooses its level from their one-way times (devices.level.LiveLevel)."""
    return method.spec.is_trace and method.spec.level_k == "auto"


@contextlib.contextmanager
def blaming(label: str) -> Iterator[None]:
    """A bad message's error (the receiver names the peer and the block) with the inference
    and run in `label` before it, wherever in the block the peer's data breaks it."""
    try:
        yield
    except MessageError as error:
        raise ProtocolError(f"{label}: {error}") from None


class Session:
    """Runs inferences of `method` as device `rank` of the mesh's devices."""

    def __init__(
        self,
        method: Method,
        rank: int,
        mesh: Mesh,
        batch: int,
        recv_timeout_s: float,
        sizes: list[int] | None = None,
        pace: Pace | None = None,
    ):
        """`sizes`: every device's tokens (even without); `pace`: the device's speed (full
        speed without)."""
        self.method, self.rank, self.mesh = method, rank, mesh
        self.batch, self.recv_timeout_s = batch, recv_timeout_s
        self.clock: Clock = mesh.clock
        self.devices = len(mesh.addresses)
        self.sizes = sizes or partition_sizes(method.model.config.tokens, self.devices)
        self.pace = pace or Pace()
        self.depth = method.model.config.depth
        self.peer_names = {peer: mesh.name(peer) for peer in range(self.devices)}
        self.stamped = stamped(method)

    @torch.no_grad()
    def infer(
        self, run: str, index: int, inputs: Tensor, label: str
    ) -> tuple[InferenceRecord, list[BlockRecord], list[ArrivalRecord], Tensor | None]:
        """One inference; `label` ("inference 3 of run x", "warm-up 0 ...") names it in errors."""
        now = self.clock.now_ns
        resent = self._retransmits()
        start, speed, overruns = now(), self.pace.speed, self.pace.overruns

        def stretch(name: str, size: Callable[[], float] | None = None, block: int = -1) -> Any:
            """A paced stretch, its kind (its reference) the run's `name` where the blocks
            after the first do the same work (the first may send what the others do not)."""
            return self.pace.stretch((run, name, "first" if block == 0 else ""), size)

        with stretch("embed"):
            device_run = DeviceRun(
                self.method, self.rank, self.devices, inputs, self.peer_names, self.sizes
            )
        outgoing: dict[int, Outgoing] = {}
        marks, arrivals, unique_keys = [], [], []
        for block in range(self.depth):
            context = f"block {block} of {label}"
            block_start = now()
            with stretch("begin", block=block):
                message = device_run.begin_block(block)
            self._post(outgoing, block, message, context)
            with stretch("project", block=block):  # while the peers' messages for this block travel
                device_run.project_local(block)
            wait_start = now()
            incoming = self._collect(context) if device_run.exchanges_at(block) else {}
            wait_end = now() if incoming else wait_start
            messages = {peer: item.message for peer, item in incoming.items()}
            # its work: the keys each query attended (Trace's unique remote keys are fewer)
            with blaming(label), stretch("attend", lambda: device_run.keys_attended, block):
                message = device_run.attend(block, messages)
            self._post(outgoing, block + 1, message, context)
            unique_keys.append(device_run.unique_remote_keys)
            ffn_start = now()
            # blaming: a peer's keys and values can overflow the FFN
            with blaming(label), stretch("ffn", block=block):
                device_run.finish_block(block)
            ffn_end = now()
            marks.append((block_start, wait_start, wait_end, ffn_start, ffn_end))
            arrivals += [
                ArrivalRecord(
                    run,
                    index,
                    block,
                    peer,
                    len(m.message),
                    m.kernel_ns,
                    m.read_ns,
                    m.sent_ns,
                    m.echo_ps_per_byte,
                )
                for peer, m in incoming.items()
            ]
        with stretch("head"):
            logits = device_run.logits() if self.rank == 0 else None
        end = now()
        self._await_sends(outgoing, label)
        blocks = [
            self._block_record(run, index, b, outgoing.get(b), times, arrivals)
            for b, times in enumerate(marks)
        ]
        for record, count in zip(blocks, unique_keys, strict=True):
            record.unique_remote_keys = count
        record = self._inference_record(run, index, start, end, blocks)
        record.speed = speed
        record.overruns = self.pace.overruns - overruns
        after = self._retransmits()
        if resent is not None and after is not None:
            record.tcp_retransmits = after - resent
        return record, blocks, arrivals, logits

    def _post(
        self, outgoing: dict[int, Outgoing], block: int, message: bytes | None, context: str
    ) -> None:
        if message is None or not self.mesh.links:
            return
        for link in self.mesh.links.values():
            if link.send_error is not None:
                raise PeerLostError(f"lost {link.name} at {context}: {link.send_error}")
        outgoing[block] = Outgoing(block, message, len(self.mesh.links), self.stamped)
        self.mesh.post(outgoing[block])

    def _collect(self, context: str) -> dict[int, Incoming]:
        """The peers' messages for the block, by peer."""
        incoming = {}
        for peer, link in sorted(self.mesh.links.items()):
            try:
                incoming[peer] = link.take(self.recv_timeout_s, context)
            except PeerLostError as error:
                raise self._first_loss(context) or error from None
        return incoming

    def _first_loss(self, context: str) -> PeerLostError | None:
        """When several peers are gone (one died, another quit because of it), name the one
        that stopped first, the cause, and list the others. The others' closures get
        LOSS_GRACE_S to be noticed. The cause is the peer whose stream ends earliest in the
        session: a survivor quits only while waiting for the lost peer's next message, after
        sending its own, so it has sent more; on a tie, the connection that closed first."""
        links = self.mesh.links.values()
        deadline = time.perf_counter() + LOSS_GRACE_S
        while time.perf_counter() < deadline and not all(link.closed for link in links):
            time.sleep(0.01)
        closed = sorted(
            (link for link in links if link.closed),
            key=lambda link: (link.messages_received, link.closed.at),
        )
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
                behind = [peer for peer in self.mesh.links if peer not in message.written_ns]
                names = ", ".join(self.mesh.name(peer) for peer in sorted(behind))
                raise PeerLostError(
                    f"the message for block {block} of {label} was not written to "
                    f"{names or 'every peer'} within {self.recv_timeout_s:g} s (the peer "
                    "stopped reading)"
                )
            for peer, error in message.errors.items():
                raise PeerLostError(
                    f"lost {self.mesh.name(peer)} at block {block} of {label}: {error}"
                )

    def _block_record(
        self,
        run: str,
        index: int,
        block: int,
        message: Outgoing | None,
        times: tuple[int, ...],
        arrivals: list[ArrivalRecord],
    ) -> BlockRecord:
        block_start, wait_start, wait_end, ffn_start, ffn_end = times
        wait_ms = (wait_end - wait_start) / 1e6
        received = sum(a.message_bytes for a in arrivals if a.block == block)
        return BlockRecord(
            run=run,
            inference=index,
            block=block,
            compute_ms=round((ffn_end - block_start) / 1e6 - wait_ms, 4),
            wait_ms=round(wait_ms, 4),
            payload_bits=0
            if message is None
            else self.method.payload_bits(self.sizes[self.rank], self.batch),
            message_bytes=0 if message is None else len(message.message),
            received_bytes=received,
            start_ns=block_start,
            departed_ns=None if message is None else min(message.departed_ns.values()),
            written_ns=None if message is None else max(message.written_ns.values()),
            wait_start_ns=wait_start if self.mesh.links else None,
            wait_end_ns=wait_end if self.mesh.links else None,
            ffn_start_ns=ffn_start,
            ffn_end_ns=ffn_end,
        )

    def _retransmits(self) -> int | None:
        """What the kernel has retransmitted so far on every connection to a peer."""
        counts = [total_retransmits(link.sock) for link in self.mesh.links.values()]
        known = [count for count in counts if count is not None]
        return sum(known) if known and len(known) == len(counts) else None

    def _inference_record(
        self, run: str, index: int, start: int, end: int, blocks: list[BlockRecord]
    ) -> InferenceRecord:
        effective_ms = (end - start) / 1e6
        wait_ms = sum(block.wait_ms for block in blocks)
        record = InferenceRecord(
            run=run,
            inference=index,
            start_ns=start,
            end_ns=end,
            compute_ms=round(effective_ms - wait_ms, 4),
            wait_ms=round(wait_ms, 4),
            effective_ms=round(effective_ms, 4),
        )
        if self.method.spec.is_trace:
            level = self.method.level
            record.level, record.r_bits = level, self.method.level_bits[level]
            record.level_k = self.method.trees[0].level_sizes[level]
        return record
