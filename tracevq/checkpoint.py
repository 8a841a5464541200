"""Weights for our ViT and ViViT from local files, in timm's layout (ours) or Hugging Face's.

What is read, always without executing code from the file:

- timm: a state dict in a .pth, .pt, .bin or .safetensors file, plain or wrapped
  (`{"model" | "state_dict" | "model_state_dict": ...}`), with DataParallel's `module.`
  prefix or not, and timm's training checkpoints (`train.py`'s `checkpoint-*.pth.tar`:
  `state_dict`, `optimizer`, `args` as an argparse.Namespace, `state_dict_ema`). They are read
  by torch's weights-only unpickler, argparse.Namespace the one class allowed beyond tensors
  and containers. `ema=True` takes the EMA weights (`state_dict_ema`, or `model_ema` as DeiT
  saves them) and is refused when there are none.
- Hugging Face transformers: ViTForImageClassification and VivitForVideoClassification
  weights, as a `save_pretrained` folder (config.json beside model.safetensors, a sharded
  safetensors index, or pytorch_model.bin) or one weights file. The `vit.` / `vivit.` names
  are mapped to ours, the separate query, key and value projections concatenated into qkv.
  The config.json (the folder's, or the one beside the file) sets the activation
  (`hidden_act`: gelu, or the tanh approximation HF calls gelu_fast, gelu_new and
  gelu_pytorch_tanh) and the LayerNorm epsilon (`layer_norm_eps`, 1e-12 for ViT), and its
  shape fields are checked against the model's, heads included (they change no tensor shape).

Every key must then match the model by name and shape: missing, unexpected and misshapen
keys are refused together, in one CheckpointError. `save_checkpoint` writes one safetensors
file under our names with the activation and epsilon in its metadata, which this reader sets
again: what a run gives its devices.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tracevq.config import ModelConfig
from tracevq.errors import CheckpointError

_WRAPPER_KEYS = ("model", "state_dict", "model_state_dict")
_EMA_KEYS = ("state_dict_ema", "model_ema")  # timm's train.py, DeiT's
_LISTED = 8  # names shown per kind of problem
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# HF's names for the tanh approximation of GELU (FastGELU, NewGELU, torch's tanh GELU)
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_fast": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}
# HF's names below the `vit.` / `vivit.` prefix -> ours. Files (save_pretrained, the Hub) use
# transformers 4's names; transformers 5 keeps them on disk but its modules' own state_dict()
# says `layers.N.attention.q_proj` and `layers.N.mlp.fc1`: both are read.
_HF_LAYER = r"(?:encoder\.layer|layers)\.(\d+)\."
_HF_NAMES = [
    (r"embeddings\.cls_token", "cls_token"),
    (r"embeddings\.position_embeddings", "pos_embed"),
    (r"embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (_HF_LAYER + r"layernorm_before\.", r"blocks.\1.norm1."),
    (_HF_LAYER + r"layernorm_after\.", r"blocks.\1.norm2."),
    (_HF_LAYER + r"attention\.(?:output\.dense|o_proj)\.", r"blocks.\1.attn.proj."),
    (_HF_LAYER + r"(?:intermediate\.dense|mlp\.fc1)\.", r"blocks.\1.mlp.fc1."),
    (_HF_LAYER + r"(?:output\.dense|mlp\.fc2)\.", r"blocks.\1.mlp.fc2."),
    (r"layernorm\.", "norm."),
]
_HF_QKV = re.compile(
    _HF_LAYER + r"attention\.(?:attention\.(query|key|value)|(q|k|v)_proj)\.(weight|bias)"
)
_QKV_PARTS = {"q": "query", "k": "key", "v": "value"}


@dataclass
class Checkpoint:
    """A checkpoint's tensors under our names, and what its configuration says, if any."""

    state: dict[str, Tensor]
    layout: str  # "timm" or "hf"
    config: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields it states


def _torch_load(path: Path) -> Any:
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any reader failure means an unreadable file
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        if found:
            raise CheckpointError(
                f"checkpoint {path} refers to {found.group(1)} (beyond tensors and containers), "
                "which is not read: it would run code from the file; if you trust it, save its "
                "weights alone: torch.save(torch.load(path, weights_only=False)['state_dict'], "
                "'weights.pth')"
            ) from None
        raise CheckpointError(f"checkpoint {path} cannot be read: {_first(error)}") from None


def _first(error: Exception) -> str:
    """An error's first line (torch's and safetensors' run over several)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _read_file(path: Path) -> Any:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as error:  # noqa: BLE001
            raise CheckpointError(f"checkpoint {path} cannot be read: {_first(error)}") from None
    if path.name.endswith(".index.json"):  # HF's sharded safetensors
        try:
            shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as error:
            raise CheckpointError(f"{path}: not a safetensors index ({error})") from None
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(_read_file(path.parent / shard))
        return state
    return _torch_load(path)


def _unwrap(loaded: Any, path: Path, ema: bool) -> dict[str, Tensor]:
    state = loaded
    if ema:
        keys = [
            k for k in _EMA_KEYS if isinstance(loaded, dict) and isinstance(loaded.get(k), dict)
        ]
        if not keys:
            held = ", ".join(sorted(map(str, loaded))[:_LISTED]) if isinstance(loaded, dict) else ""
            raise CheckpointError(
                f"checkpoint {path} holds no EMA weights ({' or '.join(_EMA_KEYS)}); "
                f"it holds: {held or type(loaded).__name__}"
            )
        state = loaded[keys[0]]
    for key in _WRAPPER_KEYS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint {path} holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def _saved_numerics(path: Path) -> dict[str, Any]:
    """The activation and epsilon `save_checkpoint` put in a safetensors file's metadata."""
    if path.suffix != ".safetensors":
        return {}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as stream:
        metadata = stream.metadata() or {}
    if "tracevq.act" not in metadata:
        return {}
    try:
        return {"act": metadata["tracevq.act"], "norm_eps": float(metadata["tracevq.norm_eps"])}
    except (KeyError, ValueError):
        raise CheckpointError(
            f"checkpoint {path}: its tracevq.norm_eps metadata is not a number"
        ) from None


def save_checkpoint(model: nn.Module, path: str | Path) -> Path:
    """The model's weights as one safetensors file under our names, its activation and
    LayerNorm epsilon in the file's metadata (what a run gives its devices)."""
    from safetensors.torch import save_file

    path = Path(path)
    config = model.config
    metadata = {"tracevq.act": config.act, "tracevq.norm_eps": repr(config.norm_eps)}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata)
    return path


def _is_hf(state: dict[str, Tensor]) -> bool:
    return any("embeddings.patch_embeddings" in k for k in state)


def from_hf_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF ViT/ViViT tensors under our names (names it does not know are kept, to be refused)."""
    mapped: dict[str, Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, Tensor]] = {}
    for name, tensor in state.items():
        short = re.sub(r"^(vit|vivit)\.", "", name)
        if name.startswith("classifier."):
            mapped["head." + name.removeprefix("classifier.")] = tensor
            continue
        found = _HF_QKV.fullmatch(short)
        if found:
            block, part, short_part, kind = found.groups()
            qkv.setdefault((block, kind), {})[part or _QKV_PARTS[short_part]] = tensor
            continue
        for pattern, ours in _HF_NAMES:
            if re.match(pattern, short):
                mapped[re.sub(f"^{pattern}", ours, short)] = tensor
                break
        else:
            mapped[name] = tensor
    for (block, kind), parts in qkv.items():
        missing = [p for p in ("query", "key", "value") if p not in parts]
        if missing:
            raise CheckpointError(f"HF checkpoint: layer {block} has no attention {missing[0]}")
        fused = torch.cat([parts["query"], parts["key"], parts["value"]])
        mapped[f"blocks.{block}.attn.qkv.{kind}"] = fused
    return mapped


def hf_config_fields(hf: dict[str, Any], where: Path) -> dict[str, Any]:
    """The ModelConfig fields an HF config.json states (CheckpointError on what we lack)."""
    act = hf.get("hidden_act", "gelu")
    if act not in HF_ACTIVATIONS:
        raise CheckpointError(
            f"{where}: hidden_act {act!r} is not supported (gelu, or the tanh GELU: "
            f"{', '.join(k for k in HF_ACTIVATIONS if k != 'gelu')})"
        )
    if hf.get("qkv_bias", True) is not True:
        raise CheckpointError(f"{where}: qkv_bias false is not supported (our qkv has a bias)")
    fields: dict[str, Any] = {"act": HF_ACTIVATIONS[act]}
    plain = {
        "image_size": "image_size",
        "num_channels": "in_chans",
        "hidden_size": "dim",
        "num_hidden_layers": "depth",
        "num_attention_heads": "heads",
        "layer_norm_eps": "norm_eps",
    }
    fields.update({ours: hf[key] for key, ours in plain.items() if key in hf})
    if "tubelet_size" in hf:  # ViViT: [t, p, p]
        fields["tubelet"], fields["patch_size"] = hf["tubelet_size"][0], hf["tubelet_size"][1]
        fields["frames"] = hf.get("num_frames", 32)
    elif "patch_size" in hf:
        fields["patch_size"] = hf["patch_size"]
    if "intermediate_size" in hf and "hidden_size" in hf:
        fields["mlp_ratio"] = hf["intermediate_size"] / hf["hidden_size"]
    if isinstance(hf.get("id2label"), dict):
        fields["num_classes"] = len(hf["id2label"])
    return fields


def _hf_config(path: Path) -> tuple[dict[str, Any], Path | None]:
    where = (path if path.is_dir() else path.parent) / "config.json"
    if not where.is_file():
        return {}, None
    try:
        return json.loads(where.read_text()), where
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{where}: not readable JSON ({error})") from None


def read_checkpoint(path: str | Path, ema: bool = False) -> Checkpoint:
    """A checkpoint file or HF folder: its tensors under our names, and its stated config."""
    path = Path(path)
    if path.is_dir():
        weights = next((path / name for name in HF_WEIGHTS if (path / name).is_file()), None)
        if weights is None:
            raise CheckpointError(
                f"checkpoint folder {path} has none of {', '.join(HF_WEIGHTS)} "
                "(a Hugging Face save_pretrained folder)"
            )
    elif path.is_file():
        weights = path
    else:
        raise CheckpointError(f"checkpoint file not found: {path}")
    state = _unwrap(_read_file(weights), weights, ema)
    if not _is_hf(state):
        return Checkpoint(state, "timm", _saved_numerics(weights))
    hf, where = _hf_config(path)
    stated = hf_config_fields(hf, where) if where is not None else {}
    return Checkpoint(from_hf_names(state), "hf", stated)


def _check_config(config: ModelConfig, stated: dict[str, Any], path: Path) -> None:
    wrong = [
        f"{name} {value!r} (model: {getattr(config, name)!r})"
        for name, value in stated.items()
        if name not in ("act", "norm_eps") and getattr(config, name) != value
    ]
    if wrong:
        raise CheckpointError(
            f"checkpoint {path} was configured for another model than {config.name!r}: "
            + ", ".join(wrong)
        )


def load_checkpoint(model: nn.Module, path: str | Path, ema: bool = False) -> nn.Module:
    """Copy the checkpoint's weights into `model`; every key must match by name and shape.
    An HF checkpoint's config.json also sets the model's activation and LayerNorm epsilon."""
    checkpoint = read_checkpoint(path, ema)
    state = checkpoint.state
    config = getattr(model, "config", None)
    if checkpoint.config and isinstance(config, ModelConfig):
        _check_config(config, checkpoint.config, Path(path))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{k} {tuple(state[k].shape)} (model: {tuple(expected[k].shape)})"
        for k in set(state) & set(expected)
        if state[k].shape != expected[k].shape
    )
    problems = [
        f"{label}: {', '.join(names[:_LISTED])}"
        + (f" (+{len(names) - _LISTED} more)" if len(names) > _LISTED else "")
        for label, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("wrong shape", wrong),
        )
        if names
    ]
    if problems:
        raise CheckpointError(
            f"checkpoint {path} ({checkpoint.layout} layout) does not fit the model: "
            + "; ".join(problems)
        )
    model.load_state_dict(state)
    if "act" in checkpoint.config and isinstance(config, ModelConfig):  # HF's, or ours
        model.configure(
            checkpoint.config["act"], checkpoint.config.get("norm_eps", config.norm_eps)
        )
    return model.eval()
