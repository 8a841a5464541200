"""Model configurations by name. Pure Python: no torch, so the orchestrator can plan cheaply."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from tracevq.errors import ConfigError

ACTIVATIONS = ("gelu", "gelu_tanh")  # torch's F.gelu with approximate="none" / "tanh"


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a ViT (frames == 1) or a ViViT with joint space-time attention (frames > 1)."""

    name: str
    image_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    frames: int = 1
    tubelet: int = 1  # frames per tubelet; 1 for images
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    num_classes: int = 1000
    # the FFN's GELU: "gelu" (exact, timm's and HF ViT's) or "gelu_tanh" (the tanh
    # approximation, HF ViViT's `gelu_fast`); LayerNorm's epsilon (timm 1e-6, HF ViT 1e-12)
    act: str = "gelu"
    norm_eps: float = 1e-6

    @property
    def is_video(self) -> bool:
        return self.frames > 1

    @property
    def num_patches(self) -> int:
        return (self.frames // self.tubelet) * (self.image_size // self.patch_size) ** 2

    @property
    def tokens(self) -> int:
        """Sequence length N, CLS included."""
        return self.num_patches + 1

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def mlp_dim(self) -> int:
        return int(self.dim * self.mlp_ratio)

    @property
    def patch_dim(self) -> int:
        return self.in_chans * self.tubelet * self.patch_size**2

    def input_shape(self, batch: int = 1) -> tuple[int, ...]:
        if self.is_video:
            return (batch, self.in_chans, self.frames, self.image_size, self.image_size)
        return (batch, self.in_chans, self.image_size, self.image_size)

    def validate(self) -> ModelConfig:
        checks = {
            "image_size": self.image_size % self.patch_size == 0,
            "frames": self.frames % self.tubelet == 0,
            "dim": self.dim % self.heads == 0,
        }
        for field, ok in checks.items():
            if not ok:
                raise ConfigError(f"model {self.name!r}: {field} does not divide evenly: {self}")
        if self.act not in ACTIVATIONS:
            raise ConfigError(
                f"model {self.name!r}: act {self.act!r} is not one of {', '.join(ACTIVATIONS)}",
                "act",
            )
        if not 0 < self.norm_eps < 1:
            raise ConfigError(f"model {self.name!r}: norm_eps {self.norm_eps} is not in (0, 1)")
        return self

    def describe_input(self) -> str:
        """The input layout in words, for errors: `(B, 3, 224, 224)` and what it means."""
        shape = ", ".join(str(n) for n in self.input_shape()[1:])
        layout = "C, T, H, W" if self.is_video else "C, H, W"
        return f"(B, {shape}), i.e. (batch, {layout}), channels first"


MODEL_CONFIGS: dict[str, ModelConfig] = {
    "vit-b16": ModelConfig("vit-b16"),
    # ViT-B/16 with a CIFAR-100 head: fine-tuned timm checkpoints for the paper's CIFAR rows
    "vit-b16-cifar100": ModelConfig("vit-b16-cifar100", num_classes=100),
    "vit-tiny": ModelConfig(
        "vit-tiny", image_size=32, patch_size=8, dim=64, depth=4, heads=4, num_classes=10
    ),
    "vivit-b": ModelConfig("vivit-b", frames=32, tubelet=2, num_classes=101),
    "vivit-tiny": ModelConfig(
        "vivit-tiny",
        image_size=32,
        patch_size=8,
        frames=4,
        tubelet=2,
        dim=64,
        depth=3,
        heads=4,
        num_classes=10,
    ),
    # digits (8x8 grey, upsampled bilinearly to 16x16), patch 4: 16 patches + CLS to split
    # across 2-4 devices; small enough to train to >= 95% in about a minute on one core
    "vit-digits": ModelConfig(
        "vit-digits",
        image_size=16,
        patch_size=4,
        in_chans=1,
        dim=32,
        depth=4,
        heads=4,
        mlp_ratio=2.0,
        num_classes=10,
    ),
    # digit pairs (accuracy.data): two 12x12 digits on a 24x24 canvas, label = their sum
    "vit-digit-pairs": ModelConfig(
        "vit-digit-pairs",
        image_size=24,
        patch_size=4,
        in_chans=1,
        dim=32,
        depth=4,
        heads=4,
        mlp_ratio=2.0,
        num_classes=19,
    ),
    # Fashion-MNIST (28x28 grey), patch 4: 49 patches + CLS, enough tokens for P up to 10
    "vit-fashion": ModelConfig(
        "vit-fashion",
        image_size=28,
        patch_size=4,
        in_chans=1,
        dim=64,
        depth=6,
        heads=4,
        mlp_ratio=2.0,
        num_classes=10,
    ),
}
# glyph pairs (accuracy.glyphs): four 12x12 glyphs on a 24x24 canvas, label = the pair
# (top-left, bottom-right) of 8 glyphs, 64 classes; otherwise the digit-pairs model
MODEL_CONFIGS["vit-glyphs"] = dataclasses.replace(
    MODEL_CONFIGS["vit-digit-pairs"], name="vit-glyphs", num_classes=64
)


def model_config(name: str, **overrides: object) -> ModelConfig:
    """The named configuration with fields replaced by `overrides`."""
    if name not in MODEL_CONFIGS:
        hint = difflib.get_close_matches(name, MODEL_CONFIGS, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(
            f"unknown model {name!r}{suggestion}; known: {', '.join(sorted(MODEL_CONFIGS))}"
        )
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"name"}
    for key in overrides:
        if key not in fields:
            hint = difflib.get_close_matches(key, fields, n=1)
            suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"model {name!r}: unknown override {key!r}{suggestion}")
    return dataclasses.replace(MODEL_CONFIGS[name], **overrides).validate()


def known_model_name(name: str) -> str:
    """`name` if it names a configuration; else ValueError with the hint, for validators."""
    try:
        model_config(name)
    except ConfigError as error:
        raise ValueError(str(error)) from None
    return name
