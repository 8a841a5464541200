"""ViT and ViViT (joint space-time attention) with timm-compatible parameter names.

The blocks expose their pieces (projections, attention, FFN) separately, because the
sequence-parallel methods run them on different token sets: local queries attend over local
keys and a method-specific reconstruction of every peer's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tracevq.config import ModelConfig, model_config
from tracevq.errors import InputShapeError


@dataclass
class RemoteKV:
    """A peer's keys and values as seen by a receiver, with an optional logit bias per key."""

    k: Tensor  # (B, H, n, d)
    v: Tensor  # (B, H, n, d)
    bias: Tensor | None = None  # (n,) or (B, n) added to the attention logits of these keys


@dataclass
class RemoteRows:
    """A peer's tokens as codebook rows whose K/V are a function of the row alone.

    The engine attends once per distinct row of all peers together, with log(count) added to
    its logit (`Method.row_kv` gives the K/V of those rows): the same output as attending over
    every token, with fewer keys.
    """

    rows: Tensor  # (B, n) int64


def split_heads(x: Tensor, heads: int) -> Tensor:
    batch, tokens, dim = x.shape
    return x.view(batch, tokens, heads, dim // heads).transpose(1, 2)  # (B, H, n, d)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def qkv_heads(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv(h).chunk(3, dim=-1)  # (B, n, D) each
        return split_heads(q, self.heads), split_heads(k, self.heads), split_heads(v, self.heads)

    def kv_heads(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values only: the last two thirds of the qkv projection."""
        dim = h.shape[-1]
        kv = F.linear(h, self.qkv.weight[dim:], self.qkv.bias[dim:])  # (B, n, 2D)
        k, v = kv.chunk(2, dim=-1)
        return split_heads(k, self.heads), split_heads(v, self.heads)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None) -> Tensor:
        """Softmax attention of q over k/v, then the output projection: (B, n_q, D)."""
        mask = None
        if bias is not None:  # (n_k,) for every batch element, or (B, n_k)
            mask = bias.to(q.dtype).view(-1 if bias.dim() == 2 else 1, 1, 1, bias.shape[-1])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, n_q, d)
        batch, heads, tokens, head_dim = out.shape
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, heads * head_dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str = "gelu"):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.approximate = "tanh" if act == "gelu_tanh" else "none"

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-LN Transformer block: Z = X + MHSA(LN1 X); X' = Z + FFN(LN2 Z)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        dim = config.dim
        self.norm1 = nn.LayerNorm(dim, eps=config.norm_eps)
        self.attn = Attention(dim, config.heads)
        self.norm2 = nn.LayerNorm(dim, eps=config.norm_eps)
        self.mlp = Mlp(dim, config.mlp_dim, config.act)

    def remote_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """K/V of tokens whose block input is x (the receiver-side projection chain)."""
        return self.attn.kv_heads(self.norm1(x))

    def ffn(self, z: Tensor) -> Tensor:
        return z + self.mlp(self.norm2(z))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.attn.qkv_heads(self.norm1(x))
        return self.ffn(x + self.attn.attend(q, k, v))


class PatchEmbed(nn.Module):
    """Linear embedding of patches (images) or tubelets (videos); the conv of timm's layout."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        size = config.patch_size
        if config.is_video:
            kernel = (config.tubelet, size, size)
            self.proj = nn.Conv3d(config.in_chans, config.dim, kernel, stride=kernel)
        else:
            self.proj = nn.Conv2d(config.in_chans, config.dim, size, stride=size)

    def patches(self, x: Tensor) -> Tensor:
        """Flattened patches in token order: (B, num_patches, C * [t *] p * p)."""
        c, p = self.config, self.config.patch_size
        if tuple(x.shape[1:]) != c.input_shape()[1:]:
            raise InputShapeError(
                f"model {c.name!r} takes input {c.describe_input()}; given {tuple(x.shape)}"
            )
        grid = c.image_size // p
        if c.is_video:
            b, ch, frames = x.shape[:3]
            x = x.reshape(b, ch, frames // c.tubelet, c.tubelet, grid, p, grid, p)
            x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # (B, T', H', W', C, t, p, p)
        else:
            b, ch = x.shape[:2]
            x = x.reshape(b, ch, grid, p, grid, p).permute(0, 2, 4, 1, 3, 5)  # (B, H', W', C, p, p)
        return x.reshape(b, c.num_patches, c.patch_dim)

    def forward(self, x: Tensor, start: int = 0, stop: int | None = None) -> Tensor:
        """Embeddings of patches [start, stop) only: a device embeds just its own patches."""
        selected = self.patches(x)[:, start:stop]  # (B, n, patch_dim)
        weight = self.proj.weight.reshape(self.proj.out_channels, -1)
        return F.linear(selected, weight, self.proj.bias)  # (B, n, D)


class VisionTransformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.dim))
        self.pos_embed = nn.Parameter(torch.randn(1, config.tokens, config.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.head = nn.Linear(config.dim, config.num_classes)
        self.apply(_init_weights)

    def configure(self, act: str, norm_eps: float) -> None:
        """Set the numerics a checkpoint says it was trained with (no weight changes)."""
        self.config = replace(self.config, act=act, norm_eps=norm_eps).validate()
        self.patch_embed.config = self.config
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.eps = norm_eps
            elif isinstance(module, Mlp):
                module.approximate = "tanh" if act == "gelu_tanh" else "none"

    def embed(self, x: Tensor, start: int = 0, stop: int | None = None) -> Tensor:
        """Block-0 input X^(0) of tokens [start, stop) (token 0 = CLS): (B, n, D)."""
        stop = self.config.tokens if stop is None else stop
        parts = []
        if start == 0:
            parts.append(self.cls_token.expand(x.shape[0], -1, -1))
        parts.append(self.patch_embed(x, max(start - 1, 0), stop - 1))
        return torch.cat(parts, dim=1) + self.pos_embed[:, start:stop]

    def classify(self, cls_state: Tensor) -> Tensor:
        """Logits from the final state of the CLS token: (B, D) -> (B, classes)."""
        return self.head(self.norm(cls_state))

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.classify(h[:, 0])


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def build_model(name: str, seed: int = 0, **overrides: object) -> VisionTransformer:
    """A model by config name (see tracevq.config), weights initialised from `seed`, eval mode."""
    config = model_config(name, **overrides)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = VisionTransformer(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()
