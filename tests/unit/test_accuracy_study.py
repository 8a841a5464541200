"""The study: configuration files, the plan, a tiny run end to end, the CLI, and (slow) the
digits model reaching 90% after brief training."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

import tracevq
from accuracy.__main__ import main
from accuracy.evaluate import simulated_accuracy
from accuracy.loops import accuracy, train_base
from accuracy.report import sampling_half_width, write_report
from accuracy.search import main as search_main
from accuracy.settings import BaseSection, load_settings, parse_settings
from accuracy.study import load_splits, plan, run_study
from tracevq.bundle import Bundle, model_fingerprint
from tracevq.checkpoint import load_checkpoint
from tracevq.errors import ConfigError

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
    control = {"single"} if settings.finetune.tunes else set()  # fine-tuning's control
    assert {j.family for j in jobs} == {*settings.codebooks.families, *control}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "x", "finetun": {}}, r"finetun: unknown key \(did you mean 'finetune'\?\)"),
        ({"name": "x", "base": {"epoch": 3}}, r"base\.epoch: unknown key.*'epochs'"),
        ({"name": "x", "codebooks": {"K": [1]}}, r"codebooks\.K: .*2\.\.65536"),
        ({"name": "x", "model": {"name": "vit-digit"}}, r"model\.name: .*did you mean"),
        ({"name": "x", "data": {"task": "cifar"}}, r"data\.path: required for task 'cifar'"),
        ({"finetune": {}}, r"name: Field required"),
        (
            {"name": "x", "codebooks": {"placements": ["1 C"]}},
            r"placements: unknown placement '1 C'",
        ),
        (
            {"name": "x", "codebooks": {"families": ["astra"], "placements": ["2 A"]}},
            r"codebooks\.placements: '2 A' is a trace-b case, but codebooks\.families",
        ),
        (
            {"name": "x", "codebooks": {"placements": ["1 B"], "remote_ffn_placements": ["1 A.i"]}},
            r"remote_ffn_placements: '1 A\.i' must be a trace-nb case listed in",
        ),
        (
            {"name": "x", "data": {"task": "glyphs", "glyphs": 4}, "model": {"name": "vit-glyphs"}},
            r"data\.glyphs: 4 glyphs make 16 classes, model 'vit-glyphs' has 64",
        ),
        (
            {"name": "x", "finetune": {"steps": 100, "epochs": 1.5}},
            r"finetune: give steps or epochs, not both",
        ),
        ({"name": "x", "finetune": {"distill": {"weight": 2}}}, r"finetune\.distill\.weight: "),
        ({"name": "x", "finetune": {"decay": "norms"}}, r"finetune\.decay: .*'all' or 'matrices'"),
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


def test_a_rule_that_names_its_families_is_tried_for_them_alone():
    settings = parse_settings(
        {
            "name": "x",
            "seeds": [0],
            "codebooks": {"K": [64]},
            "finetune": {
                "K": [64],
                "rules": {
                    "ema": {},
                    "grad": {"update": "gradient"},
                    "own": {"families": ["astra"]},
                },
            },
        }
    )
    _, jobs = plan(settings)
    tuned = {(j.family, j.variant) for j in jobs if j.variant != "kmeans"}
    assert tuned == {
        *((f, "ema") for f in ("astra", "trace-b", "trace-nb", "single")),
        ("trace-b", "grad"),  # finetune.rule_families
        ("astra", "own"),
    }


def test_plan_runs_each_trace_family_at_each_of_its_placements():
    settings = parse_settings(
        {
            "name": "x",
            "seeds": [0, 1],
            "codebooks": {
                "K": [64],
                "families": ["astra", "trace-b", "trace-nb"],
                "placements": ["1 A.i", "1 A.iii", "1 B", "2 A"],
                "remote_ffn_placements": ["1 B"],
                "evaluate_kmeans": False,
            },
            "finetune": {"K": [64]},
        }
    )
    fits, jobs = plan(settings)
    per_seed = {(j.family, j.placement, j.remote_ffn, j.variant) for j in jobs if j.seed == 0}
    assert per_seed == {
        ("astra", None, False, "ema"),
        ("trace-nb", "1 A.i", False, "ema"),
        ("trace-nb", "1 A.iii", False, "ema"),
        ("trace-nb", "1 B", False, "ema"),
        ("trace-nb", "1 B", True, "ema"),
        ("trace-b", "2 A", False, "ema"),
        ("single", None, False, "ema"),
    }
    assert len(jobs) == 2 * 7 and len(fits) == 2  # one fit per seed serves every placement
    directories = {j.directory for j in jobs if j.seed == 0}
    assert "seed0/K64/trace-nb-1B-ffn-ema" in directories
    assert "seed0/K64/trace-nb-1Aiii-ema" in directories


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


def test_sampling_half_width_is_the_binomial_95_percent_interval():
    assert sampling_half_width(90.0, 60000) == pytest.approx(0.240, abs=0.001)
    assert sampling_half_width(85.0, 60000) == pytest.approx(0.286, abs=0.001)
    assert sampling_half_width(97.25, 400) == pytest.approx(1.60, abs=0.1)  # digits' test split


def test_tiny_placement_study_on_glyphs(tmp_path):
    settings = tiny_settings(
        tmp_path,
        data={"task": "glyphs", "train_size": 200, "val_size": 40, "test_size": 300},
        model={"name": "vit-glyphs"},
        codebooks={
            "K": [8],
            "families": ["trace-nb", "trace-b"],
            "placements": ["1 A.i", "1 B", "2 A"],
            "remote_ffn_placements": ["1 A.i"],
            "evaluate_kmeans": False,
            "calibration_images": 32,
            "metrics": ["euclidean"],
        },
        finetune={"K": [8], "steps": 2, "batch_size": 16},
        evaluation={"prism_segments": [3], "all_levels": [], "sweep_kmeans": False},
    )
    rows = run_study(settings, progress=False)
    write_report(rows, settings, settings.run_dir)
    run = settings.run_dir
    table = pd.read_csv(run / "table6_placements.csv")
    assert list(dict.fromkeys(table["case"])) == ["1 A.i", "1 A.i + FFN", "1 B", "2 A"]
    assert (table.groupby("case")["devices"].apply(set) == {2, 3}).all()
    paper = table[(table["case"] == "1 B") & (table["devices"] == 3)]["paper"]
    assert paper.iloc[0] == pytest.approx(89.56)
    # 300 test images: the sampling interval is several points wide
    assert table["sampling_95"].between(0.5, 6).all()
    summary = (run / "summary.md").read_text()
    assert "## Table VI orderings" in summary and "[±" in summary
    assert (run / "fig_placements.png").stat().st_size > 1000
    # the default placement alone feeds the other tables
    methods = pd.read_csv(run / "table3_methods.csv")
    assert set(methods["label"]) >= {"trace-nb (K=8, fine-tuned, ema)"}

    # the saved pair of a placement with the receiver's FFN reproduces its reported accuracy
    directory = run / "seed0" / "K8" / "trace-nb-1Ai-ffn-ema"
    model = load_checkpoint(tracevq.build_model("vit-glyphs"), directory / "model.pth")
    bundle = Bundle.load(directory / "bundle.pt")
    method = tracevq.make_method("trace-nb", model, bundle, K=8, placement="1 A.i", remote_ffn=True)
    measured = simulated_accuracy(model, method, 3, load_splits(settings).test, 500)
    reported = table[(table["case"] == "1 A.i + FFN") & (table["devices"] == 3)]["mean"]
    assert measured == pytest.approx(float(reported.iloc[0]))


def _pool_workers(parent: int) -> list[int]:
    """Pids of the processes whose command line says multiprocessing spawned them for parent."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid")))
        if ppid == parent and b"spawn_main" in command:
            found.append(int(entry.name))
    return found


def test_pool_workers_leave_when_the_study_is_killed(tmp_path):
    study = tmp_path / "long.yaml"
    study.write_text(
        "name: long\nseeds: [0, 1]\njobs: 2\n"
        f"output: {tmp_path}\n"
        "data: {task: digits, test_size: 60, val_size: 40}\nbase: {epochs: 1}\n"
        "codebooks: {K: [8], families: [trace-b], calibration_images: 32, metrics: [euclidean]}\n"
        "finetune: {K: [8], steps: 100000, batch_size: 16}\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "accuracy", str(study), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers := _pool_workers(process.pid)) < 2:
            assert process.poll() is None and time.monotonic() < deadline, "no pool started"
            time.sleep(0.2)
        process.kill()  # SIGKILL: no handler of the parent's runs
        process.wait()
        # A worker starts watching its parent once its initializer runs, after importing torch
        # (seconds on a loaded machine: 5 s was exceeded there). Then it leaves within 0.5 s,
        # where its job alone (100,000 steps) would take minutes.
        deadline = time.monotonic() + 30
        while alive := [p for p in workers if Path(f"/proc/{p}").exists()]:
            assert time.monotonic() < deadline, f"pool workers {alive} outlived the study"
            time.sleep(0.1)
    finally:
        process.kill()
        for pid in workers:  # orphans, if the test failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_cli_reports_bad_files_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbase: {epoch: 2}\n")
    assert main([str(bad)]) == 2
    assert f"error: {bad}: base.epoch: unknown key" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.yaml")]) == 2


def test_the_command_refuses_a_missing_study_in_one_line(tmp_path):
    """`python -m accuracy`, the study's one door, as a user runs it."""
    missing = tmp_path / "missing.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "accuracy", str(missing)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: study file not found: {missing}"


@pytest.mark.slow
def test_digits_model_reaches_90_percent_quickly():
    torch.set_num_threads(1)
    settings = parse_settings({"name": "x"})
    splits = load_splits(settings)
    model = tracevq.build_model("vit-digits", seed=0)
    train_base(model, splits.train, BaseSection(epochs=20), progress=False)
    assert accuracy(model.eval(), splits.test) >= 90.0


@pytest.mark.parametrize("base", [None, {"shift_px": 2, "flip": True}])
def test_a_checkpoint_study_says_when_fine_tuning_augments_by_default(tmp_path, caplog, base):
    """base: is not trained from when model.checkpoint is given, yet its shifts and flips are
    the fine-tuning's augmentation: leaving it out is said in one warning."""
    from accuracy.study import base_model

    checkpoint = tmp_path / "base.pth"
    torch.save(tracevq.build_model("vit-digits").state_dict(), checkpoint)
    data = {
        "name": "given",
        "output": str(tmp_path),
        "data": {"task": "digits", "test_size": 60, "val_size": 40},
        "model": {"name": "vit-digits", "checkpoint": str(checkpoint)},
        "finetune": {"K": [8], "steps": 2},
        **({"base": base} if base else {}),
    }
    settings = parse_settings(data)
    _, reused = base_model(settings, load_splits(settings), progress=False)
    assert reused
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if base:
        assert warned == []
    else:
        assert warned == [
            "given: fine-tuning augments with base:'s defaults (shift_px 1, flip false); "
            "give base: to choose"
        ]


def test_a_search_scores_one_fine_tuning_on_validation_at_every_p(tmp_path, capsys):
    study = tmp_path / "tiny.yaml"
    study.write_text(yaml.safe_dump(tiny_settings(tmp_path).model_dump(mode="json")))
    changes = ["--set", "finetune.epochs=0.02", "--set", "finetune.distill={weight: 0.5}"]
    assert search_main([str(study), "--family", "trace-b", *changes]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["validation"]) == {"2", "3"}  # evaluation.devices
    assert all(0 <= value <= 100 for value in result["validation"].values())
    logged = (tmp_path / "tiny" / "search" / "search.jsonl").read_text().splitlines()
    assert [json.loads(line)["set"] for line in logged] == [changes[1::2]]
    assert search_main([str(study), "--family", "single", "--set", "finetune.steps=1"]) == 0
    assert set(json.loads(capsys.readouterr().out)["validation"]) == {"1"}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--set", "finetune.epochs"], "--set 'finetune.epochs': give key.path=value"),
        (["--set", "finetune.steps=-1"], r"finetune\.steps: "),
        (["--rule", "grad"], "--rule 'grad': the study's rules are ema, gradient"),
    ],
)
def test_a_search_refuses_bad_arguments_in_one_line(tmp_path, capsys, arguments, message):
    study = tmp_path / "tiny.yaml"
    study.write_text(yaml.safe_dump(tiny_settings(tmp_path).model_dump(mode="json")))
    assert search_main([str(study), *arguments]) == 2
    error = capsys.readouterr().err
    assert re.search(message, error) and error.count("\n") == 1, error
