"""Device 0's compute per inference, in process, methods measured side by side.

All P devices run in lockstep as in `tracevq.simulate`, with the real wire bytes; only device
0's calls are timed (embedding, its blocks, the head). Methods alternate within each round so
that the machine's background load falls on all of them alike; every round's time is kept, so
that methods can be compared round by round.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pandas as pd
import torch
from torch.utils.flop_counter import FlopCounterMode

from testbed.sweep.bundles import BUNDLE_CACHE_DIR
from tracevq.bundle import Bundle, FitSettings, fit_bundle, model_fingerprint
from tracevq.engine import DeviceRun
from tracevq.methods import Method, make_method
from tracevq.models import VisionTransformer

CALIBRATION_SEED = 0  # the inputs the bench's codebooks are fitted on
MEASURED_SEED = 1  # the input that is measured: not one of them (its rows are no codewords)


def measured_input(model: VisionTransformer) -> torch.Tensor:
    """The one input every in-process bench times (batch 1)."""
    generator = torch.Generator().manual_seed(MEASURED_SEED)
    return torch.randn(model.config.input_shape(1), generator=generator)


def _timed(call, *args):
    began = time.perf_counter()
    out = call(*args)
    return out, 1000 * (time.perf_counter() - began)


def _counted(call, *args):
    with FlopCounterMode(display=False) as counter:
        out = call(*args)
    return out, float(counter.get_total_flops())


@torch.no_grad()
def device0_work(
    method: Method, inputs: torch.Tensor, devices: int, measure=_timed, unique_keys=None
) -> float:
    """Device 0's work, summed over its calls: `measure(call, *args)` returns the call's
    output and its amount (ms by default). `unique_keys` (if given) gets its distinct remote
    keys per block."""
    runs = [DeviceRun(method, rank, devices, inputs) for rank in range(devices)]
    inbox: dict[int, dict[int, bytes]] = defaultdict(dict)
    spent = 0.0

    def step(run: DeviceRun, call, *args):
        nonlocal spent
        if run.rank != 0:
            return call(*args)
        out, amount = measure(call, *args)
        spent += amount
        return out

    for block in range(method.model.config.depth):
        for run in runs:
            message = step(run, run.begin_block, block)
            if message is not None:
                inbox[block][run.rank] = message
            step(run, run.project_local, block)
        for run in runs:
            expected = run.exchanges_at(block)
            messages = {peer: inbox[block][peer] for peer in run.peers if expected}
            message = step(run, run.attend, block, messages)
            if message is not None:
                inbox[block + 1][run.rank] = message
        if unique_keys is not None:
            unique_keys.append(runs[0].unique_remote_keys)
        for run in runs:
            step(run, run.finish_block, block)
    step(runs[0], runs[0].logits)
    return spent


def device0_compute_ms(
    method: Method, inputs: torch.Tensor, devices: int, unique_keys: list | None = None
) -> float:
    """Device 0's compute; `unique_keys` (if given) gets its distinct remote keys per block."""
    return device0_work(method, inputs, devices, _timed, unique_keys)


def device0_flops(method: Method, inputs: torch.Tensor, devices: int) -> float:
    """Device 0's floating-point operations as torch's FlopCounterMode counts them (matmuls
    and attention; LayerNorm, GELU, gathers, the codeword search's int8 screen and its argmin
    uncounted)."""
    return device0_work(method, inputs, devices, _counted)


def compare(
    model: VisionTransformer,
    bundle: Bundle | None,
    variants: dict[str, dict],
    devices: int = 2,
    rounds: int = 5,
) -> dict[str, pd.Series]:
    """Device-0 compute (ms) per variant name, one value per round (the index); variants map
    to make_method kwargs."""
    methods = {name: make_method(model=model, bundle=bundle, **kw) for name, kw in variants.items()}
    inputs = measured_input(model)
    times: dict[str, list[float]] = defaultdict(list)
    for method in methods.values():  # warm-up
        device0_compute_ms(method, inputs, devices)
    for _ in range(rounds):
        for name, method in methods.items():
            times[name].append(device0_compute_ms(method, inputs, devices))
    return {name: pd.Series(values, name=name) for name, values in times.items()}


def bundle_for(
    model: VisionTransformer, K: int, calibration: int, families: tuple[str, ...] = ("trace-b",)
) -> Bundle:
    """Codebooks of `families` by k-means on seeded random inputs, cached in .cache/bundles
    (the fit of ViViT-B's takes minutes; the key covers everything that changes it)."""
    kinds = "" if families == ("trace-b",) else "-" + "+".join(families)
    fingerprint = model_fingerprint(model)[:16]
    name = f"bench-{model.config.name}-K{K}-c{calibration}{kinds}-{fingerprint}.pt"
    path = BUNDLE_CACHE_DIR / name
    if path.is_file():
        return Bundle.load(path)
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    inputs = torch.randn(model.config.input_shape(calibration), generator=generator)
    bundle = fit_bundle(model, inputs, FitSettings(K, families=families))
    path.parent.mkdir(parents=True, exist_ok=True)
    bundle.save(path)
    return bundle
