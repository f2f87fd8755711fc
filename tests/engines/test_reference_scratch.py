"""The reference engine's scratch directories: a killed engine's is swept at the next engine
start, and nothing that is not a dead owner's marked scratch is touched."""
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from moe_rl.config import ModelInitConfig
from moe_rl.engines.reference.scratch import ENGINE_SCRATCH_PREFIX, sweep_engine_scratch
from moe_rl.models.tiny import write_tiny_model
from moe_rl.trainer.parallel import free_port


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_scratch_of_dead_owners(tmp_path):
    """Only folders moe_rl marked: a folder of the same name without the mark stays."""
    from moe_rl.owned_dirs import claim
    dead = tmp_path / f"{ENGINE_SCRATCH_PREFIX}{_dead_pid()}_abc"
    mine = tmp_path / f"{ENGINE_SCRATCH_PREFIX}{os.getpid()}_def"
    other = tmp_path / "moe_rl_engine_notapid"
    unmarked = tmp_path / f"{ENGINE_SCRATCH_PREFIX}{_dead_pid()}_users"
    for d in (dead, mine, other):
        claim(str(d))
    for d in (dead, mine, other, unmarked):
        (d / "weights_1").mkdir(parents=True)
    assert sweep_engine_scratch(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and mine.exists() and other.exists()
    assert (unmarked / "weights_1").is_dir()


@pytest.mark.e2e
def test_a_killed_engines_scratch_is_swept_at_the_next_start(tmp_path, monkeypatch):
    from moe_rl.engines.reference.engine import ReferenceEngine
    from moe_rl.engines.reference.launcher import ReferenceServer
    model = str(tmp_path / "model")
    write_tiny_model(ModelInitConfig(), model)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    proc = ReferenceServer(model, free_port()).start()
    pid = proc.proc.pid
    left = [p for p in scratch.iterdir() if p.name.startswith(f"{ENGINE_SCRATCH_PREFIX}{pid}_")]
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait()
    assert len(left) == 1 and left[0].exists()   # SIGKILL: no cleanup ran
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    engine = ReferenceEngine(model)
    assert not left[0].exists()
    engine.close()
