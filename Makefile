# Set-up, tests, lint and the worker image of the Trace edge testbed.
#
#   make sweep-bandwidth  the main job: every method on ViT-B/16 over 1-20 Mbit/s links
#   make sweep-delay, sweep-loss  every method at 10 Mbit/s over delayed and lossy links
#   make sweep-paper  Table IV on the paper's 2-core devices, P = 2 and 3, in virtual time
#   make sweep-paper-buffers  Table V (ViViT-B, K/V buffers) on paper devices, P = 2 to 10
#   make sweep-paper-p10  every method on ten paper devices (and two, to calibrate)
#   make sweep-straggler  every method with one slow device, even and by-speed partitions
#   make sweep-cell   every method on one shared 20 Mbit/s cell against a line per device
#   make sweep-edge   every method over the shipped Wi-Fi and LTE profiles
#   make smoke        the same pipeline on a tiny model in seconds
#   make trace-replay Trace-b with fixed and live (level_k auto) levels over a 20-1-20 Mbit/s trace
#   make trace-replay-digits  the same with the accuracy study's vit-digits, and the accuracy
#                     of the levels used (runs the digits study first if its results are missing)
#   make accuracy     the accuracy study (digits, digit pairs); accuracy-placements: Table VI
#   make accuracy-fashion  the study on Fashion-MNIST (Debian's package; Tables III, VI, VII
#                     and Fig. 9), real images nobody here made
#   make test         create .venv with the dev tools (once per pyproject.toml change), run pytest
#                     in two passes (scripts/run-tests): what runs alone, then side by side
#   make lint         ruff check + ruff format --check
#   make image        build trace-testbed/worker:latest without any registry
#   make docker-up    start the Docker engine if it is not answering (needs root)
#   make clean        remove the venv and Python caches (keeps .cache/: base rootfs, wheelhouse)
#   make distclean    clean, and remove .cache/ too
#
# Variables: PYTHON (interpreter that creates the venv), PYTEST_ARGS, TEST_JOBS (make test's
# second pass: processes side by side), IMAGE_ARGS
# (e.g. IMAGE_ARGS='--mirror http://deb.debian.org/debian' on a host that is not Debian or
# Ubuntu; '--base IMAGE --pull' to use, and pull, a remote base with python3 3.11+ on glibc).

PYTHON ?= python3
VENV := .venv
VENV_PY := $(VENV)/bin/python
VENV_STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PYTEST_ARGS ?=
TEST_JOBS ?= 2
IMAGE_ARGS ?=

.DEFAULT_GOAL := test
.PHONY: venv dev-venv test lint image docker-up clean distclean host-setup sweep-bandwidth smoke \
	sweep-delay sweep-loss sweep-edge sweep-straggler sweep-cell sweep-paper sweep-paper-buffers sweep-paper-p10 \
	reproduce reproduce-quick bench trace-replay trace-replay-digits

venv: $(VENV_STAMP)
dev-venv: $(DEV_STAMP)

# The runtime venv (the testbed and its notebook) for the experiments; the dev venv adds the
# test, lint and training tools. Each re-installs only when pyproject.toml is newer than its
# stamp, and says how long it took.
$(VENV_STAMP): pyproject.toml
	@echo "venv: installing the project with torch 2.13.0 (CPU) into $(VENV) ..."
	@start=$$(date +%s); \
	  { test -x $(VENV_PY) || $(PYTHON) -m venv $(VENV); } && \
	  $(VENV_PY) -m pip install -q -e '.[testbed]' && \
	  echo "venv: ready in $$(( $$(date +%s) - start )) s"
	touch $@

$(DEV_STAMP): $(VENV_STAMP)
	@echo "venv: adding the test, lint and training tools ..."
	@start=$$(date +%s); $(VENV_PY) -m pip install -q -e '.[dev]' && \
	  echo "venv: dev tools ready in $$(( $$(date +%s) - start )) s"
	touch $@

test: dev-venv
	scripts/host-setup --for-tests
	VENV_PY=$(VENV_PY) TEST_JOBS=$(TEST_JOBS) scripts/run-tests $(PYTEST_ARGS)

lint: dev-venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

image: venv
	$(VENV_PY) -m testbed.backends.docker.image build $(IMAGE_ARGS)

# Stdlib only, so it works before the venv exists.
docker-up:
	$(PYTHON) -m testbed.backends.docker.engine up

# ---------------------------------------------------------------------------
# Experiments. RUN_ARGS go to testbed.run (e.g. RUN_ARGS='--backend local --out /tmp/r').
# host-setup installs Docker, debootstrap and iproute2 when missing and starts the engine
# (root only; without root it changes nothing). testbed.run builds or refreshes the worker
# image itself, and takes the local backend when no Docker engine answers.
# ---------------------------------------------------------------------------
RUN_ARGS ?=

host-setup:
	scripts/host-setup

sweep-bandwidth: venv host-setup
	$(VENV_PY) -m testbed.run experiments/sweep-bandwidth.yaml $(RUN_ARGS)

trace-replay: venv host-setup
	$(VENV_PY) -m testbed.run experiments/trace-replay.yaml $(RUN_ARGS)

# Every method over delayed (0-50 ms) and lossy (0-5%, bursty) links at 10 Mbit/s.
sweep-delay: venv host-setup
	$(VENV_PY) -m testbed.run experiments/sweep-delay.yaml $(RUN_ARGS)

sweep-loss: venv host-setup
	$(VENV_PY) -m testbed.run experiments/sweep-loss.yaml $(RUN_ARGS)

# One slow device among its peers (1-0.33 of their speed; even and by-speed partitions), then a
# straggler that appears mid-session (docs/devices.md).
sweep-cell: venv host-setup
	$(VENV_PY) -m testbed.run experiments/sweep-cell.yaml $(RUN_ARGS)

# Table IV on the paper's 2-core devices (faster than this host's cores: virtual time).
sweep-paper: venv host-setup
	$(VENV_PY) -m testbed.run experiments/sweep-paper.yaml $(RUN_ARGS)
	$(VENV_PY) -m testbed.report --paper-devices results/sweep-paper --out results/sweep-paper/TABLE-IV.md

sweep-paper-p10: venv host-setup
	$(VENV_PY) -m testbed.run experiments/sweep-paper-p10.yaml $(RUN_ARGS)
	$(VENV_PY) -m testbed.report --paper-devices results/sweep-paper-p10 --out results/sweep-paper-p10/TABLE-IV.md

sweep-paper-buffers: venv host-setup
	$(VENV_PY) -m testbed.run experiments/sweep-paper-buffers.yaml $(RUN_ARGS)
	$(VENV_PY) -m testbed.report --paper-devices results/sweep-paper-buffers --out results/sweep-paper-buffers/TABLE-V.md

sweep-straggler: venv host-setup
	$(VENV_PY) -m testbed.run experiments/sweep-straggler.yaml $(RUN_ARGS)
	$(VENV_PY) -m testbed.run experiments/straggler-event.yaml $(RUN_ARGS)

# Every method over the shipped Wi-Fi and LTE link profiles (netem_profiles/wifi.yaml, lte.yaml).
sweep-edge: venv host-setup
	$(VENV_PY) -m testbed.run experiments/edge-wifi.yaml $(RUN_ARGS)
	$(VENV_PY) -m testbed.run experiments/edge-lte.yaml $(RUN_ARGS)

# The study's fine-tuned Trace-b K=64 (seed 0) and its per-level accuracy, from the digits
# study of `make accuracy` (results.csv is written last, after every model and bundle).
DIGITS_STUDY := results/accuracy/digits/results.csv
$(DIGITS_STUDY): configs/accuracy-digits.yaml | $(DEV_STAMP)
	$(VENV_PY) -m accuracy configs/accuracy-digits.yaml $(ACCURACY_ARGS)

trace-replay-digits: venv host-setup $(DIGITS_STUDY)
	$(VENV_PY) -m testbed.run experiments/trace-replay-digits.yaml $(RUN_ARGS)

smoke: venv host-setup
	$(VENV_PY) -m testbed.run experiments/smoke.yaml $(RUN_ARGS)

# The paper's latency tables re-measured, next to its numbers: results/reproduce/REPORT.md.
reproduce: venv host-setup
	$(VENV_PY) -m testbed.reproduce

reproduce-quick: venv host-setup
	$(VENV_PY) -m testbed.reproduce --quick

# Speed targets as ratios measured side by side in one run (BENCH_ARGS='--quick' to check it runs).
BENCH_ARGS ?=
bench: venv host-setup
	$(VENV_PY) -m bench.bench_trace $(BENCH_ARGS)

# 10,000 inferences through the serial emulator on docker: the workers' and the emulator's
# memory and file descriptors at the start and the end (bench/soak.py; about 2 minutes).
SOAK_ARGS ?=
.PHONY: soak
soak: venv host-setup
	$(VENV_PY) -m bench.soak $(SOAK_ARGS)

# Accuracy study (issue 6): base model, VQ fine-tuning, codebook trees, every method through
# tracevq.simulate; CSV tables, figures and model + bundle pairs in results/accuracy/<task>/.
# A base model trained earlier with the same settings is reused (delete base/ to retrain).
ACCURACY_CONFIGS ?= configs/accuracy-digits.yaml configs/accuracy-pairs.yaml
ACCURACY_ARGS ?=
.PHONY: accuracy accuracy-placements accuracy-fashion
accuracy: dev-venv
	$(VENV_PY) -m accuracy $(ACCURACY_CONFIGS) $(ACCURACY_ARGS)

# The Table VI ablation: Trace at each VQ placement on glyph pairs (results/accuracy/placements/).
accuracy-placements: dev-venv
	$(VENV_PY) -m accuracy configs/accuracy-placements.yaml $(ACCURACY_ARGS)

# The study on Fashion-MNIST, read from Debian's dataset-fashion-mnist (installed here, as
# root): Tables III (both Astras) and VII at P = 2, 3, then Fig. 9 (P = 2-10 at K = 1024) and
# Table VI (placements at K = 1024) on the same base model (results/accuracy/fashion/,
# fashion-devices/ and fashion-placements/). `python -m accuracy.search` chooses a recipe on
# the validation split (docs/accuracy.md, Choosing the recipe).
FASHION_CONFIGS = configs/accuracy-fashion.yaml configs/accuracy-fashion-devices.yaml \
	configs/accuracy-fashion-placements.yaml
accuracy-fashion: dev-venv
	scripts/host-setup --for-fashion
	$(VENV_PY) -m accuracy $(FASHION_CONFIGS) $(ACCURACY_ARGS)

# ---------------------------------------------------------------------------
# Cleaning
# ---------------------------------------------------------------------------
clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf .cache
