"""Top-1 accuracy of every method through `tracevq.simulate`: the same bytes the network
workers would exchange, so these figures are the deployed accuracy, not a training proxy.

One row per (method, devices, K, tree level, tree metric). Trace methods are evaluated at every
level of the codebook tree (the level changes nothing but the encoder's search set: see
docs/method.md, Codebook tree and levels), with each hierarchy metric for the families of
`finetune.metric_families` (trace-b: Table VII);
the finest level is the full codebook and does not depend on the metric. Each row also carries
the payload bits one device (device 0) sends per layer for one image, to set accuracy against
communication.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

import tracevq
from accuracy.data import Dataset
from accuracy.loops import accuracy
from accuracy.settings import Settings
from tracevq.bundle import Bundle
from tracevq.method_table import METHODS, exact_methods, methods_accepting
from tracevq.methods import Method, make_method
from tracevq.models import VisionTransformer
from tracevq.partition import partition_sizes


def simulated_accuracy(
    model: VisionTransformer, method: Method, devices: int, test: Dataset, batch_size: int
) -> float:
    def predict(images: torch.Tensor) -> torch.Tensor:
        return tracevq.simulate(model, images, method, devices).logits

    return accuracy(predict, test, batch_size)


def _with_count(rows: list[dict[str, object]], test: Dataset) -> list[dict[str, object]]:
    for row in rows:
        row["test_images"] = len(test)
    return rows


def _row(method: Method, devices: int, value: float, **extra: object) -> dict[str, object]:
    tokens = partition_sizes(method.model.config.tokens, devices)[0]
    bits = method.payload_bits(tokens, 1) if devices > 1 and method.spec.exchanges else 0
    return {
        "method": method.name,
        "devices": devices,
        "accuracy": value,
        "payload_bits": bits,
        **extra,
    }


def evaluate_exact(
    model: VisionTransformer, test: Dataset, settings: Settings
) -> list[dict[str, object]]:
    """The methods without any loss of precision: single (P = 1) and voltage (each P)."""
    size = settings.evaluation.batch_size
    rows = []
    for name in exact_methods():
        method = make_method(name, model)
        counts = settings.evaluation.devices if METHODS[name].exchanges else [1]
        for devices in counts:
            value = simulated_accuracy(model, method, devices, test, size)
            rows.append(_row(method, devices, value))
    return _with_count(rows, test)


def evaluate_baselines(
    model: VisionTransformer, test: Dataset, settings: Settings
) -> list[dict[str, object]]:
    """single, voltage and the methods with segments, prism (each segment size of
    `evaluation.prism_segments`), on the base model."""
    evaluation, size = settings.evaluation, settings.evaluation.batch_size
    rows = evaluate_exact(model, test, settings)
    for devices in evaluation.devices:
        for name in methods_accepting("segment"):
            for segment in evaluation.prism_segments:
                method = make_method(name, model, segment=segment)
                value = simulated_accuracy(model, method, devices, test, size)
                rows.append(_row(method, devices, value, segment=segment))
    for row in rows:
        row.update(variant="base", seed=-1)
    return _with_count(rows, test)


def evaluate_family(
    model: VisionTransformer,
    bundles: dict[str, Bundle],
    family: str,
    test: Dataset,
    settings: Settings,
    all_levels: bool = True,
    params: dict[str, object] | None = None,
) -> list[dict[str, object]]:
    """A codebook family with each given metric's bundle, at each device count and tree level.

    Args:
        bundles: metric -> bundle holding `family`'s codebooks and trees.
        all_levels: every tree level for the families in `evaluation.all_levels` (else, and
            always for astra, the finest level only).
        params: further method parameters (a Trace placement).
    """
    evaluation = settings.evaluation
    rows = []
    for metric, bundle in bundles.items():
        method = make_method(family, model, bundle, K=bundle.K, **(params or {}))
        case = method.spec.resolved_placement
        placement = None if case is None else case.name
        tree = bundle.trees[family][0]
        sweep = all_levels and family in evaluation.all_levels
        levels: Iterable[int] = range(tree.num_levels) if sweep else [tree.finest]
        for devices in evaluation.devices:
            for level in levels:
                if method.spec.is_trace:  # a method with levels encodes at this one
                    method.set_level(level)
                value = simulated_accuracy(model, method, devices, test, evaluation.batch_size)
                extra = {
                    "level": level,
                    "level_k": tree.level_sizes[level],
                    "metric": metric,
                    "placement": placement,
                    "remote_ffn": method.spec.remote_ffn,
                }
                rows.append(
                    _row(method, devices, value, K=bundle.K, finest=level == tree.finest, **extra)
                )
    return _with_count(rows, test)
