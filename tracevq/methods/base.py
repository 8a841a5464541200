"""The interface every exchange method implements, shared by the simulation and the worker.

A method is built once per session from the model (and a bundle for codebook methods). For
each inference a device makes one `Sender` and, per peer, one `Receiver`:

- `Sender.pre_block(b, x)` is called with the block input X_p before block b's attention and
  returns the message peers need for block b, or None.
- `Sender.post_attention(b, x, z)` is called with the block input and the post-attention
  residual Z_p of block b, before its FFN, and returns the message for block b + 1, or None.
  A message returned here can travel while the FFN runs (Trace's overlap).
- `Method.exchanges_at(b)` says whether peers send a message for block b at all (Trace's
  placements with exact block-0 K/V send none for block 0: each receiver embeds the peer's
  tokens itself from the input, which `Receiver.bind_inputs` hands it).
- `Receiver.remote_kv(b, message)` turns the peer's message for block b (None where
  `exchanges_at(b)` is False) into its K/V, or
  (`dedup`) into the codebook rows of its tokens, whose K/V the engine asks of
  `Method.row_kv(b, rows)` once per distinct row of all peers. A message from another
  process is untrusted: its length, every codebook index (against the size of the codebook
  or tree level it indexes) and every value (finite) are checked, and a bad one raises
  `ProtocolError` naming the peer (`Receiver.peer_name`) and the block.

Messages are the exact bytes that cross the link; their size follows from the method, the
sender's token count and batch, and (for Trace) the header byte, so no length prefix is needed.

A method also owns its receivers' view as one differentiable computation (`ReceiverView`,
made by `Method.receiver_view`): what the accuracy study's P-device forward
(`tracevq.distributed`) trains through, equal to the bytes' path in evaluation.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from tracevq.errors import ConfigError, ProtocolError
from tracevq.method_table import METHODS
from tracevq.models import RemoteKV, RemoteRows, VisionTransformer
from tracevq.payload import message_bits
from tracevq.spec import MethodSpec


class Sender:
    """Default: sends nothing; each method overrides the hook(s) where its messages arise."""

    def pre_block(self, block: int, x: Tensor) -> bytes | None:
        return None

    def post_attention(self, block: int, x: Tensor, z: Tensor) -> bytes | None:
        return None


class Receiver(abc.ABC):
    peer: int
    # how errors name the peer; the network worker sets its address too ("device 1 (h:p)")
    peer_name: str | None = None

    @abc.abstractmethod
    def remote_kv(self, block: int, message: bytes | None) -> RemoteKV | RemoteRows: ...

    def bind_inputs(self, inputs: Tensor, start: int, stop: int) -> None:
        """The whole input of the inference and the peer's tokens [start, stop) in it; only
        receivers that compute a peer's embeddings themselves keep them."""
        return None

    def refuse(self, what: str, block: int, problem: str) -> ProtocolError:
        """The error for a bad message: `what` (e.g. "voltage message") from this peer for
        `block`, and the problem."""
        name = self.peer_name or f"device {self.peer}"
        return ProtocolError(f"{what} from {name} for block {block}: {problem}")

    def check_length(self, message: bytes, expected: int, method: str, block: int) -> None:
        if len(message) != expected:
            raise self.refuse(
                f"{method} message", block, f"expected {expected} bytes, got {len(message)}"
            )

    def check_indices(
        self, indices: np.ndarray, size: int, method: str, block: int, codebook: str = "K"
    ) -> None:
        """Every index below `size`, the codewords of `codebook` (one vectorised max: the
        decoded indices are never negative)."""
        if indices.size and (largest := int(indices.max())) >= size:
            raise self.refuse(
                f"{method} message", block, f"index {largest} out of range for {codebook} = {size}"
            )

    def check_finite(self, values: Tensor, method: str, block: int) -> None:
        if not bool(torch.isfinite(values).all()):
            bad = int((~torch.isfinite(values)).sum())
            raise self.refuse(f"{method} message", block, f"{bad} values are not finite (NaN/inf)")


# the codewords of exchange point b for rows x (..., D) -> (..., D): straight-through in
# training, chosen as the byte-exact methods choose them in evaluation (tracevq.distributed)
Codec = Callable[[int, Tensor], Tensor]


class ReceiverView:
    """What the receivers stand every remote token on, block by block, in one autograd graph.

    `seen(b, x, previous, z)` gets the exact block input x = X^(b) of every token (B, N, D)
    and, for b > 0, the previous block's input X^(b-1) and post-attention residual Z^(b-1);
    it returns the block input every peer rebuilds of each token (B, N, D), whose LN1 and K/V
    projection the peers attend over. Every receiver rebuilds a token the same way, so one view
    serves them all; a view may keep state from block to block, so it serves one forward pass.
    This one is exact: the block input itself (Voltage, and the single-device model).
    """

    def __init__(self, spec: MethodSpec, model: VisionTransformer, codec: Codec | None):
        self.spec, self.model, self.codec = spec, model, codec

    def seen(self, block: int, x: Tensor, previous: Tensor | None, z: Tensor | None) -> Tensor:
        return x


class Method(abc.ABC):
    """A sequence-parallel exchange method bound to a model (and its codebooks)."""

    header_bytes = 0  # bytes to read before the message size is known
    # the receivers' differentiable view (`receiver_view`); None: the method has none
    view_class: type[ReceiverView] | None = None

    def __init__(self, spec: MethodSpec, model: VisionTransformer):
        self.spec = spec
        self.model = model

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def overlaps(self) -> bool:
        """True when messages for block b + 1 leave during block b's FFN (Trace); the other
        methods make block b's message from block b's input, needed before attention."""
        return self.spec.is_trace

    def exchanges_at(self, block: int) -> bool:
        """True when peers send a message for block `block` (every block but for Trace's
        exact-embedding placements at block 0)."""
        return True

    def payload_bits(self, tokens: int, batch: int = 1) -> int:
        """Bits of one message from a device holding `tokens` tokens."""
        return message_bits(self.spec, tokens, self.model.config.dim, batch)

    def message_bytes(self, tokens: int, batch: int, header: bytes = b"") -> int:
        """Bytes of one message (header included) from a device holding `tokens` tokens."""
        return -(-self.payload_bits(tokens, batch) // 8)

    def row_kv(self, block: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        """K/V at block `block` of tokens whose state is codebook row `rows` (U,): (1, H, U, d)
        each. Only methods whose receivers return `RemoteRows` implement it."""
        raise NotImplementedError(f"method {self.name!r} has no K/V per codebook row")

    @abc.abstractmethod
    def sender(self, rank: int, tokens: int, batch: int) -> Sender: ...

    @abc.abstractmethod
    def receiver(self, peer: int, tokens: int, batch: int) -> Receiver: ...

    def describe(self) -> dict[str, object]:
        """Parameters and derived facts for records (level, bits, buffer memory ...)."""
        return {"method": self.name, **self.spec.params()}

    @classmethod
    def receiver_view(
        cls, spec: MethodSpec, model: VisionTransformer, codec: Codec | None = None
    ) -> ReceiverView:
        """A fresh view of the method's receivers for one differentiable forward pass, with
        `codec` choosing codewords; refused for a method without one (Prism: a mean stands
        for a group of tokens, not for each)."""
        if cls.view_class is None:
            viewable = [
                name
                for name, entry in METHODS.items()
                if entry.implementation_class().view_class is not None
            ]
            raise ConfigError(
                f"no differentiable forward for {spec.name!r}; choose from {', '.join(viewable)}",
                "name",
            )
        if spec.uses_codebooks and codec is None:
            raise ConfigError(f"{spec.name!r} needs its codebooks (a codec)")
        return cls.view_class(spec, model, codec)
