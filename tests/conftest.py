"""Fixtures shared across test modules."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT, measure_as, train_cli


@pytest.fixture(autouse=True)
def coverage_context(request, monkeypatch):
    """Under `make coverage`: the lines each test runs are recorded under its id, in the test
    process and in every process it starts (.coveragerc reads MOE_RL_TEST_CONTEXT)."""
    if os.environ.get("COVERAGE_PROCESS_START"):
        monkeypatch.setenv("MOE_RL_TEST_CONTEXT", request.node.nodeid)
        measure_as(request.node.nodeid)
    yield


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """One short real run (3 steps, IcePop then seq-MIS, a HF export at step 2; its logging.dir
    already holds a user's folder weights/precious and a copy of an export, weights/v1-kept),
    shared by the
    loop, convert and report tests; tests that change it work on a copy. Made once per pytest
    session, by whichever pytest-xdist worker asks first (the others wait on its lock)."""
    from filelock import FileLock
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):   # the session's folder, above each worker's own
        shared = shared.parent
    base = shared / "trained_run"
    with FileLock(str(shared / "trained_run.lock")):
        if not (base / "done").exists():
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir()
            # a user's folder where the disk weight sync exports: the run must leave it whole
            (base / "run" / "weights" / "precious").mkdir(parents=True)
            (base / "run" / "weights" / "precious" / "model.bin").write_text("data")
            # and a user's copy of an export (`cp -r`: it carries moe_rl's mark, of another
            # folder): the run's sync must leave it whole too
            from moe_rl.owned_dirs import claim
            claim(str(base / "an_export"))
            (base / "an_export" / "model.safetensors").write_text("kept")
            shutil.copytree(base / "an_export", base / "run" / "weights" / "v1-kept")
            subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config",
                            str(ROOT / "configs" / "tiny_cpu.yaml"), "--out", str(base / "model")],
                           check=True, capture_output=True, timeout=120)
            train_cli(base, 3, "algorithm.corrections=[icepop,seq_mis]",
                      "trainer.checkpoint.export_hf_interval=2")
            (base / "done").touch()
    return base


@pytest.fixture(scope="module")
def parallel_state():
    """megatron's process groups for a one-process trainer (a module's own fixture of this name
    takes precedence)."""
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    yield
