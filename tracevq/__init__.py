"""Trace method library: models, the sequence-parallel exchange methods, VQ, codebook tree,
K/V buffers and wire codec, with an in-process P-device simulation.

Submodules beyond the configs and errors load on first use: `tracevq.payload_bits` needs
numpy only, and everything else torch, so the orchestrator and the probe stay light.
"""

from importlib import import_module
from typing import Any

from tracevq.config import MODEL_CONFIGS, ModelConfig, model_config
from tracevq.errors import CheckpointError, ConfigError, ProtocolError, TraceError

_LAZY = {
    "payload_bits": "tracevq.payload",  # numpy (the wire codec): not for `tracevq.errors` users
    "build_model": "tracevq.models",
    "load_checkpoint": "tracevq.checkpoint",
    "simulate": "tracevq.simulation",
    "make_method": "tracevq.methods",
    "Bundle": "tracevq.bundle",
    "FitSettings": "tracevq.bundle",
    "fit_bundle": "tracevq.bundle",
}

__all__ = [
    "MODEL_CONFIGS",
    "ModelConfig",
    "model_config",
    "payload_bits",
    "TraceError",
    "ConfigError",
    "CheckpointError",
    "ProtocolError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tracevq' has no attribute {name!r}")
