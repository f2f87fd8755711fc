# moe_rl: every target sets itself up (venv, CPU torch, the project) on a fresh machine.
PY_SYS ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=
# the slowest tests of each target in its log (what to move to test-slow when CI grows)
DURATIONS := --durations=10
# two pytest-xdist workers, each test module whole on one of them (its module fixtures made
# once): a loop test spends much of its time waiting on process start-up, which the other
# worker fills. XDIST= XDIST_RUNS= run one process (a debugger, -x).
XDIST ?= -n 2 --dist loadfile
# the loop targets spread single tests (each run is its own `moe-rl train`); a module whose
# fixture is costly to make twice (servers, a wheel) stays whole by its xdist_group mark
XDIST_RUNS ?= -n 2 --dist loadgroup
# the real SGLang two tests at a time, then those marked `alone` one at a time: a second run
# beside them changes the timing their aborts, retractions and kills rely on (the partial-rollout
# and weight-check runs each failed once so, 2026-11-28; the partial one's abort now meets
# retracted requests by construction)
XDIST_SGLANG ?= -n 2 --dist loadgroup

# the contract tests share one module: each test's judge is its own SGLang process (~20 s of
# imports, one core), so they spread one test at a time
XDIST_CONTRACT ?= -n 2

SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed

# the newest upstream: megatron-core 0.19 needs Python 3.12, where PyPI's torch is a CUDA build
# (it runs on CPU; ~6.5 GB installed); the other dependencies resolve to their newest releases
# within setup.py's ranges
# a pyenv-installed 3.12 where there is one (its shim refuses outside `pyenv local`), else PATH's
PY312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
UPSTREAM_VENV ?= .venv-upstream
UPSTREAM_PY := $(UPSTREAM_VENV)/bin/python
UPSTREAM_STAMP := $(UPSTREAM_VENV)/.installed
UPSTREAM_PINS := megatron-core==0.19.2 torch==2.15.0 transformers==5.24.0 ray==2.60.0
# the trainer, checkpoints, DeepSeek-V3, gpt-oss, packing / context parallel, parallel ranks, bf16,
# SDPA attention and the dispatch by sort (megatron-core 0.19.2 is the GPU matrix's), and
# the loop tests marked `upstream` (R3 + GSPO through `moe-rl train`)
UPSTREAM_TESTS := tests/trainer/test_step.py tests/trainer/test_model.py \
	tests/trainer/test_parallel.py tests/orchestration/test_checkpoint.py tests/trainer/test_checkpoint_reshard.py \
	tests/families/test_deepseek_v3.py tests/families/test_gpt_oss.py tests/trainer/test_packed_sequences.py tests/trainer/test_context_parallel.py \
	tests/trainer/test_bf16.py tests/trainer/test_sdpa_attention.py tests/trainer/test_sort_dispatcher.py \
	tests/trainer/test_grouped_experts.py tests/benchmarks/test_trainer_ops.py

.PHONY: bytecode coverage setup lock test test-newest test-loop test-slow test-all test-contract test-sglang test-multinode test-cluster test-upstream docs demo demo-sglang bench study clean

# the locks of the tested versions (pip constraints; `make lock` writes them): every target
# installs with its Python's lock, so a fresh machine gets what CI tested; setup.py keeps ranges
# for users; `make test-newest` (the canary) tries the newest versions those ranges allow
LOCK_CPU := constraints-py311-cpu.txt
LOCK_UPSTREAM := constraints-py312-upstream.txt
LOCK_GPU := constraints-gpu.txt

$(STAMP): setup.py $(LOCK_CPU)
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU machines: the pinned torch is a CPU build on disk; GPU machines keep their own torch.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e ".[test]" -c $(LOCK_CPU)
	touch $(STAMP)

setup: $(STAMP)

# the project's own bytecode, written ahead: where PYTHONDONTWRITEBYTECODE is set (as on these
# machines) no import writes it, so every process of a run (driver, actors, engine servers,
# each CLI call of a test) would compile moe_rl from source again, ~0.5-1 s of CPU each;
# pip compiled the installed packages. Up-to-date files are skipped.
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 moe_rl tests > /dev/null

test: $(STAMP) bytecode
	$(PY) -m pytest -q $(XDIST) -m "not slow and not contract and not multinode and not loop and not cluster and not sglang" $(PYTEST_ARGS) $(DURATIONS) tests

# the training loop end to end through `moe-rl train` / `moe-rl demo` (every option's user path)
test-loop: $(STAMP) bytecode
	$(PY) -m pytest -q $(XDIST_RUNS) -m "loop and not slow and not sglang and not upstream" $(PYTEST_ARGS) $(DURATIONS) tests

# a run placed on Ray's multi-node test cluster (several raylets on this machine)
test-multinode: $(STAMP) bytecode
	$(PY) -m pytest -q -m multinode $(PYTEST_ARGS) tests

# a real Slurm cluster on this machine (slurmctld, a slurmd per node, each node a network
# namespace of its own) running launch/slurm_multinode.sbatch; root, installs slurm-wlm and munge
SLURM_PACKAGES := slurm-wlm munge iproute2 util-linux
test-cluster: $(STAMP) bytecode
	@test "$$(id -u)" = 0 || { echo "make test-cluster needs root (network namespaces, a bridge, slurmd)"; exit 1; }
	command -v slurmctld >/dev/null && command -v munged >/dev/null || \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SLURM_PACKAGES); }
	$(PY) -m pytest -q -s -m cluster $(PYTEST_ARGS) tests/launch/test_slurm_cluster.py

# SGLang's own environment for CPU (`moe-rl sglang-cpu-env`: the CPU torch, the pinned SGLang
# without its GPU dependencies, its light dependencies, the import-time shims); the contract
# tests run SGLang's code there as the judge, and `make test-sglang` serves from it.
$(SGLANG_STAMP): $(STAMP) moe_rl/engines/sglang/cpu_requirements.txt moe_rl/engines/sglang/cpu_shims.py
	$(VENV)/bin/moe-rl sglang-cpu-env $(SGLANG_VENV)
	touch $(SGLANG_STAMP)

test-contract: $(STAMP) $(SGLANG_STAMP) bytecode
	MOE_RL_SGLANG_PYTHON=$(abspath $(SGLANG_PY)) $(PY) -m pytest -q $(XDIST_CONTRACT) -m contract $(PYTEST_ARGS) $(DURATIONS) tests/contract

# the real SGLang serving on CPU: its shims, the engine contract, the loop through `moe-rl train`
test-sglang: $(STAMP) $(SGLANG_STAMP) bytecode
	MOE_RL_SGLANG_PYTHON=$(abspath $(SGLANG_PY)) $(PY) -m pytest -q $(XDIST_SGLANG) -m "sglang and not slow and not alone" $(PYTEST_ARGS) $(DURATIONS) tests
	MOE_RL_SGLANG_PYTHON=$(abspath $(SGLANG_PY)) $(PY) -m pytest -q -m "sglang and not slow and alone" $(PYTEST_ARGS) $(DURATIONS) tests

# this machine's pip configuration caps torch at the release on its disk (for Python 3.11):
# the upstream environment reads no pip configuration
$(UPSTREAM_STAMP): setup.py $(LOCK_UPSTREAM)
	test -x $(UPSTREAM_PY) || $(PY312) -m venv $(UPSTREAM_VENV)
	PIP_CONFIG_FILE=/dev/null $(UPSTREAM_PY) -m pip install --quiet --upgrade pip
	PIP_CONFIG_FILE=/dev/null $(UPSTREAM_PY) -m pip install --quiet -e ".[test]" $(UPSTREAM_PINS) \
	  -c $(LOCK_UPSTREAM)
	touch $(UPSTREAM_STAMP)

test-upstream: $(UPSTREAM_STAMP)
	$(UPSTREAM_PY) -m compileall -q -j 0 moe_rl tests > /dev/null
	$(UPSTREAM_PY) -m pytest -q $(XDIST) -m "not slow and (not loop or upstream)" $(PYTEST_ARGS) $(DURATIONS) $(UPSTREAM_TESTS)

# W&B only where its runs are tested (`make test-slow`): megatron-core imports it when it is
# installed (~1.4 s of CPU in every trainer process here), so the other targets go without it
WANDB_STAMP := $(VENV)/.wandb-installed
$(WANDB_STAMP): $(STAMP) setup.py
	$(PY) -m pip install --quiet -e ".[wandb]" -c $(LOCK_CPU)
	touch $(WANDB_STAMP)

test-slow: $(STAMP) $(SGLANG_STAMP) $(WANDB_STAMP) bytecode
	MOE_RL_SGLANG_PYTHON=$(abspath $(SGLANG_PY)) $(PY) -m pytest -q $(XDIST) -m "slow" $(PYTEST_ARGS) $(DURATIONS) tests

test-all: $(STAMP)
	$(PY) -m pytest -q -m "not contract and not sglang" $(PYTEST_ARGS) tests

# the manual (docs/, MkDocs Material) as a site in site/; --strict: a broken link or anchor fails
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP) setup.py
	$(PY) -m pip install --quiet -e ".[docs]" -c $(LOCK_CPU)
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site
	# a table's escaped pipe shown literally (`\|` inside code renders as typed): none allowed
	! grep -rlF '\|' site --include='*.html' || (echo "literal \\| in the built manual (above)"; false)

demo: $(STAMP)
	$(VENV)/bin/moe-rl demo

# the demo on the real SGLang serving on CPU, in bfloat16 against the float32 trainer
demo-sglang: $(STAMP) $(SGLANG_STAMP)
	$(VENV)/bin/moe-rl demo rollout.engine=sglang rollout.sglang.device=cpu \
	  rollout.sglang.python=$(abspath $(SGLANG_PY)) rollout.quantization=none

bench: $(STAMP) $(SGLANG_STAMP)
	MOE_RL_SGLANG_PYTHON=$(abspath $(SGLANG_PY)) $(PY) -m benchmarks.run_all

# the dose-response study alone (about an hour on 2 cores): benchmarks/results/dose_response.*
study: $(STAMP)
	$(PY) benchmarks/dose_response.py

# line coverage of moe_rl/ by all of .ci/run (subprocesses and Ray actors included) and by
# `make test` alone, with every test's duration: .coverage-data/ (summary.txt, ci.log)
coverage:
	bash .ci/coverage.sh

# the canary: a fresh environment of the newest versions setup.py allows (no lock; torch stays
# the CPU build on disk) and a short smoke of the user's path; when it fails it names every
# package newer than the lock (.ci/canary.sh). `.ci/run` runs it: an upstream release breaks CI
NEWEST_VENV ?= .venv-newest
test-newest:
	rm -rf $(NEWEST_VENV)
	$(PY_SYS) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST_VENV)/bin/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(NEWEST_VENV)/bin/python -m pip install --quiet -e ".[test]"
	bash .ci/canary.sh $(NEWEST_VENV) $(LOCK_CPU)

# the locks, from fresh environments of the newest versions setup.py allows (Python 3.11 with the
# extras the targets install; Python 3.12 with make test-upstream's pins), and the GPU matrix
# from SGLang's own pins; then run .ci/run with them before committing
LOCK_VENV ?= .venv-lock
lock: $(SGLANG_STAMP)
	rm -rf $(LOCK_VENV) $(LOCK_VENV)-312
	$(PY_SYS) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install --quiet torch==$(TORCH_VERSION)
	$(LOCK_VENV)/bin/python -m pip install --quiet -e ".[test,docs,wandb]"
	$(LOCK_VENV)/bin/python .ci/lock.py freeze $(LOCK_VENV)/bin/python $(LOCK_CPU) \
	  "Python 3.11, CPU: make setup, test, test-loop, test-slow, docs (torch $(TORCH_VERSION), the CPU build)"
	$(PY312) -m venv $(LOCK_VENV)-312
	PIP_CONFIG_FILE=/dev/null $(LOCK_VENV)-312/bin/python -m pip install --quiet --upgrade pip
	PIP_CONFIG_FILE=/dev/null $(LOCK_VENV)-312/bin/python -m pip install --quiet -e ".[test]" $(UPSTREAM_PINS)
	$(LOCK_VENV)-312/bin/python .ci/lock.py freeze $(LOCK_VENV)-312/bin/python $(LOCK_UPSTREAM) \
	  "Python 3.12: make test-upstream ($(UPSTREAM_PINS))"
	$(PY) .ci/lock.py gpu $(SGLANG_PY) $(LOCK_GPU)
	rm -rf $(LOCK_VENV) $(LOCK_VENV)-312

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(UPSTREAM_VENV) $(NEWEST_VENV) build *.egg-info
