"""Nothing left behind by killed processes: an engine's scratch directory is swept at the next
engine start, and the Ray agents of a SIGKILLed driver are stopped at the next run's start."""
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from moe_rl.config import ModelInitConfig
from moe_rl.leftovers import (ENGINE_SCRATCH_PREFIX, orphaned_ray_agents,
                              sweep_engine_scratch)
from moe_rl.models.tiny import write_tiny_model
from moe_rl.trainer.parallel import free_port


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_scratch_of_dead_owners(tmp_path):
    dead = tmp_path / f"{ENGINE_SCRATCH_PREFIX}{_dead_pid()}_abc"
    mine = tmp_path / f"{ENGINE_SCRATCH_PREFIX}{os.getpid()}_def"
    other = tmp_path / "moe_rl_engine_notapid"
    for d in (dead, mine, other):
        (d / "weights_1").mkdir(parents=True)
    assert sweep_engine_scratch(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and mine.exists() and other.exists()


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


RAY_DRIVER = """
import ray, sys, time
ray.init(address="local", num_cpus=1, include_dashboard=False)
print("up", flush=True)
time.sleep(600)
"""


@pytest.mark.e2e
def test_agents_of_a_killed_ray_driver_are_stopped_at_the_next_start(tmp_path, capsys):
    """A driver SIGKILLed leaves its DashboardAgent and RuntimeEnvAgent running, orphaned; the
    next run's start_ray stops them (and nothing of a live Ray)."""
    import ray
    from moe_rl.config import load_config
    from moe_rl.orchestration.placement import make_plan
    from moe_rl.orchestration.ray_placement import start_ray
    before = {p.pid for p in orphaned_ray_agents()}
    driver = subprocess.Popen([sys.executable, "-c", RAY_DRIVER], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
    assert driver.stdout.readline().strip() == "up"
    time.sleep(2)   # the agents start beside the raylet
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 30
    orphans = []
    while time.monotonic() < deadline and len(orphans) < 2:
        orphans = [p for p in orphaned_ray_agents() if p.pid not in before]
        time.sleep(0.5)
    assert len(orphans) == 2, orphans   # the leak is real
    if ray.is_initialized():
        ray.shutdown()
    cfg = load_config(None, [f"model.path={tmp_path}"])
    start_ray(cfg, make_plan(cfg))
    try:
        assert "stopped" in capsys.readouterr().err
        assert not [p for p in orphaned_ray_agents() if p.pid in {o.pid for o in orphans}]
        assert ray.cluster_resources().get("CPU", 0) >= 1   # the new Ray is fine
    finally:
        ray.shutdown()
