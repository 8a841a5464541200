"""The accuracy study: base model, then k-means fits, then one job per (seed, K, family,
variant), every method evaluated through `tracevq.simulate` (the byte-exact path).

Fits and jobs are independent once the base model exists and run in `settings.jobs`
processes with one torch thread each (on a small shared CPU two single-threaded processes beat
one two-threaded process). All fits finish before the jobs start, since a job starts from its
fit's saved codebooks. single, voltage and prism need no codebooks: they are measured once,
on the base model. Seeds vary the k-means initialisation and the fine-tuning (batches,
augmentation, dead-code restarts); the base model and the data splits are fixed, so the
spread is that of the codebooks and fine-tuning, as the issue asks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import tracevq
from accuracy.data import (
    Dataset,
    Splits,
    cifar_splits,
    digit_pairs_splits,
    digits_splits,
    fashion_splits,
    folder_splits,
    glyph_pairs_splits,
)
from accuracy.evaluate import evaluate_baselines
from accuracy.jobs import Fit, Job, fit_of, run_fit, run_job
from accuracy.loops import accuracy, train_base
from accuracy.settings import Settings, dump_settings
from tracevq.checkpoint import load_checkpoint
from tracevq.config import ModelConfig
from tracevq.method_table import METHODS
from tracevq.models import VisionTransformer
from tracevq.placement import PLACEMENTS

log = logging.getLogger(__name__)


def load_splits(settings: Settings) -> Splits:
    """The task's splits, normalised to model inputs: (image - mean) / std."""
    data, config = settings.data, tracevq.model_config(settings.model.name)
    if data.task == "digits":
        splits = digits_splits(config.image_size, data.test_size, data.val_size, data.split_seed)
    elif data.task == "pairs":
        sizes = (data.train_size, data.val_size, data.test_size)
        splits = digit_pairs_splits(config.image_size, *sizes, split_seed=data.split_seed)
    elif data.task == "glyphs":
        sizes = (data.train_size, data.val_size, data.test_size)
        splits = glyph_pairs_splits(config.image_size, data.glyphs, *sizes, data.split_seed)
    elif data.task == "fashion":
        splits = fashion_splits(
            data.path, config.image_size, config.in_chans, data.val_size, data.split_seed
        )
    elif data.task == "cifar":
        splits = cifar_splits(
            data.path, config.image_size, config.in_chans, data.val_size, data.split_seed
        )
    else:
        splits = folder_splits(
            data.path, config.image_size, config.in_chans, split_seed=data.split_seed
        )

    def normalise(part: Dataset) -> Dataset:
        images = (part.images - data.mean) / data.std
        return Dataset(images, part.labels, part.classes, part.size)

    return Splits(normalise(splits.train), normalise(splits.val), normalise(splits.test))


def _base_key(settings: Settings) -> str:
    sections = [settings.data, settings.model, settings.base]
    text = json.dumps([s.model_dump() for s in sections], sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def base_model(
    settings: Settings, splits: Splits, progress: bool = True
) -> tuple[VisionTransformer, bool]:
    """The single-device model and whether it was reused: from model.checkpoint, from an
    earlier run with the same data/model/base settings, or trained now (base/model.pth)."""
    directory = settings.run_dir / "base"
    path, key_file = directory / "model.pth", directory / "key.txt"
    model = tracevq.build_model(settings.model.name, seed=settings.base.seed)
    if settings.model.checkpoint is not None:
        given, base = settings.model, settings.base
        if settings.finetune.tunes and "base" not in settings.model_fields_set:
            log.warning(  # base: is not trained from, but it sets the fine-tuning's augmentation
                "%s: fine-tuning augments with base:'s defaults (shift_px %d, flip %s); "
                "give base: to choose",
                settings.name,
                base.shift_px,
                str(base.flip).lower(),
            )
        return load_checkpoint(model, given.checkpoint, ema=given.checkpoint_ema), True
    key = _base_key(settings)
    if path.is_file() and key_file.is_file() and key_file.read_text() == key:
        log.info("reusing the base model %s", path)
        return load_checkpoint(model, path), True
    started = time.perf_counter()
    losses = train_base(model, splits.train, settings.base, progress)
    model.eval()
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    key_file.write_text(key)
    history = {
        "epoch_loss": losses,
        "seconds": time.perf_counter() - started,
        "val_accuracy": accuracy(model, splits.val),
    }
    (directory / "history.json").write_text(json.dumps(history, indent=1))
    return model, False


def export_test_inputs(test: Dataset, path: Path, max_bytes: int = 256 * 2**20) -> int:
    """The test split as the workers' labelled inputs file ({"inputs", "labels"}, normalised),
    for a testbed experiment's `evaluation.inputs`; at most `max_bytes` of images (the first
    ones). Returns how many images were written."""
    one = test.take(slice(0, 1))
    count = min(len(test), max(1, max_bytes // (one.numel() * one.element_size())))
    inputs = test.take(slice(0, count)).contiguous()
    torch.save({"inputs": inputs, "labels": test.labels[:count].clone()}, path)
    return count


def plan(settings: Settings) -> tuple[list[Fit], list[Job]]:
    """Every fit and job the settings ask for, in a deterministic order. Rules beyond the
    default are tried at the main K (the largest fine-tuned one) only; a Trace family runs at
    each of its placements in `codebooks.placements` (all from one fit). With fine-tuning,
    each seed also fine-tunes the model alone (`single`: the exact method that runs on one
    device), as a control."""
    rules = list(settings.finetune.rules)
    main_K = max(settings.finetune.K, default=0)

    def rule_families(rule: str) -> list[str]:
        named = settings.finetune.rules[rule].families
        return settings.finetune.rule_families if named is None else named

    fits: dict[Fit, None] = {}
    jobs = []
    for seed in settings.seeds:
        for K in settings.codebooks.K:
            tuned = K in settings.finetune.K and settings.finetune.tunes
            for family in settings.codebooks.families:
                variants = ["kmeans"] if settings.codebooks.evaluate_kmeans or not tuned else []
                if tuned:
                    variants.append(rules[0])
                    if K == main_K:
                        variants.extend(r for r in rules[1:] if family in rule_families(r))
                cases: list[tuple[str | None, bool]] = [
                    (p, ffn)
                    for p in settings.codebooks.placements
                    if PLACEMENTS[p].method == family
                    for ffn in (False, True)
                    if not ffn or p in settings.codebooks.remote_ffn_placements
                ]
                jobs.extend(
                    Job(seed, K, family, variant, *case)
                    for case in cases or [(None, False)]
                    for variant in variants
                )
    for job in jobs:
        fits[fit_of(job, settings)] = None
    if main_K and settings.finetune.tunes:  # the control: same training, no codebooks
        control = next(n for n, e in METHODS.items() if e.exact and not e.exchanges)
        jobs.extend(Job(seed, 0, control, rules[0]) for seed in settings.seeds)
    # longest first (fine-tuning at large K), so that no process idles at the end
    jobs.sort(key=lambda j: (j.variant == "kmeans", not METHODS[j.family].codebooks, -j.K))
    return list(fits), jobs


_WORKER: dict[str, Any] = {}


def _exit_with(parent: int, poll_s: float = 0.5) -> None:
    """Leave as soon as `parent` is gone (killed, not only interrupted): a pool worker
    otherwise runs its job to the end, loading a machine that may be measuring by then."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _init_worker(
    settings: Settings, config: ModelConfig, state: dict[str, torch.Tensor], parent: int
) -> None:
    _exit_with(parent)
    torch.set_num_threads(1)
    model = VisionTransformer(config)  # the base model's, its activation and epsilon included
    model.load_state_dict(state)
    _WORKER.update(settings=settings, model=model.eval(), splits=load_splits(settings))


def _fit_in_worker(fit: Fit) -> dict[str, object]:
    return run_fit(fit, _WORKER["settings"], _WORKER["model"], _WORKER["splits"])


def _job_in_worker(job: Job) -> tuple[list[dict[str, object]], dict[str, object]]:
    return run_job(job, _WORKER["settings"], _WORKER["model"], _WORKER["splits"])


def _run_all(
    pool: ProcessPoolExecutor | None,
    work: Callable[[Any], Any],
    local: Callable[[Any], Any],
    items: Sequence[Any],
    bar: tqdm,
) -> list[Any]:
    """Results of every item, in the pool when there is one (finishing order)."""
    results = []
    if pool is None:
        for item in items:
            results.append(local(item))
            bar.update()
        return results
    for future in as_completed([pool.submit(work, item) for item in items]):
        results.append(future.result())
        bar.update()
    return results


def run_study(settings: Settings, progress: bool = True) -> list[dict[str, object]]:
    """Everything the settings ask for; returns the result rows (the report writes them)."""
    started = time.perf_counter()
    torch.set_num_threads(1)
    run_dir = settings.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_settings(settings, run_dir / "settings.yaml")
    splits = load_splits(settings)
    model, reused = base_model(settings, splits, progress)
    base_seconds = time.perf_counter() - started
    export_test_inputs(splits.test, run_dir / "test-inputs.pt")
    rows = evaluate_baselines(model, splits.test, settings)
    fits, jobs = plan(settings)
    bar = tqdm(
        total=len(fits) + len(jobs), desc=f"{settings.name}", unit="job", disable=not progress
    )
    records: list[dict[str, object]] = []
    pool = None
    if settings.jobs > 1:
        state = {k: v.clone() for k, v in model.state_dict().items()}
        pool = ProcessPoolExecutor(
            settings.jobs,
            torch.multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(settings, model.config, state, os.getpid()),
        )
    try:
        fit_info = _run_all(
            pool, _fit_in_worker, lambda f: run_fit(f, settings, model, splits), fits, bar
        )
        for job_rows, record in _run_all(
            pool, _job_in_worker, lambda j: run_job(j, settings, model, splits), jobs, bar
        ):
            rows.extend(job_rows)
            records.append(record)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        bar.close()
    timing = {
        "base_seconds": base_seconds,
        "base_reused": reused,
        "fit_seconds": sum(float(f["seconds"]) for f in fit_info),
        "total_seconds": time.perf_counter() - started,
        "fits": len(fits),
        "jobs": len(jobs),
        "processes": settings.jobs,
        "cpus": os.cpu_count(),
    }
    (run_dir / "timing.json").write_text(json.dumps(timing, indent=1))
    (run_dir / "jobs.json").write_text(json.dumps(records, indent=1))
    return rows
