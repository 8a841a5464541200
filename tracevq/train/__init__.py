"""The old door of the accuracy study, which is the top-level package `accuracy` now:
`python -m tracevq.train STUDY.yaml` runs `python -m accuracy STUDY.yaml`. Nothing else lives
here; the library does not import the study (tests/unit/test_package_layers.py names this
alias as the one deliberate exception)."""
