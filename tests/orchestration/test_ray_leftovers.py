"""The Ray agents of a SIGKILLed driver are stopped at the next run's start, and nothing else."""
import signal
import subprocess
import sys
import time

import pytest

from moe_rl.orchestration.ray_leftovers import orphaned_ray_agents


MOE_RL_DRIVER = """
import sys, time
from moe_rl.config import load_config
from moe_rl.orchestration.placement import make_plan
from moe_rl.orchestration.ray_placement import start_ray
cfg = load_config(None, [f"model.path={sys.argv[1]}", f"logging.dir={sys.argv[1]}/run"])
start_ray(cfg, make_plan(cfg))
print("up", flush=True)
time.sleep(600)
"""
BARE_RAY_DRIVER = """
import ray, time
ray.init(address="local", num_cpus=1, include_dashboard=False)
print("up", flush=True)
time.sleep(600)
"""


def _agents_left_by_a_killed(driver: str, cwd) -> list:
    """Start ``driver``, SIGKILL it once its Ray is up: its agents stay, orphaned (psutil)."""
    import psutil
    proc = subprocess.Popen([sys.executable, "-c", driver, str(cwd)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=cwd)
    assert proc.stdout.readline().strip() == "up"
    time.sleep(2)   # the agents start beside the raylet
    session_pids = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline, agents = time.monotonic() + 30, []
    while time.monotonic() < deadline and len(agents) < 2:
        agents = [p for p in psutil.process_iter(["cmdline"]) if p.pid in session_pids and
                  (p.info["cmdline"] or [""])[0] in ("ray::DashboardAgent",
                                                       "ray::RuntimeEnvAgent")]
        time.sleep(0.5)
    assert len(agents) == 2, agents   # the leak is real
    return agents


@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
@pytest.mark.e2e
def test_agents_of_a_killed_run_are_stopped_at_the_next_start_and_nothing_else(tmp_path, capsys):
    """A moe_rl driver SIGKILLed leaves its DashboardAgent and RuntimeEnvAgent running,
    orphaned; the next run's start_ray stops them and says whose they were. The agents of
    another program's Ray, killed the same way, are not shown to be a moe_rl run's and stay."""
    import psutil
    import ray
    from moe_rl.config import load_config
    from moe_rl.orchestration.placement import make_plan
    from moe_rl.orchestration.ray_placement import start_ray
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    ours = _agents_left_by_a_killed(MOE_RL_DRIVER, tmp_path / "ours")
    theirs = _agents_left_by_a_killed(BARE_RAY_DRIVER, tmp_path / "theirs")
    try:
        assert {p.pid for p, _ in orphaned_ray_agents()} >= {p.pid for p in ours}
        assert not {p.pid for p, _ in orphaned_ray_agents()} & {p.pid for p in theirs}
        if ray.is_initialized():
            ray.shutdown()
        cfg = load_config(None, [f"model.path={tmp_path}"])
        start_ray(cfg, make_plan(cfg))
        try:
            err = capsys.readouterr().err
            assert f"left by the killed run {tmp_path / 'ours' / 'run'} (driver pid" in err, err
            assert not any(p.is_running() for p in ours)
            assert all(p.is_running() for p in theirs)   # another program's: untouched
            assert ray.cluster_resources().get("CPU", 0) >= 1   # the new Ray is fine
        finally:
            ray.shutdown()
    finally:
        for p in theirs:
            p.kill()
        psutil.wait_procs(theirs, timeout=10)
