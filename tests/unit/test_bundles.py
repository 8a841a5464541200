"""Codebook bundles of a run: fitted once into the cache, linked (not copied) into each run."""

import os

from testbed.experiment.schema import load_experiment
from testbed.sweep.bundles import prepare_bundles
from testbed.sweep.plan import plan_trials


def test_a_cached_bundle_is_fitted_once_and_linked_into_every_run(tmp_path):
    experiment = load_experiment("experiments/smoke.yaml")
    trials = plan_trials(experiment)
    cache = tmp_path / "cache"
    first = prepare_bundles(experiment, trials, tmp_path / "run1", cache_dir=cache)
    (cached,) = cache.iterdir()
    fitted = cached.stat()
    second = prepare_bundles(experiment, trials, tmp_path / "run2", cache_dir=cache)
    assert cached.stat().st_mtime_ns == fitted.st_mtime_ns  # not fitted again
    assert list(first) == list(second) == [64]
    for paths in (first, second):
        assert os.path.samefile(paths[64], cached)
    assert cached.stat().st_nlink == 3


def test_evaluation_inputs_of_another_layout_are_refused_before_the_run(tmp_path):
    import pytest
    import torch

    from testbed.errors import ConfigError
    from testbed.experiment.schema import parse_experiment
    from testbed.sweep.bundles import prepare_inputs

    path = tmp_path / "inputs.pt"
    torch.save(
        {"inputs": torch.zeros(4, 32, 32, 3), "labels": torch.zeros(4, dtype=torch.long)}, path
    )
    experiment = parse_experiment(
        {
            "name": "x",
            "model": {"name": "vit-tiny"},
            "methods": [{"name": "voltage"}],
            "evaluation": {"inputs": str(path)},
        }
    )
    with pytest.raises(ConfigError) as caught:
        prepare_inputs(experiment, tmp_path)
    assert str(caught.value) == (
        f"evaluation.inputs: {path} holds inputs of shape (4, 32, 32, 3); model 'vit-tiny' "
        "takes (B, 3, 32, 32), i.e. (batch, C, H, W), channels first"
    )
