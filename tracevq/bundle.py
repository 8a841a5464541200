"""The bundle: one file with everything a device needs beside the model weights.

It holds the model's fingerprint, the codebooks of each codebook method family (one VQ per
exchange point, fitted on what the method table says the family quantises) and their codebook
trees. K/V buffers are not stored: they are recomputed
from the frozen weights at load. Every device loads the same bundle, and the session
handshake compares fingerprints so that a mismatch is refused instead of giving wrong logits.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from tracevq.errors import ConfigError
from tracevq.method_table import METHODS, codebook_methods
from tracevq.models import VisionTransformer
from tracevq.tree import CodebookTree, build_tree
from tracevq.vq import VectorQuantizer, kmeans

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def fingerprint_tensors(named: dict[str, Tensor]) -> str:
    """Short stable hash of named tensors (names, shapes and values)."""
    digest = hashlib.blake2b(digest_size=12)
    for name in sorted(named):
        tensor = named[name].detach().contiguous().cpu()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def model_fingerprint(model: nn.Module) -> str:
    return fingerprint_tensors(dict(model.state_dict()))


@dataclass
class Bundle:
    model_name: str
    model_fingerprint: str
    K: int
    quantizers: dict[str, list[VectorQuantizer]]
    trees: dict[str, list[CodebookTree]]
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        named = {}
        for family, vqs in self.quantizers.items():
            for b, vq in enumerate(vqs):
                for key, value in vq.state_dict().items():
                    if not key.startswith("ema_"):
                        named[f"{family}.{b}.{key}"] = value
                for key, value in self.trees[family][b].state_dict().items():
                    if isinstance(value, Tensor):
                        named[f"{family}.{b}.tree.{key}"] = value
        return fingerprint_tensors(named)

    def family(self, method: str) -> tuple[list[VectorQuantizer], list[CodebookTree]]:
        if method not in self.quantizers:
            raise ConfigError(
                f"the bundle has no codebooks for method {method!r} "
                f"(it has: {', '.join(self.quantizers) or 'none'})"
            )
        return self.quantizers[method], self.trees[method]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "format": FORMAT_VERSION,
            "model_name": self.model_name,
            "model_fingerprint": self.model_fingerprint,
            "K": self.K,
            "meta": self.meta,
            "quantizers": {
                f: [vq.state_dict() for vq in vqs] for f, vqs in self.quantizers.items()
            },
            "code_dims": {f: vqs[0].code_dim for f, vqs in self.quantizers.items()},
            "trees": {f: [t.state_dict() for t in trees] for f, trees in self.trees.items()},
        }
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Bundle:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"bundle file not found: {path}")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 - any unpickling failure means a bad file
            raise ConfigError(f"bundle {path} cannot be read: {error}") from error
        if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
            raise ConfigError(f"bundle {path}: not a bundle of format {FORMAT_VERSION}")
        quantizers, trees = {}, {}
        for family, states in state["quantizers"].items():
            quantizers[family] = [
                _quantizer_from_state(s, state["code_dims"][family]) for s in states
            ]
            trees[family] = [
                CodebookTree.from_state_dict(t, vq.codebook)
                for t, vq in zip(state["trees"][family], quantizers[family], strict=True)
            ]
        return cls(
            state["model_name"],
            state["model_fingerprint"],
            state["K"],
            quantizers,
            trees,
            state.get("meta", {}),
        )


def _quantizer_from_state(state: dict[str, Tensor], code_dim: int) -> VectorQuantizer:
    num_codes, _ = state["codebook"].shape
    dim = state["project_in.weight"].shape[1] if "project_in.weight" in state else code_dim
    vq = VectorQuantizer(num_codes, dim, code_dim)
    vq.load_state_dict(state)
    return vq.eval()


@torch.no_grad()
def collect_activations(
    model: VisionTransformer, inputs: Tensor, batch_size: int = 16
) -> dict[str, list[Tensor]]:
    """Rows (n, D) of each block's input X^(b), post-attention residual Z^(b), update Z - X."""
    out: dict[str, list[list[Tensor]]] = {
        k: [[] for _ in model.blocks] for k in ("inputs", "residuals", "updates")
    }
    for chunk in inputs.split(batch_size):
        x = model.embed(chunk)
        for b, block in enumerate(model.blocks):
            q, k, v = block.attn.qkv_heads(block.norm1(x))
            z = x + block.attn.attend(q, k, v)
            for key, value in (("inputs", x), ("residuals", z), ("updates", z - x)):
                out[key][b].append(value.reshape(-1, value.shape[-1]))
            x = block.ffn(z)
    return {key: [torch.cat(rows) for rows in per_block] for key, per_block in out.items()}


def exchange_rows(activations: dict[str, list[Tensor]], kind: str) -> list[Tensor]:
    """What exchange point b quantises for a family kind (`MethodEntry.quantises`): VQ_0
    always sees X^(0)."""
    if kind == "inputs":
        return activations["inputs"]
    return [activations["inputs"][0], *activations[kind][:-1]]


@torch.no_grad()
def fit_quantizer(
    rows: Tensor, K: int, code_dim: int | None, seed: int, iterations: int = 20
) -> VectorQuantizer:
    """k-means codebook of the rows (after a PCA projection to code_dim when given)."""
    dim = rows.shape[1]
    vq = VectorQuantizer(K, dim, code_dim if code_dim and code_dim < dim else None)
    if vq.project_in is not None:
        mean = rows.mean(0)
        _, _, basis = torch.linalg.svd(rows - mean, full_matrices=False)
        top = basis[: vq.code_dim]  # (d_q, D)
        vq.project_in.weight.copy_(top)
        vq.project_in.bias.copy_(-top @ mean)
        vq.project_out.weight.copy_(top.t())
        vq.project_out.bias.copy_(mean)
    codes = vq.project(rows)
    vq.set_codebook(kmeans(codes, K, iterations=iterations, seed=seed))
    counts = torch.bincount(vq.nearest(rows), minlength=K).float()
    vq.ema_counts.copy_(counts)
    vq.ema_sums.copy_(vq.codebook * counts.unsqueeze(1))  # the EMA rule's codebook = sums / counts
    return vq.eval()


@dataclass(frozen=True)
class FitSettings:
    """How `fit_bundle` fits a bundle: `K` codewords per codebook, for `families` (the codebook
    methods to fit; None: every one of the method table), after a PCA projection to
    `code_dim` when given, by `kmeans_iterations` of Lloyd's; trees of `branching` children
    under `metric`; seeded by `seed` (codebook b by seed + b)."""

    K: int
    families: tuple[str, ...] | None = None
    code_dim: int | None = None
    metric: str = "euclidean"
    branching: int = 2
    seed: int = 0
    kmeans_iterations: int = 20


@torch.no_grad()
def fit_bundle(
    model: VisionTransformer,
    inputs: Tensor,
    settings: FitSettings,
    progress: Callable[[int, int], None] | None = None,
) -> Bundle:
    """Codebooks fitted by k-means on the model's own activations over `inputs`, and trees.

    This is how runs with untrained weights get codebooks; training refines them later (the
    accuracy study, `accuracy`, which also uses fewer Lloyd iterations to save time).
    `progress(done, total)` is called after each codebook and its tree.
    """
    K, seed = settings.K, settings.seed
    known = codebook_methods()
    families = tuple(known) if settings.families is None else settings.families
    for family in families:
        if family not in known:
            raise ConfigError(f"unknown codebook family {family!r}; known: {', '.join(known)}")
    activations = collect_activations(model, inputs)
    quantizers: dict[str, list[VectorQuantizer]] = {}
    trees: dict[str, list[CodebookTree]] = {}
    first: tuple[VectorQuantizer, CodebookTree] | None = None
    total, done = len(families) * len(model.blocks), 0
    for family in families:
        quantizers[family], trees[family] = [], []
        kind = METHODS[family].quantises
        for b, rows in enumerate(exchange_rows(activations, kind)):
            if b == 0 and kind != "inputs" and first is not None:
                # the families that code what blocks produce (trace-b and trace-nb) share
                # VQ_0, which quantises X^(0) for them all
                vq, tree = first
            else:
                log.debug("fitting %s codebook %d on %d rows", family, b, len(rows))
                vq = fit_quantizer(rows, K, settings.code_dim, seed + b, settings.kmeans_iterations)
                tree = build_tree(
                    vq.codebook, settings.branching, settings.metric, vq.ema_counts, seed
                )
            quantizers[family].append(vq)
            trees[family].append(tree)
            done += 1
            if progress is not None:
                progress(done, total)
        if kind != "inputs":
            first = quantizers[family][0], trees[family][0]
    meta = {
        "metric": settings.metric,
        "branching": settings.branching,
        "seed": seed,
        "calibration_rows": len(activations["inputs"][0]),
    }
    return Bundle(model.config.name, model_fingerprint(model), K, quantizers, trees, meta)
