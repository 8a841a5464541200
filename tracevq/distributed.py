"""The P-device sequence-parallel forward as one differentiable computation.

`tracevq.simulate` runs each device separately and moves the exact wire bytes between them;
this module computes the same logits in one autograd graph, so that fine-tuning sees what the
deployed devices see. Per block b, for the queries of partition p:

    keys/values = [exact K/V of p's own tokens; K/V of every peer token as p reconstructs it]

Every receiver reconstructs a given token the same way, so each token's remote view is
computed once per block for the whole sequence, and each partition gathers its peers' rows
(in the engine's order: own tokens first, then peers in rank order). The remote view is the
method's own (`Method.receiver_view`, beside its byte-exact receiver in `tracevq.methods`):
Voltage's is the exact block input, Astra's the codeword of it, Trace-b's and Trace-nb's
follow their placement; this module knows no method by name.

The codewords come from a codec, codec(b, rows) -> codewords: in evaluation `ExactCodec`,
which encodes exactly as the byte-exact methods do (the quantizer's search; with trees, those
of the methods with levels, the tree's at a level), so the logits equal `simulate`'s; in the
accuracy study's training a straight-through one (`accuracy.quantizer.TrainingCodec`).

Why this lives in the library and not in the study: it is the methods' own definition in one
autograd graph (each method class owns its view; the tests hold it equal to the byte-exact
path, and a new method's test runs through it), and it needs nothing of the study; what is the
study's, how codewords learn (straight-through, commitment loss, the update rules) and the
training loops, stays in `accuracy`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from tracevq.bundle import Bundle
from tracevq.models import VisionTransformer
from tracevq.partition import device_layout, partition_ranges
from tracevq.spec import MethodSpec, method_spec
from tracevq.tree import CodebookTree
from tracevq.vq import VectorQuantizer


class ExactCodec(nn.Module):
    """Codewords as the byte-exact methods choose them (no gradients through the choice): the
    quantizer's nearest codeword, or with `trees` the tree's search at `level` (the finest
    when None)."""

    def __init__(
        self,
        quantizers: Sequence[VectorQuantizer],
        trees: Sequence[CodebookTree] | None = None,
        level: int | None = None,
    ):
        super().__init__()
        self.quantizers = nn.ModuleList(quantizers)
        self.trees, self.level = trees, level

    @classmethod
    def of(cls, spec: MethodSpec, bundle: Bundle, level: int | None = None) -> ExactCodec:
        """The codec of `spec`'s family in `bundle`, with its trees if the method has levels."""
        quantizers, trees = bundle.family(spec.name)
        return cls(quantizers, trees if spec.is_trace else None, level)

    def forward(self, block: int, x: Tensor) -> Tensor:
        vq = self.quantizers[block]
        if self.trees is None:
            return vq.decode(vq.nearest(x))
        tree = self.trees[block]
        level = tree.finest if self.level is None else self.level
        positions = tree.encode(vq.project(x).reshape(-1, vq.code_dim), level)
        return vq.decode(tree.rows(positions, level).reshape(x.shape[:-1]))


def distributed_logits(
    model: VisionTransformer,
    images: Tensor,
    devices: int | Sequence[int],
    method: str | MethodSpec,
    codec: nn.Module | None = None,
    probe: list[tuple[Tensor, Tensor]] | None = None,
    **params: object,
) -> Tensor:
    """Device 0's logits (B, classes) when `devices` devices run `method` with `codec`
    (a name takes its `params` through `tracevq.spec.method_spec`: a Trace placement, the
    method's default when absent, and trace-nb's remote_ffn).

    `probe`, if given, receives per block the pair (exact [K; V], remote view of [K; V]) of
    every token, each (B, H, N, 2d), for diagnostics. `devices`: how many, split evenly, or
    every device's tokens (tracevq.partition)."""
    spec = method if isinstance(method, MethodSpec) else method_spec(method, **params)
    view = spec.entry.implementation_class().receiver_view(spec, model, codec)
    ranges = partition_ranges(model.config.tokens, *device_layout(devices))
    x = model.embed(images)  # (B, N, D), token t as computed on its own device
    z: Tensor | None = None  # post-attention residual of the previous block
    previous: Tensor | None = None  # block input of the previous block
    for b, block in enumerate(model.blocks):
        seen = view.seen(b, x, previous, z)  # (B, N, D): every token as its peers see it
        remote_k, remote_v = block.remote_kv(seen)  # (B, H, N, d) each
        q, k, v = block.attn.qkv_heads(block.norm1(x))  # (B, H, N, d) each
        if probe is not None:
            probe.append((torch.cat([k, v], -1), torch.cat([remote_k, remote_v], -1)))
        outputs = []
        for start, stop in ranges:
            own = slice(start, stop)
            keys = torch.cat([k[:, :, own], remote_k[:, :, :start], remote_k[:, :, stop:]], 2)
            values = torch.cat([v[:, :, own], remote_v[:, :, :start], remote_v[:, :, stop:]], 2)
            outputs.append(block.attn.attend(q[:, :, own], keys, values))  # (B, n_p, D)
        previous, z = x, x + torch.cat(outputs, dim=1)
        x = block.ffn(z)
    return model.classify(x[:, 0])


@torch.no_grad()
def remote_kv_error(
    model: VisionTransformer,
    images: Tensor,
    devices: int,
    method: str | MethodSpec,
    codec: nn.Module | None = None,
    **params: object,
) -> list[float]:
    """Per block, ||remote [K; V] - exact [K; V]|| / ||exact [K; V]|| over every token: how
    far the receivers' view of a token is from what its own device computes in that run."""
    probe: list[tuple[Tensor, Tensor]] = []
    distributed_logits(model, images, devices, method, codec, probe, **params)
    return [float((seen - exact).norm() / exact.norm()) for exact, seen in probe]
