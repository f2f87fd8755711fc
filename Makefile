# moe_rl: every target sets itself up (venv, CPU torch, the project) on a fresh machine.
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-slow test-all demo bench clean

$(STAMP): setup.py
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU machines: the pinned torch is a CPU build on disk; GPU machines keep their own torch.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow" $(PYTEST_ARGS) tests

test-all: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

demo: $(STAMP)
	$(VENV)/bin/moe-rl demo

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) build *.egg-info
