"""make test's two passes (scripts/run-tests): what runs alone, and that the split loses none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import alone  # tests/conftest.py, which pytest has loaded as `conftest`

ROOT = Path(__file__).resolve().parents[2]


def test_integration_tests_and_the_timed_unit_tests_run_alone() -> None:
    assert alone("tests/integration/test_fleet.py::test_a_leave_ends_the_session")
    assert alone("tests/unit/test_probe.py::test_anything[kernel]")
    assert alone("tests/unit/test_codec.py::test_pack_is_fast")
    assert alone("tests/unit/test_virtual_time.py::test_x")


def test_integration_tests_that_time_nothing_run_side_by_side() -> None:
    assert not alone("tests/integration/test_faults.py::test_two_runs_at_once_share_nothing")
    assert not alone("tests/integration/test_image.py::test_container_runs_pinned_torch")
    run = "tests/integration/test_run.py::"
    assert not alone(run + "test_interrupt_removes_devices_and_keeps_finished_trials")
    assert alone(run + "test_reproduce_quick_on_docker")
    assert alone("tests/integration/test_clean_netns.py::test_clean_leaves_a_live_run_alone")


def test_other_unit_tests_run_side_by_side_and_a_name_is_not_a_prefix() -> None:
    assert not alone("tests/unit/test_codec.py::test_pack_rejects_bad_width[0]")
    assert not alone("tests/unit/test_codec.py::test_pack_is_fast_too")
    assert not alone("tests/unit/test_probe_plan.py::test_y")
    assert not alone("tests/unit/test_schema.py::test_z")


def collected(marker: str) -> set[str]:
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + ["-m", marker, "tests/unit/test_codec.py", "tests/integration/test_image.py"]
        + ["tests/integration/test_fleet.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return {line for line in listing.stdout.splitlines() if "::" in line}


def test_the_two_passes_select_every_test_once() -> None:
    together, apart = collected("not alone"), collected("alone")
    every = collected("alone or not alone")
    assert together and apart and not together & apart
    assert together | apart == every
    assert "tests/unit/test_codec.py::test_pack_is_fast" in apart
    assert all(
        name.startswith("tests/integration/test_fleet.py")
        for name in apart - {"tests/unit/test_codec.py::test_pack_is_fast"}
    )
    assert any(name.startswith("tests/integration/test_image.py") for name in together)
