"""The files devices load besides the code: codebook bundles, the model checkpoint and the
evaluation inputs, all placed in the run directory (which the devices see).

Bundles: the experiment's own file, or fitted once and cached.

Fitting runs k-means on the model's activations over seeded random inputs (what runs with
untrained weights use), one bundle per codebook size K the methods ask for. The cache key
covers everything that changes the codebooks, so a cached bundle is never stale. torch is
imported only when a bundle must be fitted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from testbed import voice
from testbed.errors import ConfigError
from testbed.experiment.schema import Experiment
from testbed.source import CACHE_DIR
from testbed.sweep.plan import Trial
from tracevq.config import model_config

BUNDLE_CACHE_DIR = CACHE_DIR / "bundles"


@dataclass
class RunFiles:
    bundles: dict[int, Path] = field(default_factory=dict)  # by codebook size K
    checkpoint: Path | None = None
    inputs: Path | None = None  # labelled evaluation inputs
    batches: int | None = None  # inferences that cover the evaluation inputs

    def bundle_for(self, trial: Trial) -> Path | None:
        return self.bundles.get(trial.spec.K) if trial.spec.uses_codebooks else None


def prepare_run_files(experiment: Experiment, trials: list[Trial], run_dir: Path) -> RunFiles:
    files = RunFiles(bundles=prepare_bundles(experiment, trials, run_dir))
    if experiment.model.checkpoint:
        files.checkpoint = prepare_checkpoint(experiment, run_dir)
    if experiment.evaluation is not None:
        files.inputs, files.batches = prepare_inputs(experiment, run_dir)
    return files


def prepare_checkpoint(experiment: Experiment, run_dir: Path) -> Path:
    """The checkpoint read once, in whatever layout it came (timm's, Hugging Face's, a folder,
    its EMA weights), checked against the model, and written for the devices as one
    safetensors file under our names with its activation and epsilon in the metadata."""
    from tracevq.checkpoint import load_checkpoint, save_checkpoint
    from tracevq.errors import CheckpointError
    from tracevq.models import build_model

    model = experiment.model
    source = Path(model.checkpoint or "")
    if not source.exists():
        raise ConfigError(f"model.checkpoint: file not found: {source}")
    try:
        loaded = load_checkpoint(build_model(model.name), source, ema=model.checkpoint_ema)
    except CheckpointError as error:
        raise ConfigError(f"model.checkpoint: {error}") from None
    return save_checkpoint(loaded, run_dir / "checkpoint.safetensors")


def prepare_inputs(experiment: Experiment, run_dir: Path) -> tuple[Path, int]:
    """The evaluation inputs cut to `limit` and to whole batches, as the worker reads them."""
    import torch

    settings = experiment.evaluation
    assert settings is not None
    source = Path(settings.inputs)
    if not source.is_file():
        raise ConfigError(f"evaluation.inputs: file not found: {source}")
    try:
        data = torch.load(source, map_location="cpu", weights_only=True)
        inputs, labels = data["inputs"], data["labels"]
    except Exception as error:  # noqa: BLE001 - any unreadable or malformed file
        raise ConfigError(
            f"evaluation.inputs: {source} is not a {{'inputs', 'labels'}} tensor file ({error})"
        ) from None
    config = model_config(experiment.model.name)
    if not isinstance(inputs, torch.Tensor) or tuple(inputs.shape[1:]) != config.input_shape()[1:]:
        given = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__
        raise ConfigError(
            f"evaluation.inputs: {source} holds inputs of shape {given}; model "
            f"{config.name!r} takes {config.describe_input()}"
        )
    count = min(len(inputs), settings.limit or len(inputs))
    batches = math.floor(count / experiment.batch)
    if batches == 0:
        raise ConfigError(f"evaluation: {count} inputs make no whole batch of {experiment.batch}")
    rows = batches * experiment.batch
    target = run_dir / "evaluation-inputs.pt"
    torch.save({"inputs": inputs[:rows].contiguous(), "labels": labels[:rows].contiguous()}, target)
    return target, batches


def codebook_sizes(trials: list[Trial]) -> list[int]:
    return sorted({t.spec.K for t in trials if t.spec.uses_codebooks})


def codebook_families(trials: list[Trial], K: int) -> tuple[str, ...]:
    """The codebook families (astra, trace-b, trace-nb) the trials with this K use."""
    return tuple(sorted({t.method for t in trials if t.spec.uses_codebooks and t.spec.K == K}))


def bundle_key(experiment: Experiment, K: int, families: tuple[str, ...]) -> str:
    settings = {
        "model": experiment.model.model_dump(),
        "bundle": experiment.bundle.model_dump(exclude={"path", "K"}),
        "K": K,
        "families": families,
        "format": 2,  # 2: tree seeding draws in numpy
    }
    text = json.dumps(settings, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def prepare_bundles(
    experiment: Experiment, trials: list[Trial], run_dir: Path, cache_dir: Path = BUNDLE_CACHE_DIR
) -> dict[int, Path]:
    """Bundle file per K inside the run directory (devices see the run directory)."""
    sizes = codebook_sizes(trials)
    if not sizes:
        return {}
    target_dir = run_dir / "bundles"
    target_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for K in sizes:
        source = _given_or_cached(experiment, K, codebook_families(trials, K), cache_dir)
        target = target_dir / f"bundle-K{K}.pt"
        if not target.exists():
            link_or_copy(source, target, cached=not experiment.bundle.path)
        paths[K] = target
    return paths


def link_or_copy(source: Path, target: Path, cached: bool) -> None:
    """A cached bundle is hard-linked into the run directory, not copied (224 MB for
    ViT-B/16 at K = 1024): the cache replaces its files atomically, so a linked file never
    changes. A file the experiment names is copied (its owner may rewrite it in place), and so
    is a cached one on another file system."""
    if cached:
        try:
            os.link(source, target)
            return
        except OSError:
            pass
    shutil.copyfile(source, target)


def _given_or_cached(
    experiment: Experiment, K: int, families: tuple[str, ...], cache_dir: Path
) -> Path:
    if experiment.bundle.path:
        path = Path(experiment.bundle.path)
        if not path.is_file():
            raise ConfigError(f"bundle.path: file not found: {path}")
        return path
    key = bundle_key(experiment, K, families)
    path = cache_dir / f"{experiment.model.name}-K{K}-{key}.pt"
    if path.is_file():
        voice.say(f"codebooks K={K}: cached ({_shown(path)})")
        return path
    doing = (
        f"fitting for {experiment.model.name} ({', '.join(families)}) on "
        f"{experiment.bundle.calibration_inputs} calibration inputs, once"
    )
    with voice.phase(f"codebooks K={K}", doing) as step:
        fit_and_save(experiment, K, families, path)
        step.outcome = f"fitted, cached in {_shown(path)},"
    return path


def _shown(path: Path) -> str:
    """A path relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def fit_and_save(experiment: Experiment, K: int, families: tuple[str, ...], path: Path) -> Path:
    from tracevq.bundle import FitSettings
    from tracevq.fit import fit_random_calibration

    settings = experiment.bundle
    with tqdm(
        desc=f"codebooks K={K}",
        unit="codebook",
        leave=False,
        disable=None if voice.speaking() else True,
    ) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        fit = FitSettings(
            K, families, code_dim=settings.code_dim, metric=settings.metric, seed=settings.seed
        )
        bundle = fit_random_calibration(
            experiment.model.name,
            fit,
            model_seed=experiment.model.seed,
            checkpoint=experiment.model.checkpoint,
            checkpoint_ema=experiment.model.checkpoint_ema,
            calibration_inputs=settings.calibration_inputs,
            progress=progress,
        )
    return bundle.save(path)
