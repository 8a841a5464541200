"""The P-device sequence-parallel forward as one differentiable computation.

`tracevq.simulate` runs each device separately and moves the exact wire bytes between them;
this module computes the same logits in one autograd graph, so that fine-tuning sees what the
deployed devices see. Per block b, for the queries of partition p:

    keys/values = [exact K/V of p's own tokens; K/V of every peer token as p reconstructs it]

Every receiver reconstructs a given token the same way, so each token's remote view is
computed once per block for the whole sequence, and each partition gathers its peers' rows
(in the engine's order: own tokens first, then peers in rank order). The remote views:

- `voltage`: the exact block input (the single-device model).
- `astra`: codeword of X^(b), then LN1 and the K/V projection.
- `trace-b`: codeword of X^(0) at block 0 (placement "2 B"; "2 A": the exact X^(0)), of
  Z^(b-1) after it, passed through g(c) = c + FFN(LN2(c)) of block b - 1, then LN1 and the
  projection (what the buffers hold).
- `trace-nb`: a copy per token, Z~ = residual + codeword of the update Z^(b-1) - X^(b-1),
  through the FFN of block b - 1 only with `remote_ffn`; the residual is the copy's previous
  state, and at the first update X^(0), the VQ_0 codeword or nothing, as the placement says
  (tracevq.placement; block 0's K/V from X^(0) or from its VQ_0 codeword).

In training the codewords come from `TrainableQuantizer`s (straight-through); in evaluation
from `ExactCodec`, which encodes exactly as the byte-exact methods do (Astra: the
quantizer's search; Trace: the codebook tree at a level), so the logits equal `simulate`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from tracevq.errors import ConfigError
from tracevq.models import VisionTransformer
from tracevq.partition import partition_ranges
from tracevq.placement import DEFAULT_PLACEMENT, PLACEMENTS
from tracevq.train.quantizer import CodebookRule, TrainableQuantizer
from tracevq.tree import CodebookTree
from tracevq.vq import VectorQuantizer

FAMILIES = ("voltage", "astra", "trace-b", "trace-nb")


class ExactCodec(nn.Module):
    """Codewords as the byte-exact methods choose them (no gradients through the choice)."""

    def __init__(
        self,
        family: str,
        quantizers: Sequence[VectorQuantizer],
        trees: Sequence[CodebookTree] | None = None,
        level: int | None = None,
    ):
        super().__init__()
        self.family = family
        self.quantizers = nn.ModuleList(quantizers)
        self.trees, self.level = trees, level

    def forward(self, block: int, x: Tensor) -> Tensor:
        vq = self.quantizers[block]
        if self.family == "astra" or self.trees is None:
            return vq.decode(vq.nearest(x))
        tree = self.trees[block]
        level = tree.finest if self.level is None else self.level
        positions = tree.encode(vq.project(x).reshape(-1, vq.code_dim), level)
        return vq.decode(tree.rows(positions, level).reshape(x.shape[:-1]))


class TrainingCodec(nn.Module):
    """Straight-through codewords; `loss` and `update` collect and apply every exchange point."""

    def __init__(self, quantizers: Sequence[VectorQuantizer], rule: CodebookRule, seed: int = 0):
        super().__init__()
        self.quantizers = nn.ModuleList(
            TrainableQuantizer(vq, rule, seed + b) for b, vq in enumerate(quantizers)
        )

    def forward(self, block: int, x: Tensor) -> Tensor:
        return self.quantizers[block](x)

    def loss(self) -> Tensor:
        return sum((q.loss for q in self.quantizers), torch.zeros(()))

    def update(self) -> int:
        return sum(q.update() for q in self.quantizers)

    def sync(self) -> None:
        for q in self.quantizers:
            q.sync()


def distributed_logits(
    model: VisionTransformer,
    images: Tensor,
    devices: int,
    family: str,
    codec: nn.Module | None = None,
    probe: list[tuple[Tensor, Tensor]] | None = None,
    placement: str | None = None,
    remote_ffn: bool = False,
) -> Tensor:
    """Device 0's logits (B, classes) when `devices` devices run `family` with `codec`
    (Trace: at `placement`, the method's default when None, and `remote_ffn` for trace-nb).

    `probe`, if given, receives per block the pair (exact [K; V], remote view of [K; V]) of
    every token, each (B, H, N, 2d), for diagnostics."""
    if family not in FAMILIES:
        raise ConfigError(f"no differentiable forward for {family!r}; choose from {FAMILIES}")
    if family != "voltage" and codec is None:
        raise ConfigError(f"{family!r} needs its codebooks (a codec)")
    default = DEFAULT_PLACEMENT.get(family)
    case = PLACEMENTS[placement or default] if default else None
    ranges = partition_ranges(model.config.tokens, devices)
    x = model.embed(images)  # (B, N, D), token t as computed on its own device
    z: Tensor | None = None
    previous: Tensor | None = None  # block input of the previous block (trace-nb)
    residual: Tensor | None = None  # trace-nb: what each token's next update adds to
    for b, block in enumerate(model.blocks):
        if family == "voltage" or (b == 0 and case is not None and not case.sends_vq0):
            seen = x
            if family == "trace-nb" and case.first_residual == "exact":
                residual = x
        elif family == "astra":
            seen = codec(b, x)
        elif family == "trace-b":
            seen = codec(0, x) if b == 0 else model.blocks[b - 1].ffn(codec(b, z))
        elif b == 0:  # "1 B"
            seen = residual = codec(0, x)
        else:
            update = codec(b, z - previous)
            state = update if residual is None else residual + update
            seen = model.blocks[b - 1].ffn(state) if remote_ffn else state
            residual = seen if case.carries_residual else None
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
    family: str,
    codec: nn.Module,
    placement: str | None = None,
    remote_ffn: bool = False,
) -> list[float]:
    """Per block, ||remote [K; V] - exact [K; V]|| / ||exact [K; V]|| over every token: how
    far the receivers' view of a token is from what its own device computes in that run."""
    probe: list[tuple[Tensor, Tensor]] = []
    distributed_logits(model, images, devices, family, codec, probe, placement, remote_ffn)
    return [float((seen - exact).norm() / exact.norm()) for exact, seen in probe]
