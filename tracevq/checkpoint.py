"""Load timm-format ViT weights from a local file (.pth, .pt, .bin or .safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from tracevq.errors import CheckpointError

_WRAPPER_KEYS = ("model", "state_dict", "model_state_dict")
_LISTED = 8  # names shown per kind of problem


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The tensors of a checkpoint file; unwraps {"model": ...} and {"state_dict": ...}."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any reader failure means an unreadable file
        raise CheckpointError(f"checkpoint {path} cannot be read: {error}") from error
    for key in _WRAPPER_KEYS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint {path} holds no state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_checkpoint(model: nn.Module, path: str | Path) -> nn.Module:
    """Copy the checkpoint's weights into `model`; every key must match by name and shape."""
    state = read_state_dict(path)
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
        raise CheckpointError(f"checkpoint {path} does not fit the model: " + "; ".join(problems))
    model.load_state_dict(state)
    return model.eval()
