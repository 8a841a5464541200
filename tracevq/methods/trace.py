"""Trace: r-bit codebook indices on the wire.

Exchange points: VQ_0 quantises the block-0 input X^(0); VQ_b (b >= 1) quantises what block
b - 1 produced after its attention. The sender encodes right after attention and the message
travels while its FFN runs.

- trace-b codes Z^(b-1). The next block input of a codeword c is g(c) = c + FFN(LN2(c)), a
  function of c alone, so the receiver gathers rows of precomputed K/V buffers
  (docs/method.md, Trace-b: why the K/V buffers work). `buffers=False` runs the same chain
  at the receiver instead.
- trace-nb codes the attention update A = Z - X. The receiver keeps a shadow stream per remote
  token that starts at the VQ_0 codeword and advances as Z~ = X~ + codeword,
  X~ = Z~ + FFN(LN2(Z~)) (docs/method.md, Trace-nb); remote K/V are projected from LN1(X~).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tracevq.codec import decode_trace_message, encode_trace_message, trace_message_bytes
from tracevq.errors import ConfigError, ProtocolError
from tracevq.methods.base import Method, Receiver, Sender
from tracevq.models import RemoteKV, RemoteRows, VisionTransformer, split_heads
from tracevq.spec import MethodSpec
from tracevq.tree import CodebookTree
from tracevq.vq import VectorQuantizer


class TraceSender(Sender):
    def __init__(self, method: TraceMethod):
        self.method = method

    def pre_block(self, block: int, x: Tensor) -> bytes | None:
        return self.method.encode(0, x) if block == 0 else None

    def post_attention(self, block: int, x: Tensor, z: Tensor) -> bytes | None:
        if block + 1 >= len(self.method.quantizers):
            return None
        coded = z - x if self.method.name == "trace-nb" else z
        return self.method.encode(block + 1, coded)


class TraceReceiver(Receiver):
    def __init__(self, method: TraceMethod, peer: int, tokens: int, batch: int):
        self.method, self.peer = method, peer
        self.tokens, self.batch = tokens, batch
        self.shadow: Tensor | None = None  # trace-nb: the peer's block input as seen here

    def remote_kv(self, block: int, message: bytes) -> RemoteKV | RemoteRows:
        method = self.method
        tree = method.trees[block]
        count = self.tokens * self.batch
        try:
            level, positions = decode_trace_message(message, count, tree.level_bits, block)
        except ProtocolError as error:
            raise self.refuse(f"{method.name} message", block, str(error)) from error
        # r bits hold up to 2^r - 1, more than a level of K_m < 2^r codewords has
        size = tree.level_sizes[level]
        self.check_indices(positions, size, method.name, block, f"level {level}'s K_m")
        rows = tree.rows(torch.from_numpy(positions), level).reshape(self.batch, self.tokens)
        if method.name == "trace-nb":
            return self._shadow_kv(block, rows)
        if method.spec.dedup:
            return RemoteRows(rows)
        if method.buffers is not None:
            k, v = method.buffers[block][rows].chunk(2, dim=-1)  # (B, n, D) each
            heads = method.model.config.heads
            return RemoteKV(split_heads(k, heads), split_heads(v, heads))
        x = method.block_input_of_codewords(block, method.quantizers[block].decode(rows))
        return RemoteKV(*method.model.blocks[block].remote_kv(x))

    def _shadow_kv(self, block: int, rows: Tensor) -> RemoteKV | RemoteRows:
        codewords = self.method.quantizers[block].decode(rows)  # (B, n, D)
        blocks = self.method.model.blocks
        if block == 0:
            self.shadow = codewords
            # the shadow starts as the codeword: K/V of block 0 depend on the index alone
            if self.method.spec.dedup:
                return RemoteRows(rows)
        else:
            assert self.shadow is not None, "trace-nb receiver skipped block 0"
            self.shadow = blocks[block - 1].ffn(self.shadow + codewords)
        return RemoteKV(*blocks[block].remote_kv(self.shadow))


class TraceMethod(Method):
    header_bytes = 1

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
        self.level = trees[0].level_for_size(spec.resolved_level_k)
        use_buffers = spec.name == "trace-b" and spec.buffers
        self.buffers = self._compute_buffers() if use_buffers else None

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
        positions = tree.encode(codes, self.level)
        return encode_trace_message(
            positions.numpy(), self.level_bits[self.level], self.level, block
        )

    def block_input_of_codewords(self, block: int, codewords: Tensor) -> Tensor:
        """Block `block`'s input for tokens whose exchanged state is `codewords` (trace-b)."""
        return codewords if block == 0 else self.model.blocks[block - 1].ffn(codewords)

    def row_kv(self, block: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        """K/V of codebook rows (U,): buffer rows, or the chain run on those rows only."""
        if self.buffers is not None:
            k, v = self.buffers[block][rows].unsqueeze(0).chunk(2, dim=-1)  # (1, U, D) each
            heads = self.model.config.heads
            return split_heads(k, heads), split_heads(v, heads)
        codewords = self.quantizers[block].decode(rows).unsqueeze(0)  # (1, U, D)
        x = self.block_input_of_codewords(block, codewords)
        return self.model.blocks[block].remote_kv(x)

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

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers or [])

    def sender(self, rank: int, tokens: int, batch: int) -> Sender:
        return TraceSender(self)

    def receiver(self, peer: int, tokens: int, batch: int) -> Receiver:
        return TraceReceiver(self, peer, tokens, batch)

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "level": self.level,
            "level_k": self.trees[0].level_sizes[self.level],
            "r_bits": self.level_bits[self.level],
            "buffer_bytes": self.buffer_bytes,
        }


def auto_level(level_bits: list[int], rows: int, rate_bit_s: float, budget_ms: float) -> int:
    """Finest level whose message (rows indices + header) crosses the link within the budget
    (the local FFN time, so that communication stays hidden); the coarsest if none fits."""
    for level in range(len(level_bits) - 1, -1, -1):
        transfer_ms = 1000.0 * (rows * level_bits[level] + 8) / rate_bit_s
        if transfer_ms <= budget_ms:
            return level
    return 0
