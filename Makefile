# moe_rl: every target sets itself up (venv, CPU torch, the project) on a fresh machine.
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_VERSION := 0.5.23

.PHONY: setup test test-loop test-slow test-all test-contract test-multinode test-cluster docs demo bench study clean

$(STAMP): setup.py
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU machines: the pinned torch is a CPU build on disk; GPU machines keep their own torch.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not contract and not multinode and not loop and not cluster" $(PYTEST_ARGS) tests

# the training loop end to end through `moe-rl train` / `moe-rl demo` (every option's user path)
test-loop: $(STAMP)
	$(PY) -m pytest -q -m "loop and not slow" $(PYTEST_ARGS) tests

# a run placed on Ray's multi-node test cluster (several raylets on this machine)
test-multinode: $(STAMP)
	$(PY) -m pytest -q -m multinode $(PYTEST_ARGS) tests

# a real Slurm cluster on this machine (slurmctld, a slurmd per node, each node a network
# namespace of its own) running launch/slurm_multinode.sbatch; root, installs slurm-wlm and munge
SLURM_PACKAGES := slurm-wlm munge iproute2 util-linux
test-cluster: $(STAMP)
	@test "$$(id -u)" = 0 || { echo "make test-cluster needs root (network namespaces, a bridge, slurmd)"; exit 1; }
	command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SLURM_PACKAGES); }
	$(PY) -m pytest -q -s -m cluster $(PYTEST_ARGS) tests/test_slurm_cluster.py

# SGLang's own environment (its pinned wheel without its GPU dependencies, the CPU torch, the
# light dependencies its Python needs); the contract tests run SGLang's code there as the judge.
$(SGLANG_STAMP): tests/contract/requirements.txt
	test -x $(SGLANG_PY) || $(PY_SYS) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet --upgrade pip
	$(SGLANG_PY) -c "import torch" 2>/dev/null || $(SGLANG_PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(SGLANG_PY) -m pip install --quiet --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_PY) -m pip install --quiet -r tests/contract/requirements.txt
	touch $(SGLANG_STAMP)

test-contract: $(STAMP) $(SGLANG_STAMP)
	MOE_RL_SGLANG_PYTHON=$(abspath $(SGLANG_PY)) $(PY) -m pytest -q -m contract $(PYTEST_ARGS) tests/contract

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow" $(PYTEST_ARGS) tests

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not contract" $(PYTEST_ARGS) tests

# the manual (docs/, MkDocs Material) as a site in site/; --strict: a broken link or anchor fails
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) setup.py
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

demo: $(STAMP)
	$(VENV)/bin/moe-rl demo

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

# the dose-response study alone (about an hour on 2 cores): benchmarks/results/dose_response.*
study: $(STAMP)
	$(PY) benchmarks/dose_response.py

clean:
	rm -rf $(VENV) $(SGLANG_VENV) build *.egg-info
