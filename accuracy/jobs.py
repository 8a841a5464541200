"""The two kinds of work in a study, each independent of the others once the base model exists.

- `Fit` (seed, K, d_q): k-means codebooks on the base model's activations for every family
  at once (trace-b and trace-nb share VQ_0), with euclidean trees, saved as
  `seed<s>/K<K>/kmeans[-dq<d>].pt`. With the base model this is a bundle a worker loads.
- `Job` (seed, K, family, variant): the variant is `kmeans` (evaluate the fitted codebooks as
  they are) or a codebook update rule (fine-tune model and codebooks from the fit, then
  rebuild the trees). Saves `model.pth` (timm names, fine-tuned only) and `bundle.pt`
  (euclidean trees; `bundle-<metric>.pt` for the other metrics) in
  `seed<s>/K<K>/<family>-<variant>/`, evaluates, and returns result rows.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass

import torch

from accuracy.data import Splits
from accuracy.evaluate import evaluate_exact, evaluate_family
from accuracy.loops import accuracy, finetune
from accuracy.quantizer import CodebookRule, TrainingCodec
from accuracy.settings import Settings
from tracevq.bundle import Bundle, FitSettings, fit_bundle, model_fingerprint
from tracevq.distributed import ExactCodec, distributed_logits, remote_kv_error
from tracevq.method_table import METHODS
from tracevq.models import VisionTransformer
from tracevq.spec import MethodSpec, method_spec
from tracevq.tree import build_tree
from tracevq.vq import VectorQuantizer


@dataclass(frozen=True)
class Fit:
    seed: int
    K: int
    code_dim: int | None = None

    @property
    def path(self) -> str:
        suffix = "" if self.code_dim is None else f"-dq{self.code_dim}"
        return f"seed{self.seed}/K{self.K}/kmeans{suffix}.pt"


@dataclass(frozen=True)
class Job:
    seed: int
    K: int
    family: str
    variant: str  # "kmeans" or a rule name
    placement: str | None = None  # Trace's Table VI case; None: the family's default
    remote_ffn: bool = False  # trace-nb: the receiver runs the FFN on its copy

    @property
    def directory(self) -> str:
        if not METHODS[self.family].codebooks:  # the control: no K
            return f"seed{self.seed}/{self.family}-{self.variant}"
        slug = (self.placement or "").replace(" ", "").replace(".", "")  # "1 A.ii" -> "1Aii"
        case = (f"-{slug}" if slug else "") + ("-ffn" if self.remote_ffn else "")
        return f"seed{self.seed}/K{self.K}/{self.family}{case}-{self.variant}"

    @property
    def method_params(self) -> dict[str, object]:
        """The placement and receiver FFN as method parameters, where the job sets them."""
        params: dict[str, object] = {} if self.placement is None else {"placement": self.placement}
        return params | ({"remote_ffn": True} if self.remote_ffn else {})

    @property
    def spec(self) -> MethodSpec:
        """The method the job trains and evaluates (at its K when it reads codebooks)."""
        size = {"K": self.K} if METHODS[self.family].codebooks else {}
        return method_spec(self.family, **size, **self.method_params)


def rule_of(settings: Settings, name: str) -> tuple[CodebookRule, int | None]:
    section = settings.finetune.rules[name]
    return CodebookRule(**section.model_dump(exclude={"code_dim", "families"})), section.code_dim


def fit_of(job: Job, settings: Settings) -> Fit:
    code_dim = None if job.variant == "kmeans" else rule_of(settings, job.variant)[1]
    return Fit(job.seed, job.K, code_dim)


def calibration(settings: Settings, splits: Splits) -> torch.Tensor:
    """The training images k-means (and the codebook refresh) read."""
    return splits.train.take(slice(0, settings.codebooks.calibration_images))


def fit_codebooks(
    fit: Fit, settings: Settings, model: VisionTransformer, splits: Splits, families: tuple
) -> Bundle:
    """k-means codebooks of `families` at the fit's K, d_q and seed, as the study sets them."""
    codebooks = settings.codebooks
    fitting = FitSettings(
        fit.K,
        families,
        fit.code_dim,
        metric=codebooks.metrics[0],
        branching=codebooks.branching,
        seed=fit.seed,
        kmeans_iterations=codebooks.kmeans_iterations,
    )
    return fit_bundle(model, calibration(settings, splits), fitting)


def run_fit(
    fit: Fit, settings: Settings, model: VisionTransformer, splits: Splits
) -> dict[str, object]:
    started = time.perf_counter()
    families = tuple(settings.codebooks.families)
    if fit.code_dim is not None:  # only the families that try every rule use d_q
        families = tuple(f for f in families if f in settings.finetune.rule_families)
    bundle = fit_codebooks(fit, settings, model, splits, families)
    bundle.meta.update(task=settings.data.task, study=settings.name)
    bundle.save(settings.run_dir / fit.path)
    return {**asdict(fit), "seconds": time.perf_counter() - started}


def run_job(
    job: Job, settings: Settings, model: VisionTransformer, splits: Splits
) -> tuple[list[dict[str, object]], dict[str, object]]:
    """Evaluate (or fine-tune, then evaluate) one family's codebooks; save what a worker loads.

    Returns the result rows and the job's record (validation accuracy, final training loss,
    relative error of the remote K/V per block on validation images, seconds)."""
    if not job.spec.uses_codebooks:
        return run_control(job, settings, model, splits)
    started = time.perf_counter()
    fitted = Bundle.load(settings.run_dir / fit_of(job, settings).path)
    quantizers = fitted.quantizers[job.family]
    info: dict[str, object] = {}
    default_rule = next(iter(settings.finetune.rules))
    if job.variant == "kmeans":
        metrics = settings.codebooks.metrics[:1]
    else:
        model = copy.deepcopy(model)
        rule, _ = rule_of(settings, job.variant)
        codec = TrainingCodec(quantizers, rule, seed=job.seed)
        losses = finetune(
            model, codec, job.spec, splits.train, settings.finetune, settings.base, job.seed
        )
        info["final_loss"] = sum(losses[-10:]) / max(1, len(losses[-10:]))
        if settings.finetune.refresh:
            info["refreshed"] = refresh(model, codec, job.spec, splits, settings)
        every = job.variant == default_rule and job.family in settings.finetune.metric_families
        metrics = settings.codebooks.metrics if every else settings.codebooks.metrics[:1]
    info["val_accuracy"] = validation_accuracy(model, job.spec, quantizers, splits, settings)
    info["kv_error"] = remote_kv_error(
        model,
        splits.val.take(slice(0, 200)),
        settings.evaluation.devices[0],
        job.spec,
        ExactCodec(quantizers),
    )
    bundles = {
        metric: with_trees(model, job.family, quantizers, metric, settings, fitted.meta)
        for metric in metrics
    }
    directory = settings.run_dir / job.directory
    directory.mkdir(parents=True, exist_ok=True)
    if job.variant != "kmeans":
        torch.save(model.state_dict(), directory / "model.pth")
    for metric, bundle in bundles.items():
        bundle.save(directory / _bundle_name(metric, settings))
    sweep = job.variant == default_rule or (
        job.variant == "kmeans" and settings.evaluation.sweep_kmeans
    )
    rows = evaluate_family(
        model, bundles, job.family, splits.test, settings, sweep, job.method_params
    )
    info.update(asdict(job), seconds=time.perf_counter() - started)
    (directory / "job.json").write_text(json.dumps(info, indent=1))
    for row in rows:
        # the placement the method resolved (a default named), not the job's None
        row.update(asdict(job) | {"placement": row["placement"]}, val_accuracy=info["val_accuracy"])
    return rows, info


def refresh(
    model: VisionTransformer,
    codec: TrainingCodec,
    method: MethodSpec,
    splits: Splits,
    settings: Settings,
) -> int:
    """The codebook refresh on the fine-tuned model (finetune.refresh) over the calibration
    images, in the P-device forward at the first evaluated device count."""
    devices = settings.evaluation.devices[0]

    def forward(images: torch.Tensor) -> torch.Tensor:
        return distributed_logits(model, images, devices, method, codec)

    return codec.refresh(forward, calibration(settings, splits), settings.evaluation.batch_size)


def run_control(
    job: Job, settings: Settings, model: VisionTransformer, splits: Splits
) -> tuple[list[dict[str, object]], dict[str, object]]:
    """The control for fine-tuning: the single-device model trained for the same steps with
    the same optimiser and data, no codebooks (the exact P-device forward, the job's method's
    exact view, is the plain model). Without it, gains of the fine-tuned VQ models could be
    extra training, not VQ adaptation."""
    started = time.perf_counter()
    model = copy.deepcopy(model)
    codec = TrainingCodec([], rule_of(settings, job.variant)[0])
    losses = finetune(
        model, codec, job.spec, splits.train, settings.finetune, settings.base, job.seed
    )
    directory = settings.run_dir / job.directory
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), directory / "model.pth")
    rows = evaluate_exact(model, splits.test, settings)
    info: dict[str, object] = {
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "val_accuracy": accuracy(model, splits.val),
        **asdict(job),
        "seconds": time.perf_counter() - started,
    }
    (directory / "job.json").write_text(json.dumps(info, indent=1))
    for row in rows:
        row.update(seed=job.seed, variant=job.variant, val_accuracy=info["val_accuracy"])
    return rows, info


def _bundle_name(metric: str, settings: Settings) -> str:
    return "bundle.pt" if metric == settings.codebooks.metrics[0] else f"bundle-{metric}.pt"


def validation_accuracy(
    model: VisionTransformer,
    method: MethodSpec,
    quantizers: list[VectorQuantizer],
    splits: Splits,
    settings: Settings,
    devices: int | None = None,
) -> float:
    """Accuracy on the validation split at `devices` (default: the first device count), full
    codebook: the figure for choices (steps, learning rate), so that the test split is never
    tuned on."""
    codec = ExactCodec(quantizers)
    devices = settings.evaluation.devices[0] if devices is None else devices

    def predict(images: torch.Tensor) -> torch.Tensor:
        return distributed_logits(model, images, devices, method, codec)

    return accuracy(predict, splits.val)


def with_trees(
    model: VisionTransformer,
    family: str,
    quantizers: list[VectorQuantizer],
    metric: str,
    settings: Settings,
    meta: dict[str, object],
) -> Bundle:
    """A bundle of one family for `model`, with trees built over its codebooks by `metric`.

    The frequency metric weighs each codeword by its EMA usage count (the k-means count when
    the codebook was not fine-tuned)."""
    branching, seed = settings.codebooks.branching, int(meta.get("seed", 0))
    trees = [build_tree(vq.codebook, branching, metric, vq.ema_counts, seed) for vq in quantizers]
    return Bundle(
        model.config.name,
        model_fingerprint(model),
        quantizers[0].num_codes,
        {family: quantizers},
        {family: trees},
        {**meta, "metric": metric},
    )
