"""The comparison methods: Voltage (full activations), Prism (segment means), Astra (VQ of the
block input, projection at the receiver). None of them can overlap: their message is needed
before the block's attention. Their receivers' differentiable views: Voltage's is the exact
block input, Astra's the codeword of it; Prism has none."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from tracevq.codec import index_bits, pack_indices, unpack_indices
from tracevq.methods.base import Method, Receiver, ReceiverView, Sender
from tracevq.models import RemoteKV, RemoteRows, VisionTransformer
from tracevq.spec import MethodSpec
from tracevq.tree import CodebookTree
from tracevq.vq import VectorQuantizer


def tensor_bytes(x: Tensor, dtype: np.dtype) -> bytes:
    return x.detach().contiguous().numpy().astype(dtype, copy=False).tobytes()


def bytes_tensor(message: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> Tensor:
    array = np.frombuffer(message, dtype=dtype).astype(np.float32).reshape(shape)
    return torch.from_numpy(array)


class VoltageSender(Sender):
    def pre_block(self, block: int, x: Tensor) -> bytes:
        return tensor_bytes(x, np.dtype("<f4"))


class VoltageReceiver(Receiver):
    def __init__(self, method: Voltage, peer: int, tokens: int, batch: int):
        self.method, self.peer, self.shape = method, peer, (batch, tokens, method.dim)

    def remote_kv(self, block: int, message: bytes) -> RemoteKV:
        self.check_length(message, 4 * math.prod(self.shape), self.method.name, block)
        x = bytes_tensor(message, np.dtype("<f4"), self.shape)  # (B, n, D)
        self.check_finite(x, self.method.name, block)
        return RemoteKV(*self.method.model.blocks[block].remote_kv(x))


class Voltage(Method):
    """Sends the block input X_p in fp32; receivers run LN1 and the K/V projection."""

    view_class = ReceiverView  # the exact block input

    def __init__(self, spec: MethodSpec, model: VisionTransformer):
        super().__init__(spec, model)
        self.dim = model.config.dim

    def sender(self, rank: int, tokens: int, batch: int) -> Sender:
        return VoltageSender()

    def receiver(self, peer: int, tokens: int, batch: int) -> Receiver:
        return VoltageReceiver(self, peer, tokens, batch)


class PrismSender(Sender):
    def __init__(self, method: Prism):
        self.method = method

    def pre_block(self, block: int, x: Tensor) -> bytes:
        h = self.method.model.blocks[block].norm1(x)  # (B, n, D)
        means = torch.stack([group.mean(dim=1) for group in h.split(self.method.segment, 1)], 1)
        return tensor_bytes(means, self.method.dtype)  # (B, groups, D)


class PrismReceiver(Receiver):
    def __init__(self, method: Prism, peer: int, tokens: int, batch: int):
        self.method, self.peer = method, peer
        self.shape = (batch, math.ceil(tokens / method.segment), method.model.config.dim)
        counts = [len(group) for group in torch.arange(tokens).split(method.segment)]
        # a mean key stands for `count` tokens: log(count) on its logit
        self.bias = torch.tensor(counts, dtype=torch.float32).log()

    def remote_kv(self, block: int, message: bytes) -> RemoteKV:
        expected = self.method.dtype.itemsize * math.prod(self.shape)
        self.check_length(message, expected, self.method.name, block)
        means = bytes_tensor(message, self.method.dtype, self.shape)  # (B, groups, D)
        self.check_finite(means, self.method.name, block)
        k, v = self.method.model.blocks[block].attn.kv_heads(means)
        return RemoteKV(k, v, self.bias)


class Prism(Method):
    """Sends means of LN1(X_p) over groups of `segment` consecutive tokens."""

    def __init__(self, spec: MethodSpec, model: VisionTransformer):
        super().__init__(spec, model)
        self.segment = spec.segment
        self.dtype = np.dtype("<f4" if spec.mean_bits == 32 else "<f2")

    def sender(self, rank: int, tokens: int, batch: int) -> Sender:
        return PrismSender(self)

    def receiver(self, peer: int, tokens: int, batch: int) -> Receiver:
        return PrismReceiver(self, peer, tokens, batch)


class AstraSender(Sender):
    def __init__(self, method: Astra):
        self.method = method

    def pre_block(self, block: int, x: Tensor) -> bytes:
        indices = self.method.quantizers[block].nearest(x).reshape(-1)
        return self.method.pack(indices)


class AstraReceiver(Receiver):
    def __init__(self, method: Astra, peer: int, tokens: int, batch: int):
        self.method, self.peer, self.shape = method, peer, (batch, tokens)
        self.expected_bytes = method.message_bytes(tokens, batch)

    def remote_kv(self, block: int, message: bytes) -> RemoteKV | RemoteRows:
        self.check_length(message, self.expected_bytes, self.method.name, block)
        array = self.method.unpack(message, math.prod(self.shape))
        # 16-bit words, or packed at ceil(log2 K) bits: either can hold an index >= K
        self.check_indices(array, self.method.spec.K, self.method.name, block)
        indices = torch.from_numpy(array).reshape(self.shape)
        if self.method.spec.dedup:
            return RemoteRows(indices)
        x = self.method.quantizers[block].decode(indices)  # (B, n, D)
        return RemoteKV(*self.method.model.blocks[block].remote_kv(x))


class CodewordView(ReceiverView):
    """Astra's receivers see the codeword of the block input X^(b), at every block."""

    def seen(self, block: int, x: Tensor, previous: Tensor | None, z: Tensor | None) -> Tensor:
        assert self.codec is not None, "receiver_view checks the codec"
        return self.codec(block, x)


class Astra(Method):
    """Sends the index of the nearest codeword of X_p; receivers project the codeword."""

    view_class = CodewordView

    def __init__(
        self,
        spec: MethodSpec,
        model: VisionTransformer,
        quantizers: list[VectorQuantizer],
        trees: list[CodebookTree] | None = None,  # a bundle's family has them; Astra has no levels
    ):
        super().__init__(spec, model)
        self.quantizers = quantizers
        self.bits = index_bits(spec.K)

    def row_kv(self, block: int, rows: Tensor) -> tuple[Tensor, Tensor]:
        x = self.quantizers[block].decode(rows).unsqueeze(0)  # (1, U, D)
        return self.model.blocks[block].remote_kv(x)

    def pack(self, indices: Tensor) -> bytes:
        if self.spec.packed:
            return pack_indices(indices.numpy(), self.bits)
        return indices.numpy().astype("<u2").tobytes()

    def unpack(self, message: bytes, rows: int) -> np.ndarray:
        """The message's `rows` indices (int64), not yet checked against K."""
        if self.spec.packed:
            return unpack_indices(message, rows, self.bits)
        return np.frombuffer(message, dtype="<u2").astype(np.int64)

    def sender(self, rank: int, tokens: int, batch: int) -> Sender:
        return AstraSender(self)

    def receiver(self, peer: int, tokens: int, batch: int) -> Receiver:
        return AstraReceiver(self, peer, tokens, batch)
