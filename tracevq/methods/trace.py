"""Trace: r-bit codebook indices on the wire; Trace-b and Trace-nb, two classes on one base.

Exchange points: VQ_0 quantises the block-0 input X^(0); VQ_b (b >= 1) quantises what block
b - 1 produced after its attention. The sender encodes right after attention and the message
travels while its FFN runs. The placement (tracevq.placement, the paper's Table VI; see
docs/method.md, VQ placement) decides what a receiver builds from the indices:

- trace-b ("2 B", "2 A") codes Z^(b-1). The next block input of a codeword c is
  g(c) = c + FFN(LN2(c)), a function of c alone, so the receiver gathers rows of precomputed
  K/V buffers (docs/method.md, Trace-b: why the K/V buffers work). `buffers=False` runs the
  same chain at the receiver instead.
- trace-nb ("1 A.i", "1 A.ii", "1 A.iii", "1 B") codes the attention update A = Z - X. The
  receiver keeps a copy per remote token: Z~ = residual + codeword, the residual being the
  copy's previous state (or, at the first update, X^(0), the VQ_0 codeword or nothing); with
  `remote_ffn` the copy then passes the FFN, and remote K/V are projected from LN1 of it.
- "A" cases take block 0's K/V from the exact X^(0): no VQ_0 message, each receiver embeds
  the peer's patches itself from the input.

`TraceMethod` holds what both share (codebooks and trees at a live level, the wire format,
the sender's timing, block 0 of the "A" cases); `TraceB` and `TraceNB` override what differs:
what the sender codes (`coded`), whether the receiver runs the previous block's FFN on what it
received (`receiver_runs_ffn`), the receiver (buffer rows or the chain; the per-token copy),
the K/V buffers (Trace-b only) and the receivers' differentiable view.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import Tensor

from tracevq.codec import decode_trace_message, encode_trace_message, trace_message_bytes
from tracevq.errors import ConfigError, ProtocolError
from tracevq.methods.base import Codec, Method, Receiver, ReceiverView, Sender
from tracevq.models import RemoteKV, RemoteRows, VisionTransformer, split_heads
from tracevq.spec import MethodSpec
from tracevq.tree import CodebookTree
from tracevq.vq import VectorQuantizer


class TraceSender(Sender):
    def __init__(self, method: TraceMethod):
        self.method = method

    def pre_block(self, block: int, x: Tensor) -> bytes | None:
        return self.method.encode(0, x) if block == 0 and self.method.exchanges_at(0) else None

    def post_attention(self, block: int, x: Tensor, z: Tensor) -> bytes | None:
        if block + 1 >= len(self.method.quantizers):
            return None
        return self.method.encode(block + 1, self.method.coded(x, z))


class TraceReceiver(Receiver):
    """What both receivers share: a message's rows, checked, and block 0 of an "A" case."""

    def __init__(self, method: TraceMethod, peer: int, tokens: int, batch: int):
        self.method, self.peer = method, peer
        self.tokens, self.batch = tokens, batch
        self.placement = method.placement
        self.inputs: tuple[Tensor, int, int] | None = None  # the input, the peer's span

    def bind_inputs(self, inputs: Tensor, start: int, stop: int) -> None:
        self.inputs = (inputs, start, stop)

    def remote_kv(self, block: int, message: bytes | None) -> RemoteKV | RemoteRows:
        if block == 0 and not self.placement.sends_vq0:
            assert self.inputs is not None, "an exact-embedding placement needs bind_inputs"
            return self.first_kv(self.method.model.embed(*self.inputs))  # (B, n, D)
        assert message is not None, f"no {self.method.name} message for block {block}"
        return self.rows_kv(block, self._rows(block, message))

    def first_kv(self, x0: Tensor) -> RemoteKV:
        """Block 0 of an "A" case: K/V of the peer's exact X^(0), embedded here."""
        return RemoteKV(*self.method.model.blocks[0].remote_kv(x0))

    @abc.abstractmethod
    def rows_kv(self, block: int, rows: Tensor) -> RemoteKV | RemoteRows:
        """The K/V (or, with dedup where exact, the rows) of the peer's codebook rows (B, n)."""

    def _rows(self, block: int, message: bytes) -> Tensor:
        """The codebook rows the message names, checked: (B, n)."""
        method, tree = self.method, self.method.trees[block]
        count = self.tokens * self.batch
        try:
            level, positions = decode_trace_message(message, count, tree.level_bits, block)
        except ProtocolError as error:
            raise self.refuse(f"{method.name} message", block, str(error)) from error
        # r bits hold up to 2^r - 1, more than a level of K_m < 2^r codewords has
        size = tree.level_sizes[level]
        self.check_indices(positions, size, method.name, block, f"level {level}'s K_m")
        return tree.rows(torch.from_numpy(positions), level).reshape(self.batch, self.tokens)


class TraceBReceiver(TraceReceiver):
    """A codeword of Z is the token's whole state: buffer rows, or the chain run here."""

    def rows_kv(self, block: int, rows: Tensor) -> RemoteKV | RemoteRows:
        method = self.method
        if method.spec.dedup:
            return RemoteRows(rows)
        if method.buffers is not None:
            k, v = method.buffers[block][rows].chunk(2, dim=-1)  # (B, n, D) each
            heads = method.model.config.heads
            return RemoteKV(split_heads(k, heads), split_heads(v, heads))
        x = method.block_input_of_codewords(block, method.quantizers[block].decode(rows))
        return RemoteKV(*method.model.blocks[block].remote_kv(x))


class TraceNBReceiver(TraceReceiver):
    """A copy per remote token, advanced by each received codeword of its update."""

    def __init__(self, method: TraceMethod, peer: int, tokens: int, batch: int):
        super().__init__(method, peer, tokens, batch)
        self.residual: Tensor | None = None  # what the peer's next update adds to

    def first_kv(self, x0: Tensor) -> RemoteKV:
        if self.placement.first_residual == "exact":
            self.residual = x0
        return super().first_kv(x0)

    def rows_kv(self, block: int, rows: Tensor) -> RemoteKV | RemoteRows:
        """Advance the copy of the peer's tokens by the received codewords."""
        method, placement = self.method, self.placement
        by_index_alone = self.residual is None  # K/V a function of the row: dedup is exact
        keeps = placement.carries_residual or block == 0  # the copy's state is needed later
        if by_index_alone and method.spec.dedup and not keeps:  # "1 A.iii": the row is all
            return RemoteRows(rows)
        codewords = method.quantizers[block].decode(rows)  # (B, n, D)
        if block == 0:  # "1 B": the VQ_0 codeword is block 0's K/V source and residual
            state = codewords
        else:
            z = codewords if self.residual is None else self.residual + codewords
            state = method.block_input_of_codewords(block, z)
        self.residual = state if keeps else None
        if by_index_alone and method.spec.dedup:
            return RemoteRows(rows)
        return RemoteKV(*method.model.blocks[block].remote_kv(state))


class TraceView(ReceiverView):
    """A Trace method's receivers in one autograd graph, at the spec's placement."""

    def __init__(self, spec: MethodSpec, model: VisionTransformer, codec: Codec | None):
        super().__init__(spec, model, codec)
        placement = spec.resolved_placement
        assert placement is not None and codec is not None, "receiver_view checks both"
        self.placement, self.codewords = placement, codec


class TraceBView(TraceView):
    """codec(0, x) at block 0 (the exact X^(0) in "A" cases), then g(codec(b, Z^(b-1)))."""

    def seen(self, block: int, x: Tensor, previous: Tensor | None, z: Tensor | None) -> Tensor:
        if block == 0:
            return self.codewords(0, x) if self.placement.sends_vq0 else x
        assert previous is not None and z is not None
        state = self.codewords(block, TraceB.coded(previous, z))
        return TraceB.block_input_of(self.model, self.spec, block, state)


class TraceNBView(TraceView):
    """The per-token copy: residual + codec(b, Z^(b-1) - X^(b-1)), through the FFN of block
    b - 1 with `remote_ffn`; the residual as the placement says (X^(0), VQ_0's codeword, the
    copy's previous state or nothing)."""

    def __init__(self, spec: MethodSpec, model: VisionTransformer, codec: Codec | None):
        super().__init__(spec, model, codec)
        self.residual: Tensor | None = None  # what each token's next update adds to

    def seen(self, block: int, x: Tensor, previous: Tensor | None, z: Tensor | None) -> Tensor:
        placement = self.placement
        if block == 0 and not placement.sends_vq0:  # "A": the exact X^(0)
            if placement.first_residual == "exact":
                self.residual = x
            return x
        if block == 0:  # "1 B": the VQ_0 codeword is block 0's view and residual
            self.residual = self.codewords(0, x)
            return self.residual
        assert previous is not None and z is not None
        update = self.codewords(block, TraceNB.coded(previous, z))
        state = update if self.residual is None else self.residual + update
        seen = TraceNB.block_input_of(self.model, self.spec, block, state)
        self.residual = seen if placement.carries_residual else None
        return seen


class TraceMethod(Method):
    """What Trace-b and Trace-nb share; `TraceB` and `TraceNB` are the methods."""

    header_bytes = 1
    receiver_class: type[TraceReceiver]

    def __init__(
        self,
        spec: MethodSpec,
        model: VisionTransformer,
        quantizers: list[VectorQuantizer],
        trees: list[CodebookTree],
    ):
        super().__init__(spec, model)
        if len(quantizers) != model.config.depth or len(trees) != model.config.depth:
            raise ConfigError(
                f"method {spec.name!r}: needs {model.config.depth} codebooks and trees "
                f"(one per block), the bundle has {len(quantizers)} and {len(trees)}"
            )
        self.quantizers, self.trees = quantizers, trees
        placement = spec.resolved_placement
        assert placement is not None and placement.method == spec.name, "spec checks placement"
        self.placement = placement
        self.level = trees[0].level_for_size(spec.resolved_level_k)
        # the coarsest level `auto` may choose
        self.min_level = trees[0].level_for_size(spec.level_min_k) if spec.level_min_k else 0
        self.buffers = self.make_buffers()
        if spec.search_beam is not None:  # grouped now, not in the first inference's time
            for tree in trees:
                for level in range(tree.num_levels):
                    tree.beam_search(level, spec.search_beam)

    @staticmethod
    @abc.abstractmethod
    def coded(x: Tensor, z: Tensor) -> Tensor:
        """What the sender codes for the next block, from the block input and Z."""

    @classmethod
    @abc.abstractmethod
    def receiver_runs_ffn(cls, spec: MethodSpec) -> bool:
        """Whether a receiver runs block b - 1's FFN on the state it received for block b."""

    @classmethod
    def block_input_of(
        cls, model: VisionTransformer, spec: MethodSpec, block: int, state: Tensor
    ) -> Tensor:
        """What block `block` projects for remote tokens whose received state is `state`:
        g(state) = state + FFN(LN2(state)) of block - 1 where the receiver runs that FFN; the
        state itself at block 0 and where it does not."""
        if block == 0 or not cls.receiver_runs_ffn(spec):
            return state
        return model.blocks[block - 1].ffn(state)

    def block_input_of_codewords(self, block: int, state: Tensor) -> Tensor:
        return self.block_input_of(self.model, self.spec, block, state)

    def make_buffers(self) -> list[Tensor] | None:
        """Per block, the K/V rows of every codeword (Trace-b); None: computed per message."""
        return None

    @property
    def level_bits(self) -> list[int]:
        return self.trees[0].level_bits

    def set_level(self, level: int) -> None:
        """Encode at another tree level from the next message on (no new buffers needed)."""
        if not 0 <= level < len(self.level_bits):
            raise ConfigError(
                f"level {level} not in the codebook tree (0..{len(self.level_bits) - 1})"
            )
        self.level = level

    def exchanges_at(self, block: int) -> bool:
        return block > 0 or self.placement.sends_vq0

    def payload_bits(self, tokens: int, batch: int = 1) -> int:
        return tokens * batch * self.level_bits[self.level] + 8

    def message_bytes(self, tokens: int, batch: int, header: bytes = b"") -> int:
        """Size of a message whose first byte is `header` (the current level without one).

        Raises ProtocolError for a level the tree does not have: the rest of the message
        cannot be delimited, so the stream must not be read on.
        """
        level = header[0] & 0x0F if header else self.level
        if level >= len(self.level_bits):
            raise ProtocolError(
                f"header names level {level}, the codebook tree has levels "
                f"0..{len(self.level_bits) - 1}: the stream cannot be delimited"
            )
        return trace_message_bytes(tokens * batch, self.level_bits[level])

    def encode(self, block: int, x: Tensor) -> bytes:
        quantizer, tree = self.quantizers[block], self.trees[block]
        codes = quantizer.project(x).reshape(-1, quantizer.code_dim)  # (B * n, d_q)
        positions = tree.encode(codes, self.level, self.spec.search_beam)
        return encode_trace_message(
            positions.numpy(), self.level_bits[self.level], self.level, block
        )

    def row_kv(self, block: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        """K/V of codebook rows (U,): buffer rows, or the chain run on those rows only."""
        if self.buffers is not None:
            k, v = self.buffers[block][rows].unsqueeze(0).chunk(2, dim=-1)  # (1, U, D) each
            heads = self.model.config.heads
            return split_heads(k, heads), split_heads(v, heads)
        codewords = self.quantizers[block].decode(rows).unsqueeze(0)  # (1, U, D)
        x = self.block_input_of_codewords(block, codewords)
        return self.model.blocks[block].remote_kv(x)

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers or [])

    def sender(self, rank: int, tokens: int, batch: int) -> Sender:
        return TraceSender(self)

    def receiver(self, peer: int, tokens: int, batch: int) -> Receiver:
        return self.receiver_class(self, peer, tokens, batch)

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "level": self.level,
            "level_k": self.trees[0].level_sizes[self.level],
            "r_bits": self.level_bits[self.level],
            "buffer_bytes": self.buffer_bytes,
        }


class TraceB(TraceMethod):
    """Codes the post-attention residual Z; receivers gather rows of K/V buffers precomputed
    from the codebooks (or, with `buffers=False`, run the chain on the codewords)."""

    receiver_class = TraceBReceiver
    view_class = TraceBView

    @staticmethod
    def coded(x: Tensor, z: Tensor) -> Tensor:
        return z

    @classmethod
    def receiver_runs_ffn(cls, spec: MethodSpec) -> bool:
        return True

    def make_buffers(self) -> list[Tensor] | None:
        return self._compute_buffers() if self.spec.buffers else None

    @torch.no_grad()
    def _compute_buffers(self) -> list[Tensor]:
        """Per block, the K and V rows of every codeword side by side: (K, 2D). Computed once
        per model and codebooks: the Trace-b variants of a session (levels) share them. The
        cache lives on the model, keyed by the codebooks and the tensors' versions (an
        in-place update of a codebook or a weight makes a new entry); each entry holds its
        quantizers, so their ids cannot be reused while it exists."""
        key = (
            tuple((id(q), q.codebook._version) for q in self.quantizers),
            sum(p._version for p in self.model.parameters()),
        )
        cache = self.model.__dict__.setdefault("_trace_kv_buffers", {})
        if key in cache:
            return cache[key][1]
        buffers = []
        dim = self.model.config.dim
        for block, quantizer in enumerate(self.quantizers):
            x = self.block_input_of_codewords(block, quantizer.decoded_codebook())
            target = self.model.blocks[block]
            qkv = target.attn.qkv
            buffers.append(F.linear(target.norm1(x), qkv.weight[dim:], qkv.bias[dim:]))
        cache[key] = (self.quantizers, buffers)
        return buffers


class TraceNB(TraceMethod):
    """Codes the attention update A = Z - X; receivers keep a copy per remote token, and run
    the FFN on it only with `remote_ffn`."""

    receiver_class = TraceNBReceiver
    view_class = TraceNBView

    @staticmethod
    def coded(x: Tensor, z: Tensor) -> Tensor:
        return z - x

    @classmethod
    def receiver_runs_ffn(cls, spec: MethodSpec) -> bool:
        return spec.remote_ffn


def auto_level(
    level_bits: list[int], rows: int, rate_bit_s: float, budget_ms: float, floor: int = 0
) -> int:
    """Finest level whose message (rows indices + header) crosses the link within the budget
    (the local FFN time, so that communication stays hidden); `floor` if none above it fits."""
    for level in range(len(level_bits) - 1, floor - 1, -1):
        transfer_ms = 1000.0 * (rows * level_bits[level] + 8) / rate_bit_s
        if transfer_ms <= budget_ms:
            return level
    return floor
