# Kimi-Linear gating suite. `make gate-a gate-b` is the main job; `make test` the tests.
# Python: if the machine's python3 already has the stack (the H200 image: torch, triton, transformers,
# pandas, pytest, ...) it is used as it is, with no install and no network. Otherwise a virtualenv in
# .venv is made on first use (torch 2.13.0 from pip: the CPU build where pip is pointed at one, as on the dev
# and CI machines; then the project with test extras).
SHELL := /bin/bash
VENV ?= .venv
SYS_READY := $(shell python3 -c "import torch, triton, safetensors, pandas, matplotlib, scipy, pytest, hypothesis, transformers, tiktoken" >/dev/null 2>&1 && echo yes)
ifeq ($(SYS_READY),yes)
  PY := python3
  SETUP :=
else
  PY := $(VENV)/bin/python
  SETUP := $(VENV)/.installed
endif
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
export PYTHONUNBUFFERED := 1

# Gate/benchmark knobs (empty = the CLI's own default: the gates on a CPU gate the reference checkpoint, on a GPU
# 48b-a3b over as few GPUs as hold it, else they refuse; the benchmarks run 48b-a3b on a GPU and need one, except
# QUICK=1: the smoke run on the tiny preset, on a CPU).
PRESET ?=
MODEL ?=
DTYPE ?=
EXPERT_DTYPE ?=
DEVICE ?=
NEW_TOKENS ?=
FLOOR_GIB ?=
SOURCE ?= hf
GOLDEN ?=
SEED ?=
KERNELS ?=
QUICK ?=
GATE_FLAGS = $(if $(PRESET),--preset $(PRESET)) $(if $(MODEL),--model $(MODEL)) $(if $(DTYPE),--dtype $(DTYPE)) \
  $(if $(EXPERT_DTYPE),--expert-dtype $(EXPERT_DTYPE)) \
  $(if $(DEVICE),--device $(DEVICE)) $(if $(NEW_TOKENS),--new-tokens $(NEW_TOKENS)) \
  $(if $(FLOOR_GIB),--floor-gib $(FLOOR_GIB)) $(if $(SEED),--seed $(SEED)) $(if $(KERNELS),--kernels $(KERNELS)) \
  $(if $(WORLD),--world $(WORLD))

.PHONY: setup test test-slow test-gpu gate-a gate-b gate-memory golden bench bench-kernels decompose report nightly \
  train-reference clean

setup: $(SETUP)

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

# The CPU tests on any box: the GPU hidden, so that tests/conftest.py runs the Triton kernels through Triton's
# interpreter as on CI (on a GPU box they would otherwise be compiled, and these tests hold interpreter-run kernels
# to their bits and hand them CPU tensors). The GPU tests: test-gpu.
# TESTS: the files (or node ids) to run, all by default; e.g. a share of test-gpu that fits a time-limited call
# `make test` leaves out the tests marked slow (long interpreter runs, sm_90 compiles, end-to-end subprocess runs):
# `make test-slow` runs them, on the same terms; CI (.ci/run) runs both.
TESTS ?= tests
test: $(SETUP)
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest $(TESTS) -m "not gpu and not slow"

test-slow: $(SETUP)
	CUDA_VISIBLE_DEVICES= $(PY) -m pytest $(TESTS) -m "slow and not gpu"

test-gpu: $(SETUP)
	$(PY) -m pytest $(TESTS) -m gpu

gate-a: $(SETUP)
	$(PY) -m gates gate-a $(GATE_FLAGS)

gate-b: $(SETUP)
	$(PY) -m gates gate-b $(GATE_FLAGS) $(if $(GOLDEN),--golden $(GOLDEN))

gate-memory: $(SETUP)
	$(PY) -m gates gate-memory $(GATE_FLAGS)

golden: $(SETUP)
	$(PY) -m gates golden $(GATE_FLAGS) --source $(SOURCE) $(if $(GOLDEN),--golden $(GOLDEN))

bench: $(SETUP)
	$(PY) -m benchmarks.bench_e2e $(if $(QUICK),--quick) $(if $(PRESET),--preset $(PRESET)) \
	  $(if $(DEVICE),--device $(DEVICE)) $(if $(WORLD),--world $(WORLD))

bench-kernels: $(SETUP)
	$(PY) -m benchmarks.kernels

decompose: $(SETUP)
	$(PY) -m benchmarks.decompose $(if $(QUICK),--quick) $(if $(PRESET),--preset $(PRESET)) \
	  $(if $(DEVICE),--device $(DEVICE))

report: $(SETUP)
	$(PY) -m reports.render

nightly: $(SETUP)
	$(PY) -m reports.nightly $(if $(PRESET),--preset $(PRESET)) $(if $(STEPS),--steps $(STEPS))

# The suite's small trained reference checkpoint (every block kind of the 48B model; trained on the Python standard
# library's source): REFERENCE_OUT its folder, new or empty; DEVICE, SEED as above; TRAIN_FLAGS more options of
# `python -m model.train --help`, e.g. `--steps 2000`, `--time-limit 300` (fewer steps if they would not fit) or
# `--quick` (a toy run: seconds on a GPU, about a minute on a CPU).
REFERENCE_OUT ?= out/reference
TRAIN_FLAGS ?=
train-reference: $(SETUP)
	$(PY) -m model.train --out $(REFERENCE_OUT) $(if $(DEVICE),--device $(DEVICE)) $(if $(SEED),--seed $(SEED)) \
	  $(TRAIN_FLAGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
