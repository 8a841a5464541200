# Set-up, tests, lint and the worker image of the Trace edge testbed.
#
#   make test         create .venv (once per pyproject.toml change) and run pytest
#   make lint         ruff check + ruff format --check
#   make image        build trace-testbed/worker:latest without any registry
#   make docker-up    start the Docker engine if it is not answering (needs root)
#   make clean        remove the venv and Python caches (keeps .cache/: base rootfs, wheelhouse)
#   make distclean    clean, and remove .cache/ too
#
# Variables: PYTHON (interpreter that creates the venv), PYTEST_ARGS, IMAGE_ARGS
# (e.g. IMAGE_ARGS='--base debian:bookworm --pull' to use, and pull, a remote base).

PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
IMAGE_ARGS ?=

.DEFAULT_GOAL := test
.PHONY: venv test lint image docker-up clean distclean

venv: $(VENV_STAMP)

# Re-installs only when pyproject.toml is newer than the stamp.
$(VENV_STAMP): pyproject.toml
	test -x $(VENV_PY) || $(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install -e '.[dev]'
	touch $@

test: venv
	$(VENV_PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

image: venv
	$(VENV_PY) -m testbed.image build $(IMAGE_ARGS)

# Stdlib only, so it works before the venv exists.
docker-up:
	$(PYTHON) -m testbed.dockerd up

# ---------------------------------------------------------------------------
# Experiment targets (sweep-bandwidth, bench, accuracy, reproduce) belong here.
# They are added by the experiment and benchmark code, not by this set-up part.
# ---------------------------------------------------------------------------

# ---------------------------------------------------------------------------
# Cleaning
# ---------------------------------------------------------------------------
clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf .cache
