"""Slurm and single-node launchers in dry-run mode (Slurm's own tools as shims; the real Slurm
runs them in tests/launch/test_slurm_cluster.py)."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm_multinode.sbatch"


@pytest.fixture
def slurm_shims(tmp_path):
    """`scontrol` answering `show hostnames` and `show node` as Slurm does for gpu[01-03]."""
    shims = tmp_path / "slurm-bin"
    shims.mkdir()
    (shims / "scontrol").write_text(
        '#!/bin/bash\n'
        'if [[ "$1 $2" == "show hostnames" ]]; then printf "gpu01\\ngpu02\\ngpu03\\n"\n'
        'elif [[ "$1 $2" == "show node" ]]; then\n'
        '  echo "NodeName=$3 Arch=x86_64 CoresPerSocket=48"\n'
        '  echo "   NodeAddr=127.0.0.1 NodeHostName=$3 Version=22.05.8"\n'
        'else exit 1; fi\n')
    (shims / "scontrol").chmod(0o755)
    return shims


def _env(shims=None, **extra):
    path = f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable,
               PATH=f"{shims}:{path}" if shims else path)
    env.update(extra)
    return env


def _dry_run(shims, *args, **extra) -> list[str]:
    env = _env(shims, SLURM_JOB_NODELIST="gpu[01-03]", SLURM_JOB_ID="77", SLURM_GPUS_ON_NODE="8",
               CONFIG="configs/qwen3_30b_a3b_r3_gspo.yaml", **extra)
    out = subprocess.run(["bash", str(SBATCH), *args], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return [line[2:] for line in out if line.startswith("+ ")]


def test_scripts_parse():
    for script in ("slurm_multinode.sbatch", "single_node.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], check=True)


def test_three_node_dry_run(slurm_shims, tmp_path):
    cmds = _dry_run(slurm_shims, "trainer.optim.lr=1e-6", f"logging.dir={tmp_path / 'run'}",
                    MOE_RL_HOST_IP="10.0.0.1")
    logs = f"{tmp_path / 'run'}/logs/slurm-77.0"
    assert cmds[0] == f"mkdir -p {logs}"
    # moe-rl doctor on every node first, with the run's keys and the job's shape
    for node, cmd in zip(("gpu01", "gpu02", "gpu03"), cmds[1:4]):
        assert cmd == (f"srun --overlap --nodes=1 --ntasks=1 -w {node} --output={logs}/doctor-"
                       f"{node}.log moe-rl doctor --config configs/qwen3_30b_a3b_r3_gspo.yaml "
                       f"cluster.num_nodes=3 cluster.gpus_per_node=8 trainer.optim.lr=1e-6 "
                       f"logging.dir={tmp_path / 'run'} &")
    cmds = cmds[:1] + cmds[4:]
    head = cmds[1]
    assert f"srun --overlap --nodes=1 --ntasks=1 -w gpu01 --output={logs}/ray-gpu01.log" in head
    assert "ray start --head --node-ip-address=10.0.0.1 --port=6379" in head
    assert head.endswith("--block &") and "--num-gpus=8" in head
    workers = cmds[2:4]
    for node, cmd in zip(("gpu02", "gpu03"), workers):
        assert f"-w {node} --output={logs}/ray-{node}.log" in cmd
        assert "ray start --address=10.0.0.1:6379" in cmd
        assert "--node-manager-port=6380" in cmd and "--object-manager-port=6381" in cmd
    wait = cmds[4]
    assert "moe_rl.launch_tools wait --address 10.0.0.1:6379 --nodes 3 --gpus 24 --timeout 900" \
        in wait
    train = cmds[5]
    assert train.startswith("moe-rl train --config configs/qwen3_30b_a3b_r3_gspo.yaml")
    for part in ("cluster.ray_address=10.0.0.1:6379", "cluster.num_nodes=3",
                 "cluster.gpus_per_node=8", "trainer.optim.lr=1e-6"):
        assert part in train
    assert not train.endswith("--resume")   # a first start: a used run directory is refused
    # teardown: each worker's Ray step told to end, then the head's; nothing else (`ray stop`
    # would stop every Ray of the user on the node, another job's too)
    assert cmds[6:] == [f"touch {logs}/.ray-stop-{n}" for n in ("gpu02", "gpu03", "gpu01")]


def test_doctor_can_be_told_to_warn_or_skipped_and_a_dry_run_writes_nothing(slurm_shims,
                                                                            tmp_path):
    def doctors(**extra):
        return [c for c in _dry_run(slurm_shims, f"logging.dir={tmp_path / 'run'}",
                                    MOE_RL_HOST_IP="10.0.0.1", **extra) if " doctor " in c]
    assert len(doctors()) == 3 and len(doctors(DOCTOR="warn")) == 3
    assert doctors(DOCTOR="0") == []
    assert not (tmp_path / "run").exists()   # DRY_RUN=1 only prints
    env = _env(slurm_shims, SLURM_JOB_NODELIST="gpu[01-03]", CONFIG="c.yaml", DOCTOR="yes")
    res = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True)
    assert res.returncode == 1 and "DOCTOR='yes': expected 1, warn or 0" in res.stderr


def test_a_requeued_job_resumes_and_resume_can_be_forced_or_refused(slurm_shims):
    def train(**extra):
        return next(c for c in _dry_run(slurm_shims, MOE_RL_HOST_IP="10.0.0.1", **extra)
                    if " train --config " in c)
    assert train(SLURM_RESTART_COUNT="1").endswith(" --resume")
    assert train(RESUME="1").endswith(" --resume")
    assert not train(RESUME="0", SLURM_RESTART_COUNT="2").endswith(" --resume")


def test_head_address_from_slurms_node_address_and_the_log_dir_from_the_config(slurm_shims):
    cmds = _dry_run(slurm_shims, "logging.dir=/shared/runs/x", DOCTOR="0")
    # no MOE_RL_HOST_IP: the head's NodeAddr as Slurm knows it (the shim says 127.0.0.1)
    assert "--node-ip-address=127.0.0.1 " in cmds[1]
    assert cmds[0] == "mkdir -p /shared/runs/x/logs/slurm-77.0"


@pytest.mark.parametrize("runtime", ["pyxis", "apptainer"])
def test_container_runs_ray_and_train_in_the_image_on_every_node(slurm_shims, runtime):
    cmds = _dry_run(slurm_shims, MOE_RL_HOST_IP="10.0.0.1", CONTAINER_IMAGE="nvcr.io/x/moe:1",
                    CONTAINER_RUNTIME=runtime, CONTAINER_MOUNTS="/shared")
    ray_and_train = [c for c in cmds if "ray start" in c or " train --config " in c
                     or "launch_tools wait" in c]
    assert len(ray_and_train) == 5
    for c in ray_and_train:
        assert c.startswith("srun --overlap --nodes=1 --ntasks=1 -w gpu0")
        if runtime == "pyxis":
            assert "--container-image=nvcr.io/x/moe:1 --container-mounts=/shared" in c
        else:
            assert "apptainer exec --nv --bind /shared" in c and " nvcr.io/x/moe:1 " in c
    assert cmds[0] == "mkdir -p <logging.dir>/logs/slurm-77.0"


def test_bad_container_runtime_is_refused(slurm_shims):
    env = _env(slurm_shims, SLURM_JOB_NODELIST="gpu[01-03]", CONFIG="c.yaml",
               MOE_RL_HOST_IP="10.0.0.1", CONTAINER_IMAGE="img", CONTAINER_RUNTIME="docker",
               LOG_DIR="/tmp/x")
    res = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True)
    assert res.returncode == 1 and "CONTAINER_RUNTIME=docker: expected pyxis or apptainer" \
        in res.stderr


def test_single_node_dry_run():
    out = subprocess.run(["bash", str(ROOT / "launch" / "single_node.sh"),
                          "configs/tiny_cpu.yaml", "trainer.steps=3"], env=_env(GPUS="0"),
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == ("+ moe-rl train --config configs/tiny_cpu.yaml cluster.num_nodes=1 "
                   "cluster.gpus_per_node=0 trainer.steps=3")


def test_single_node_finds_the_checkout_venv_when_moe_rl_is_not_on_path(tmp_path):
    """After `make`, moe-rl lives in .venv/bin, not on PATH: the script uses it (or says how
    to get it)."""
    import shutil
    bare = dict(os.environ, DRY_RUN="1", GPUS="0", PATH="/usr/bin:/bin")
    bare.pop("MOE_RL", None)
    venv_moe_rl = ROOT / ".venv" / "bin" / "moe-rl"
    if venv_moe_rl.exists():
        out = subprocess.run(["bash", str(ROOT / "launch" / "single_node.sh"),
                              "configs/tiny_cpu.yaml"], env=bare, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out.startswith(f"+ {venv_moe_rl} train --config configs/tiny_cpu.yaml")
    copy = tmp_path / "launch"
    copy.mkdir()
    shutil.copy(ROOT / "launch" / "single_node.sh", copy)   # a checkout without .venv
    res = subprocess.run(["bash", str(copy / "single_node.sh"), "configs/tiny_cpu.yaml"],
                         env=bare, capture_output=True, text=True)
    assert res.returncode == 127 and "run make" in res.stderr and "source .venv/bin/activate" \
        in res.stderr


def test_sbatch_passes_slurms_warning_signal_to_train_tears_down_and_requeues(tmp_path):
    """The batch script as Slurm runs it, with srun / scontrol / moe-rl as recording shims: the
    SIGUSR1 Slurm sends before the time limit reaches `moe-rl train`, whose exit status the
    job keeps, each node's Ray step is told to end afterwards (no user-wide `ray stop`), and
    the job requeues itself to go on."""
    import signal
    import time
    log = tmp_path / "calls.log"
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "srun").write_text(f'#!/bin/bash\necho "srun $*" >> {log}\n')
    (shims / "scontrol").write_text(
        f'#!/bin/bash\necho "scontrol $*" >> {log}\n'
        'if [[ "$1 $2" == "show hostnames" ]]; then echo n1; echo n2; fi\n')
    (shims / "train").write_text(
        f'#!/bin/bash\nif [[ "$1" == config ]]; then echo {tmp_path / "run"}; exit 0; fi\n'
        f'echo "train $*" >> {log}\n'
        f'trap \'echo "train got USR1" >> {log}; exit 138\' USR1\n'
        'while true; do sleep 0.1; done\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", PYTHON="true",
               MOE_RL=str(shims / "train"), CONFIG="c.yaml", SLURM_JOB_NODELIST="n[1-2]",
               SLURM_JOB_ID="41", SLURM_GPUS_ON_NODE="8", MOE_RL_HOST_IP="10.0.0.1")
    proc = subprocess.Popen(["bash", str(SBATCH), "trainer.optim.lr=1e-6"], env=env)
    deadline = time.monotonic() + 30
    while "train " not in (log.read_text() if log.exists() else "") and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=60) == 138
    calls = log.read_text()
    assert "train got USR1" in calls
    assert "train train --config c.yaml cluster.ray_address=10.0.0.1:6379" in calls and \
        "trainer.optim.lr=1e-6\n" in calls
    assert "ray stop" not in calls
    # each node's Ray step was told to end (workers first, then the head)
    logs = tmp_path / "run" / "logs" / "slurm-41.0"
    assert (logs / ".ray-stop-n1").exists() and (logs / ".ray-stop-n2").exists()
    assert calls.splitlines()[-1] == "scontrol requeue 41"


def test_a_usage_error_or_scancel_is_not_requeued(tmp_path):
    log = tmp_path / "calls.log"
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "srun").write_text("#!/bin/bash\n")
    (shims / "scontrol").write_text(
        f'#!/bin/bash\necho "scontrol $*" >> {log}\n'
        'if [[ "$1 $2" == "show hostnames" ]]; then echo n1; fi\n')
    (shims / "train").write_text(
        f'#!/bin/bash\nif [[ "$1" == config ]]; then echo {tmp_path / "run"}; exit 0; fi\n'
        'exit "$EXIT"\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    for code, requeued in (("2", False), ("1", True)):
        log.unlink(missing_ok=True)
        env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", PYTHON="true",
                   MOE_RL=str(shims / "train"), CONFIG="c.yaml", SLURM_JOB_NODELIST="n1",
                   SLURM_JOB_ID="5", MOE_RL_HOST_IP="10.0.0.1", EXIT=code, MAX_REQUEUES="1")
        res = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == int(code)
        assert ("scontrol requeue 5" in log.read_text()) == requeued, (code, res.stdout)
    env["SLURM_RESTART_COUNT"] = "1"   # MAX_REQUEUES reached
    res = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and "not requeued (MAX_REQUEUES=1)" in res.stderr
    log.unlink(missing_ok=True)   # leading zeros are decimal: 07 restarts of 08 still requeue
    env.update(SLURM_RESTART_COUNT="07", MAX_REQUEUES="08")
    res = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and "scontrol requeue 5" in log.read_text(), res.stderr


def test_leading_zeros_are_read_as_decimal(slurm_shims, tmp_path):
    """bash reads 08 as (invalid) octal: SLURM_GPUS_ON_NODE=08 plans the job as 8 does, and
    MAX_REQUEUES=08 still requeues a job restarted 7 times."""
    base = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "77",
            "CONFIG": str(ROOT / "configs" / "qwen3_30b_a3b_r3_gspo.yaml")}
    out = {}
    for gpus in ("8", "08", "008"):
        env = _env(slurm_shims, **base, SLURM_GPUS_ON_NODE=gpus)
        res = subprocess.run(["bash", str(SBATCH), f"logging.dir={tmp_path / 'run'}"], env=env,
                             capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert res.returncode == 0, res.stderr[-1000:]
        out[gpus] = res.stdout
    assert out["08"] == out["8"] == out["008"]
    assert "--num-gpus=8" in out["8"] or "gpus_per_node=8" in out["8"], out["8"][-2000:]


@pytest.mark.parametrize("name,value,named", [
    ("SLURM_GPUS_ON_NODE", "BASH_VERSINFO[$(touch PWN)0]", "SLURM_GPUS_ON_NODE / SLURM_GPUS_PER"),
    ("MAX_REQUEUES", "9" * 10, "MAX_REQUEUES='9999999999': expected a non-negative integer"),
    ("SLURM_RESTART_COUNT", "a[$(touch PWN)]", "SLURM_RESTART_COUNT="),
    ("MAX_REQUEUES", "three", "MAX_REQUEUES='three': expected a non-negative integer"),
    ("WAIT_TIMEOUT", "-5", "WAIT_TIMEOUT='-5'"),
])
def test_numeric_settings_are_plain_integers_before_any_arithmetic(slurm_shims, tmp_path, name,
                                                                   value, named):
    """bash evaluates array subscripts (and the $(...) in them) inside $((...)) and [[ -gt ]]:
    a crafted value ran a command. Each numeric setting is checked first: refused naming it,
    nothing run."""
    env = _env(slurm_shims, **{"SLURM_JOB_NODELIST": "gpu[01-03]", "SLURM_JOB_ID": "77",
                               "SLURM_GPUS_ON_NODE": "8",
                               "CONFIG": str(ROOT / "configs" / "qwen3_30b_a3b_r3_gspo.yaml"),
                               name: value})
    res = subprocess.run(["bash", str(SBATCH), f"logging.dir={tmp_path / 'run'}"], env=env,
                         capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 1 and named in res.stderr, res.stderr[-1000:]
    assert not (tmp_path / "PWN").exists() and not (ROOT / "PWN").exists()
