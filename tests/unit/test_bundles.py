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
