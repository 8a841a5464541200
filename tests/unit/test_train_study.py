"""The study: configuration files, the plan, a tiny run end to end, the CLI, and (slow) the
digits model reaching 90% after brief training."""

from pathlib import Path

import pandas as pd
import pytest
import torch

import tracevq
from tracevq.bundle import Bundle, model_fingerprint
from tracevq.checkpoint import load_checkpoint
from tracevq.errors import ConfigError
from tracevq.train.__main__ import main
from tracevq.train.evaluate import simulated_accuracy
from tracevq.train.loops import accuracy, train_base
from tracevq.train.report import write_report
from tracevq.train.settings import BaseSection, load_settings, parse_settings
from tracevq.train.study import load_splits, plan, run_study

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_study_configs():
    assert {p.name for p in CONFIGS} >= {"accuracy-digits.yaml", "accuracy-pairs.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_plans(path):
    settings = load_settings(path)
    fits, jobs = plan(settings)
    assert jobs and fits
    assert len(settings.seeds) >= 3
    assert {j.family for j in jobs} == {*settings.codebooks.families, "single"}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "x", "finetun": {}}, r"finetun: unknown key \(did you mean 'finetune'\?\)"),
        ({"name": "x", "base": {"epoch": 3}}, r"base\.epoch: unknown key.*'epochs'"),
        ({"name": "x", "codebooks": {"K": [1]}}, r"codebooks\.K: .*2\.\.65536"),
        ({"name": "x", "model": {"name": "vit-digit"}}, r"model\.name: .*did you mean"),
        ({"name": "x", "data": {"task": "cifar"}}, r"data\.path: required for task 'cifar'"),
        ({"finetune": {}}, r"name: Field required"),
    ],
)
def test_bad_settings_name_the_field_and_source(data, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_settings(data, "study.yaml")
    assert str(error.value).startswith("study.yaml: ")


def test_plan_counts():
    settings = parse_settings(
        {
            "name": "x",
            "seeds": [0, 1],
            "codebooks": {"K": [16, 64, 256]},
            "finetune": {
                "K": [64, 256],
                "rules": {"ema": {}, "grad": {"update": "gradient"}, "dq": {"code_dim": 8}},
            },
        }
    )
    fits, jobs = plan(settings)
    # per seed: 3 k-means jobs per K, 3 default-rule jobs per fine-tuned K, at the main
    # K = 256 two more rules for trace-b, and the control (the model fine-tuned alone)
    assert len(jobs) == 2 * (3 * 3 + 3 * 2 + 2 + 1)
    assert sum(j.family == "single" for j in jobs) == 2
    assert len(fits) == 2 * 4  # each K, and K=256 with d_q


def tiny_settings(tmp_path: Path, **changes):
    data = {
        "name": "tiny",
        "seeds": [0],
        "output": str(tmp_path),
        "data": {"task": "digits", "test_size": 60, "val_size": 40},
        "base": {"epochs": 1},
        "codebooks": {
            "K": [8],
            "families": ["astra", "trace-b"],
            "calibration_images": 32,
            "metrics": ["euclidean", "cosine"],
        },
        "finetune": {
            "K": [8],
            "steps": 2,
            "batch_size": 16,
            "rules": {"ema": {}, "gradient": {"update": "gradient"}},
        },
        "evaluation": {"prism_segments": [3]},
        **changes,
    }
    return parse_settings(data, "tiny")


def test_tiny_study_end_to_end(tmp_path):
    settings = tiny_settings(tmp_path)
    rows = run_study(settings, progress=False)
    write_report(rows, settings, settings.run_dir)
    run = settings.run_dir
    frame = pd.read_csv(run / "results.csv")
    methods = {(m, p) for m, p in zip(frame["method"], frame["devices"], strict=True)}
    assert methods >= {("single", 1), ("voltage", 2), ("prism", 3), ("astra", 2), ("trace-b", 3)}
    assert frame["accuracy"].between(0, 100).all()
    for variant in ("base", "ema"):  # the base model, and the control fine-tuned alone
        exact = frame[frame["variant"] == variant]
        voltage = exact[exact["method"] == "voltage"]["accuracy"]
        assert len(voltage) == 2
        assert (voltage == exact[exact["method"] == "single"]["accuracy"].iloc[0]).all()
    trace = frame[(frame["method"] == "trace-b") & (frame["variant"] == "ema")]
    assert set(trace["level_k"]) == {2, 4, 8} and set(trace["metric"]) == {"euclidean", "cosine"}
    tables = ("table3_methods", "table7_levels", "table8_rules", "table_codebook_sizes")
    for name in (*tables, "table_kv_error"):
        assert not pd.read_csv(run / f"{name}.csv").empty, name
    for name in ("fig_methods", "fig_levels", "fig_rules", "fig_codebook_sizes"):
        assert (run / f"{name}.png").stat().st_size > 1000
    assert "± " in (run / "summary.md").read_text()
    assert (run / "settings.yaml").is_file() and (run / "timing.json").is_file()

    # the saved pair is what a worker loads, and reproduces the reported accuracy
    directory = run / "seed0" / "K8" / "trace-b-ema"
    model = load_checkpoint(tracevq.build_model("vit-digits"), directory / "model.pth")
    bundle = Bundle.load(directory / "bundle.pt")
    assert bundle.model_fingerprint == model_fingerprint(model)
    method = tracevq.make_method("trace-b", model, bundle, K=8)
    reported = trace[(trace["devices"] == 2) & trace["finest"] & (trace["metric"] == "euclidean")]
    measured = simulated_accuracy(model, method, 2, load_splits(settings).test, 500)
    assert measured == pytest.approx(float(reported["accuracy"].iloc[0]))
    exported = torch.load(run / "test-inputs.pt", weights_only=True)
    assert torch.equal(exported["labels"], load_splits(settings).test.labels)
    assert accuracy(model, load_splits(settings).test) == pytest.approx(
        100.0 * float((model(exported["inputs"]).argmax(1) == exported["labels"]).float().mean())
    )
    kmeans = Bundle.load(run / "seed0" / "K8" / "kmeans.pt")
    base = load_checkpoint(tracevq.build_model("vit-digits"), run / "base" / "model.pth")
    assert kmeans.model_fingerprint == model_fingerprint(base)
    assert set(kmeans.quantizers) == {"astra", "trace-b"}

    # a second run reuses the base model
    again = tiny_settings(tmp_path, codebooks={"K": [4], "families": ["astra"]}, finetune={"K": []})
    run_study(again, progress=False)
    assert '"base_reused": true' in (run / "timing.json").read_text()


def test_cli_reports_bad_files_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbase: {epoch: 2}\n")
    assert main([str(bad)]) == 2
    assert f"error: {bad}: base.epoch: unknown key" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.slow
def test_digits_model_reaches_90_percent_quickly():
    torch.set_num_threads(1)
    settings = parse_settings({"name": "x"})
    splits = load_splits(settings)
    model = tracevq.build_model("vit-digits", seed=0)
    train_base(model, splits.train, BaseSection(epochs=20), progress=False)
    assert accuracy(model.eval(), splits.test) >= 90.0
