"""A run that loses one of its processes says which and how to go on, in one line: Ray's
"actor/worker/node/object lost" errors recognised (also inside a task's error), a rank whose peer
failed traced to the rank that is gone, `moe-rl` exiting 1 with the message."""
import os

import pytest
import ray

from moe_rl.orchestration.failures import RunFailed, lost_process
from moe_rl.orchestration.processes import Trainers


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Rank:
    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def die(self) -> None:
        os._exit(1)


@ray.remote(num_cpus=0)
def ask(actor) -> str:
    return ray.get(actor.node_ip.remote())


@ray.remote(num_cpus=0)
def bug() -> None:
    raise ValueError("a bug in the run's own code")


@ray.remote(num_cpus=0)
class BrokenRank:
    def __init__(self):
        raise RuntimeError("the rendezvous port is taken")

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()


def _dead_rank():
    rank = Rank.remote()
    ray.get(rank.node_ip.remote())
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(rank.die.remote())
    return rank


def test_lost_actors_are_recognised_and_bugs_are_not(local_ray):
    dead = _dead_rank()
    with pytest.raises(ray.exceptions.RayActorError) as direct:
        ray.get(dead.node_ip.remote())
    assert lost_process(direct.value).startswith(type(direct.value).__name__ + ": ")
    with pytest.raises(ray.exceptions.RayTaskError) as nested:   # a task that asked the rank
        ray.get(ask.remote(dead))
    assert lost_process(nested.value) is not None
    with pytest.raises(ray.exceptions.RayTaskError) as own:
        ray.get(bug.remote())
    assert lost_process(own.value) is None
    assert lost_process(ValueError("x")) is None


def test_a_rank_that_failed_to_start_says_why(local_ray):
    """An actor whose constructor raised: the one line ends with the error it raised, not
    only Ray's "died in its creation task" (whose traceback the user never sees)."""
    with pytest.raises(ray.exceptions.RayActorError) as failed:
        ray.get(BrokenRank.remote().node_ip.remote())
    said = lost_process(failed.value)
    assert said.endswith("it said: RuntimeError: the rendezvous port is taken"), said


def test_the_rank_that_is_gone_is_named(local_ray):
    trainers = Trainers.__new__(Trainers)
    trainers.actors = [Rank.remote(), Rank.remote()]
    assert trainers.unreachable(timeout_s=30) is None
    ray.get(trainers.actors[0].node_ip.remote())
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(trainers.actors[1].die.remote())
    said = trainers.unreachable(timeout_s=30)
    assert said.startswith("trainer rank 1: ") and "Error" in said


def test_moe_rl_prints_one_line_and_exits_1(monkeypatch, capsys):
    from moe_rl import cli
    from moe_rl.commands import plan

    def fail(args):
        raise RunFailed("lost a process of the run during step 3 (trainer rank 1: gone): "
                        "last checkpoint runs/x/checkpoints/iter_0000003")
    monkeypatch.setattr(plan, "run", fail)
    assert cli.main(["plan"]) == 1
    err = capsys.readouterr().err
    assert err == ("moe-rl plan: lost a process of the run during step 3 (trainer rank 1: "
                   "gone): last checkpoint runs/x/checkpoints/iter_0000003\n")


def test_a_ray_that_does_not_start_is_one_line_through_the_command(tmp_path):
    """Ray failing to start (here its temporary directory is a file; under load, its node not
    up within 30 s) ends `moe-rl train` (the console script) in one line naming what and what
    to do, exit 1, no traceback."""
    import pathlib
    import subprocess
    import sys
    from tests.helpers import ROOT, init_tiny_model
    init_tiny_model(str(tmp_path / "model"))
    (tmp_path / "not_a_dir").write_text("")
    res = subprocess.run([str(pathlib.Path(sys.executable).with_name("moe-rl")), "train",
                          "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
                          f"model.path={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}",
                          "trainer.steps=1"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, RAY_TMPDIR=str(tmp_path / "not_a_dir")))
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-rl train: Ray did not start on this node: [Errno 20] Not a "
                           "directory") and "try again" in last, last
    assert f"{tmp_path / 'not_a_dir'}/ray/session_latest/logs" in last
