"""`python -m accuracy.search STUDY.yaml --family trace-b --set finetune.epochs=3 ...`: one
fine-tuning at the study's main K, scored on the validation split only.

The recipe of a study is chosen with this (docs/accuracy.md, Choosing the recipe): the study's
settings with `--set` overrides (dotted keys, YAML values), the base model the study trains or
reuses, a k-means fit of `--seed` at the largest K of `finetune.K` (the main one), one
fine-tuning of `--family` (`single`: the control, the model alone) by the first rule (or
`--rule`), then top-1 on the validation split at every P of `evaluation.devices`. The test
split is never read. Each result is printed and appended, with its settings, to
`<run_dir>/search/search.jsonl`.

Exit codes: 0 done, 2 bad configuration or data.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from accuracy.jobs import Fit, Job, fit_codebooks, refresh, rule_of, validation_accuracy
from accuracy.loops import accuracy, finetune
from accuracy.quantizer import TrainingCodec
from accuracy.settings import Settings, parse_settings
from accuracy.study import base_model, load_splits
from tracevq.errors import ConfigError, TraceError


def with_overrides(path: Path, assignments: list[str]) -> Settings:
    """The study file with each `key.path=value` set (the value read as YAML)."""
    if not path.is_file():
        raise ConfigError(f"study file not found: {path}")
    data = yaml.safe_load(path.read_text())
    for assignment in assignments:
        key, equals, value = assignment.partition("=")
        if not equals or not key:
            raise ConfigError(f"--set {assignment!r}: give key.path=value")
        *parents, last = key.split(".")
        section = data
        for name in parents:
            section = section.setdefault(name, {})
        section[last] = yaml.safe_load(value)
        if key == "finetune.epochs":  # epochs replace the file's steps
            data["finetune"].pop("steps", None)
    return parse_settings(data, str(path))


def search(settings: Settings, family: str, seed: int, rule: str | None) -> dict[str, Any]:
    """One fine-tuning of `family` and its validation accuracy per device count."""
    rule = rule or next(iter(settings.finetune.rules))
    if rule not in settings.finetune.rules:
        raise ConfigError(
            f"--rule {rule!r}: the study's rules are {', '.join(settings.finetune.rules)}"
        )
    started = time.perf_counter()
    torch.set_num_threads(1)
    splits = load_splits(settings)
    model, _ = base_model(settings, splits, progress=False)
    K = max(settings.finetune.K or settings.codebooks.K)
    job = Job(seed, K, family, rule)
    tuned = copy.deepcopy(model)
    codebook_rule, code_dim = rule_of(settings, rule)
    if not job.spec.uses_codebooks:
        codec = TrainingCodec([], codebook_rule)
        finetune(tuned, codec, job.spec, splits.train, settings.finetune, settings.base, seed)
        validation = {1: accuracy(tuned, splits.val)}
    else:
        fitted = fit_codebooks(Fit(seed, K, code_dim), settings, model, splits, (family,))
        quantizers = fitted.quantizers[family]
        codec = TrainingCodec(quantizers, codebook_rule, seed=seed)
        finetune(tuned, codec, job.spec, splits.train, settings.finetune, settings.base, seed)
        if settings.finetune.refresh:
            refresh(tuned, codec, job.spec, splits, settings)
        validation = {
            p: validation_accuracy(tuned, job.spec, quantizers, splits, settings, p)
            for p in settings.evaluation.devices
        }
    return {
        "family": family,
        "rule": rule,
        "seed": seed,
        "validation": validation,
        "base_validation": accuracy(model, splits.val),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accuracy.search", description=__doc__)
    parser.add_argument("study", type=Path, help="study YAML file (configs/)")
    parser.add_argument("--family", default="trace-b", help="a codebook method, or single")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rule", help="a rule of finetune.rules (default: the first)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        settings = with_overrides(args.study, args.set)
        result = {"set": args.set, **search(settings, args.family, args.seed, args.rule)}
    except TraceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    line = json.dumps(result)
    print(line)
    log = settings.run_dir / "search" / "search.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
