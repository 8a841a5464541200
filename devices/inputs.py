"""The inputs of a session: every device builds the same batches (and embeds only its part).

Either generated: batch i is `torch.randn` of the model's input shape from a generator seeded
with `seed * 100003 + i` (so warm-ups and measured inferences see fixed, reproducible inputs),
or loaded from a `.pt` file holding a tensor (N, C, [T,] H, W), or a dict with `inputs` and
optional `labels` (N,): batch i takes rows i*B .. i*B + B - 1, wrapping around N.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor

from devices.errors import SpecError
from tracevq.config import ModelConfig

SEED_STRIDE = 100_003


def generated_batch(config: ModelConfig, batch: int, seed: int, index: int) -> Tensor:
    """Input batch `index` of the generated inputs for `seed` (what every device uses)."""
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + index)
    return torch.randn(config.input_shape(batch), generator=generator)


class InputSource:
    """Batches by inference index, with labels when the input file has them."""

    def __init__(self, config: ModelConfig, batch: int, seed: int, path: Path | None = None):
        self.config, self.batch_size, self.seed = config, batch, seed
        self.inputs: Tensor | None = None
        self.labels: Tensor | None = None
        if path is None:
            self.description = f"generated seed {seed}"
        else:
            self._load(path)
            digest = hashlib.blake2b(path.read_bytes(), digest_size=8).hexdigest()
            self.description = f"file {digest}"

    def _load(self, path: Path) -> None:
        if not path.is_file():
            raise SpecError(f"inputs file not found: {path}")
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any unpickling failure means a bad file
            raise SpecError(f"inputs {path} cannot be read: {error}") from None
        inputs, labels = data, None
        if isinstance(data, dict):
            inputs, labels = data.get("inputs"), data.get("labels")
        elif isinstance(data, list | tuple) and len(data) == 2:
            inputs, labels = data
        expected = self.config.input_shape(1)[1:]
        if not isinstance(inputs, Tensor) or tuple(inputs.shape[1:]) != expected:
            shape = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
            raise SpecError(f"inputs {path}: expected a tensor (N, {expected}), got {shape}")
        if labels is not None and (not isinstance(labels, Tensor) or len(labels) != len(inputs)):
            raise SpecError(f"inputs {path}: labels must be a tensor of {len(inputs)} entries")
        self.inputs = inputs.float()
        self.labels = None if labels is None else labels.long()

    def get(self, index: int) -> tuple[Tensor, Tensor | None]:
        """(inputs (B, ...), labels (B,) or None) of batch `index`."""
        if self.inputs is None:
            return generated_batch(self.config, self.batch_size, self.seed, index), None
        rows = torch.arange(index * self.batch_size, (index + 1) * self.batch_size)
        rows = rows % len(self.inputs)
        labels = None if self.labels is None else self.labels[rows]
        return self.inputs[rows], labels
