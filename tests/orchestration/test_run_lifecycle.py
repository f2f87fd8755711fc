"""The first hour, through `moe-rl train` as a user runs it: a second run never mixes into the
first, a resume keeps the settings that shape the run, progress lines when the output is not a
terminal, a summary at the end, and clean stops on SIGTERM and Ctrl-C."""
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import init_tiny_model
from tests.helpers import ROOT
from tests.helpers import engine_base_port

CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
         "trainer.checkpoint.export_hf=false"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("lifecycle") / "model"
    init_tiny_model(str(out), CONFIG)
    return out


def train(cwd, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "moe_rl.cli", "train", "--config", CONFIG,
                           *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def steps_of(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.loop
@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_a_second_run_never_mixes_into_the_first(model, tmp_path):
    run = tmp_path / "run"
    base = [f"model.path={model}", f"logging.dir={run}", "trainer.warmup.steps=1",
            f"rollout.servers.base_port={engine_base_port()}", "trainer.checkpoint.interval_minutes=0.0001", *SMALL]
    first = train(tmp_path, *base, "trainer.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    # not a terminal: one progress line per step, the warm start's too, then the summary
    out = first.stdout
    assert "warm start 1/1 | loss " in out and " s/step | ETA " in out
    for k in (1, 2):
        assert f"RL step {k}/2 | reward " in out
    assert "| k3 " in out and "| agreement " in out
    assert "run finished: 2 RL steps (steps 0-1)" in out and "mean reward of the first" in out
    assert f"last checkpoint {run / 'checkpoints' / 'iter_0000002'}" in out
    # checkpoint.interval_minutes (here 6 ms) came before checkpoint.interval (25 steps): every step saved
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*")) == \
        ["iter_0000001", "iter_0000002"]
    # a warning a run printed, fixed at its cause: transformers' deprecated `past_key_values`
    engine_log = (run / "logs" / "engine_0.log").read_text()
    assert "FutureWarning" not in engine_log and "deprecated" not in engine_log
    # and Ray's notice that it chose token authentication for the run: the run chooses it
    assert "Token authentication" not in first.stderr + first.stdout, first.stderr[-2000:]
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}

    # the same command again: refused before anything starts, nothing touched
    again = train(tmp_path, *base, "trainer.steps=3", timeout=120)
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    for needle in ("already holds a run", "--resume", "logging.dir=NEW_DIR", "--overwrite"):
        assert needle in again.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

    # --resume with a key that shapes the run changed: refused naming it, nothing touched
    changed = train(tmp_path, *base, "trainer.steps=3", "trainer.optim.lr=1e-5", "--resume",
                    timeout=120)
    assert changed.returncode == 2, changed.stderr[-2000:]
    assert changed.stderr.startswith("moe-rl train: trainer.optim.lr: the run in ") and \
        "--allow-change trainer.optim.lr" in changed.stderr
    assert f"resume with the saved config (`moe-rl train --config {run / 'config.yaml'} " \
        f"--resume`)" in changed.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    unknown = train(tmp_path, *base, "--resume", "--allow-change", "trainer.lrr", timeout=120)
    assert unknown.returncode == 2 and "--allow-change trainer.lrr: not a config key" \
        in unknown.stderr

    # --resume extending the run (steps, port: keys that do not shape it) continues it
    # (and a key that shapes it, accepted by name)
    resumed = train(tmp_path, *base, "trainer.steps=3", "trainer.optim.lr=1e-3", "--resume",
                    "--allow-change", "trainer.optim.lr")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 2" in resumed.stdout and steps_of(run) == [0, 1, 2]
    assert "resuming with trainer.optim.lr changed: 0.002 -> 0.001 (--allow-change)" in resumed.stdout

    # --overwrite: the old run moved aside whole, the new one alone in the directory
    fresh = train(tmp_path, *base, "trainer.steps=1", "--overwrite")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    old = tmp_path / "run.old-1"
    assert f"moved the previous run in {run} aside to {old}" in fresh.stdout
    assert steps_of(old) == [0, 1, 2] and steps_of(run) == [0]
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*")) == ["iter_0000001"]
    assert sorted(p.name for p in (old / "checkpoints").glob("iter_*")) == \
        ["iter_0000002", "iter_0000003"]
    from moe_rl.outputs.report import read_scalars   # one run's events per directory, no mixing
    assert list(read_scalars(str(run))["reward/mean"][0]) == [0]
    assert list(read_scalars(str(old))["reward/mean"][0]) == [0, 1, 2]


def _start(cwd, args, session=False, env=None):
    return subprocess.Popen([sys.executable, "-m", "moe_rl.cli", "train", "--config", CONFIG,
                             *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=session, env=env)


def _wait_for_line(proc, needle, timeout=300) -> list[str]:
    lines, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"never printed {needle!r}: {''.join(lines)[-2000:]}")


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.loop
# SIGTERM (the same handler) runs in `make test-slow`, to keep CI in its time
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
                                 signal.SIGINT])
def test_a_signal_finishes_the_step_checkpoints_it_and_the_printed_command_resumes(model,
                                                                                   tmp_path, sig):
    """SIGTERM (Slurm, scancel) and one Ctrl-C (SIGINT to the whole process group, as a terminal
    sends it) alike: the step in flight finishes and is checkpointed, nothing since the last
    save is lost, and the printed command resumes."""
    run = tmp_path / "run"
    args = [f"model.path={model}", f"logging.dir={run}", "trainer.warmup.steps=0",
            "trainer.steps=100", "trainer.checkpoint.interval=0", "trainer.checkpoint.interval_minutes=0",
            "trainer.checkpoint.stop_grace_s=60", f"rollout.servers.base_port={engine_base_port()}",
            "logging.log_interval=2", *SMALL]
    proc = _start(tmp_path, args, session=True)
    lines = _wait_for_line(proc, "RL step 2/100")
    assert not any("RL step 1/100" in line for line in lines)   # every log_interval steps
    port = json.loads((run / "plan.json").read_text())["processes"]
    port = [p["port"] for p in port if p["role"] == "engine"][0]
    sent = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=60 + 60)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + sig, err[-3000:]
    assert took < 60 + 60, took   # trainer.checkpoint.stop_grace_s + the engines' stop
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"{sig.name}: finishing the current step (at most 60 s, trainer.checkpoint.stop_grace_s), " \
        "then checkpoint it, stop" in err
    last = [line for line in err.splitlines() if line.startswith("moe-rl train: stopped")]
    assert len(last) == 1, err[-3000:]
    done = len(steps_of(run))
    ckpt = run / "checkpoints" / f"iter_{done:07d}"
    assert f"stopped by {sig.name}, after step {done} of 100: last checkpoint " in last[0]
    assert os.path.samefile(tmp_path / last[0].split("last checkpoint ")[1].split(";")[0],
                            ckpt) and (ckpt / "manifest.json").is_file()
    assert _port_closed(port)   # the engine server is gone
    # the printed command continues the run (one step more than was done)
    command = shlex.split(last[0].split("continue with: ")[1])
    assert command[:2] == ["moe-rl", "train"] and command[-1] == "--resume"
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", *command[1:-1],
                          f"trainer.steps={done + 1}", "--resume"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resuming at step {done}" in res.stdout and steps_of(run) == list(range(done + 1))


@pytest.mark.loop
@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_ctrl_c_twice_abandons_the_step_and_stops_everything(model, tmp_path):
    """Ctrl-C as a terminal sends it: SIGINT to the whole process group (Ray's processes
    and the engines must survive the first one); the second abandons the step at once."""
    run = tmp_path / "run"
    # each reward call takes 1 s: a step's rollout lasts >= 4 s, so both signals land in it
    (tmp_path / "slow_reward.py").write_text(
        "import time\nfrom moe_rl.rewards.functions import toy_reward\n"
        "def slow(prompt, response, answer, metadata):\n"
        "    time.sleep(1.0)\n    return toy_reward(prompt, response, answer, metadata)\n")
    args = [f"model.path={model}", f"logging.dir={run}", "trainer.warmup.steps=0",
            "trainer.steps=100", "trainer.checkpoint.interval=2", f"rollout.servers.base_port={engine_base_port()}",
            "data.reward=slow_reward:slow", *SMALL]
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    proc = _start(tmp_path, args, session=True, env=env)
    _wait_for_line(proc, "RL step 3/100")
    port = [p["port"] for p in json.loads((run / "plan.json").read_text())["processes"]
            if p["role"] == "engine"][0]
    # into step 4's rollout (>= 4 s): a signal landing before the loop began that step, on a
    # loaded machine, would stop the run between steps with nothing left to abandon
    time.sleep(1.0)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    # the second once the first is acknowledged (two signals before Python's handler runs are
    # one signal to it)
    first = []
    while not first or "SIGINT: finishing the current step" not in first[-1]:
        first.append(proc.stderr.readline())
        assert first[-1], "".join(first)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=90)
    err = "".join(first) + err
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert time.monotonic() - sent < 60 + 30
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "SIGINT: finishing the current step" in err
    last = [line for line in err.splitlines() if line.startswith("moe-rl train: stopped")]
    assert len(last) == 1 and "abandoned (a second SIGINT)" in last[0], err[-3000:]
    assert "last checkpoint " in last[0] and "--resume" in last[0]
    from moe_rl.orchestration import checkpoint
    latest = checkpoint.latest(str(run / "checkpoints"))
    assert latest is not None and os.path.samefile(
        tmp_path / last[0].split("last checkpoint ")[1].split(";")[0], latest)
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert _port_closed(port)


SLOW_ENGINE_START = """
import os, signal, sys, time
if "serve-reference" in sys.argv and os.environ.get("SLOW_ENGINE_START_S"):
    # a checkpoint that loads for long, deaf to the terminal's Ctrl-C: the run must end it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(float(os.environ["SLOW_ENGINE_START_S"]))
    signal.signal(signal.SIGINT, signal.default_int_handler)
"""


@pytest.mark.loop
def test_ctrl_c_while_the_engines_load_stops_the_start_up_at_once(model, tmp_path):
    """Ctrl-C while the engine server is still loading (here it takes 600 s to start, against
    a grace period of 300 s): no step to finish, so the run stops its start-up at once (it
    waited for the load, then the grace period), ends the loading server and says so in one
    line, without a traceback."""
    import psutil
    run = tmp_path / "run"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_ENGINE_START)
    env = dict(os.environ, SLOW_ENGINE_START_S="600",
               PYTHONPATH=f"{tmp_path / 'site'}:{os.environ.get('PYTHONPATH', '')}")
    args = [f"model.path={model}", f"logging.dir={run}", "trainer.warmup.steps=0",
            "trainer.steps=5", "trainer.checkpoint.stop_grace_s=300", "rollout.servers.startup_timeout_s=900",
            f"rollout.servers.base_port={engine_base_port()}", *SMALL]
    proc = _start(tmp_path, args, session=True, env=env)

    def loading_servers():
        found = []
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                if "serve-reference" in p.cmdline():
                    found.append(p)
            except psutil.Error:   # a process of Ray's start-up that has just ended
                pass
        return found
    deadline = time.monotonic() + 300
    while not loading_servers():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    server = loading_servers()[0]
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert time.monotonic() - sent < 60, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "SIGINT: stopping the start-up (no step has run yet)" in err
    last = [line for line in err.splitlines() if line.startswith("moe-rl train: stopped")]
    assert last == ["moe-rl train: stopped by SIGINT, during start-up, before step 0 of 5: no "
                    "checkpoint was written"], err[-3000:]
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    assert not (run / "metrics.jsonl").exists() or steps_of(run) == []


@pytest.mark.loop
def test_a_run_whose_ray_is_stopped_from_outside_says_so(model, tmp_path):
    """Another job's `ray stop` (here: SIGTERM to the run's own raylet) is named as what it is,
    in one line with the last checkpoint, not as a bare ActorDiedError."""
    import psutil
    run = tmp_path / "run"
    args = [f"model.path={model}", f"logging.dir={run}", "trainer.warmup.steps=0",
            "trainer.steps=100", "trainer.checkpoint.interval=1", f"rollout.servers.base_port={engine_base_port()}",
            *SMALL]
    proc = _start(tmp_path, args)
    _wait_for_line(proc, "RL step 2/100")
    raylets = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if p.name() == "raylet"]
    assert len(raylets) == 1, raylets
    raylets[0].send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("moe-rl train: stopped from outside the run during step "), err[-3000:]
    assert "Ray's raylet (pid " in last or "Ray's gcs_server (pid " in last, last
    assert "last checkpoint " in last and "--resume" in last
