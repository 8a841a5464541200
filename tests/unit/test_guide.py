"""docs/experiment-file.md is generated from the schema and the plug-in tables."""

from __future__ import annotations

from pathlib import Path

from testbed.guide import page

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_experiment_file_guide_is_the_schemas() -> None:
    """What `python -m testbed.guide` makes (regenerate the page when the schema changes)."""
    assert (DOCS / "experiment-file.md").read_text() == page()


def test_every_field_says_what_it_means() -> None:
    """Every field row but a section's (a mapping, described below it) ends with a meaning."""
    rows = [line for line in page().splitlines() if line.startswith("| `")]
    fields = [line for line in rows if line.count("|") == 6 and "mapping (below)" not in line]
    assert len(fields) > 40
    assert [line for line in fields if line.rstrip().endswith("|  |")] == []
