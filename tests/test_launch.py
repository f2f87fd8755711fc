"""Slurm and single-node launchers in dry-run mode; the hostlist expander."""
import os
import pathlib
import subprocess
import sys

from moe_rl.launch_tools import expand_hostlist

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env(**extra):
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable,
               PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}")
    env.update(extra)
    return env


def test_hostlist_expansion():
    assert expand_hostlist("gpu[01-03]") == ["gpu01", "gpu02", "gpu03"]
    assert expand_hostlist("a[1,3-4]b,login7") == ["a1b", "a3b", "a4b", "login7"]
    assert expand_hostlist("node9") == ["node9"]


def test_scripts_parse():
    for script in ("slurm_multinode.sbatch", "single_node.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], check=True)


def test_three_node_dry_run():
    env = _env(SLURM_JOB_NODELIST="gpu[01-03]", SLURM_JOB_NUM_NODES="3",
               SLURM_GPUS_ON_NODE="8", CONFIG="configs/qwen3_30b_a3b_r3_gspo.yaml",
               MOE_RL_HOST_IP="10.0.0.1")
    out = subprocess.run(["bash", str(ROOT / "launch" / "slurm_multinode.sbatch"),
                          "trainer.lr=1e-6"], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    cmds = [line[2:] for line in out if line.startswith("+ ")]
    head = cmds[0]
    assert "-w gpu01 ray start --head --node-ip-address=10.0.0.1 --port=6379" in head
    assert head.endswith("--block &") and "--num-gpus=8" in head
    workers = cmds[1:3]
    for node, cmd in zip(("gpu02", "gpu03"), workers):
        assert f"srun --nodes=1 --ntasks=1 -w {node} ray start --address=10.0.0.1:6379" in cmd
        assert "--node-manager-port=6380" in cmd and "--object-manager-port=6381" in cmd
    wait = cmds[3]
    assert "moe_rl.launch_tools wait --address 10.0.0.1:6379 --nodes 3 --gpus 24" in wait
    train = cmds[4]
    assert train.startswith("moe-rl train --config configs/qwen3_30b_a3b_r3_gspo.yaml")
    for part in ("cluster.ray_address=10.0.0.1:6379", "cluster.num_nodes=3",
                 "cluster.gpus_per_node=8", "trainer.lr=1e-6"):
        assert part in train
    assert train.endswith(" --resume")   # a requeued job continues its run
    teardown = cmds[5:]
    assert [c.split("-w ")[1].split()[0] for c in teardown] == ["gpu01", "gpu02", "gpu03"]
    assert all("ray stop" in c for c in teardown)


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


def test_sbatch_passes_slurms_warning_signal_to_train_and_tears_down(tmp_path):
    """The batch script as Slurm runs it, with srun / python / moe-rl as recording shims: the
    SIGUSR1 Slurm sends before the time limit reaches `moe-rl train`, whose exit status the
    job keeps, and Ray is stopped on every node afterwards."""
    import signal
    import time
    log = tmp_path / "calls.log"
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "srun").write_text(f'#!/bin/bash\necho "srun $*" >> {log}\n')
    (shims / "py").write_text('#!/bin/bash\nif [[ "$3" == expand ]]; then echo n1; echo n2; fi\n')
    (shims / "train").write_text(
        f'#!/bin/bash\necho "train $*" >> {log}\n'
        f'trap \'echo "train got USR1" >> {log}; exit 138\' USR1\n'
        'while true; do sleep 0.1; done\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}", PYTHON=str(shims / "py"),
               MOE_RL=str(shims / "train"), CONFIG="c.yaml", SLURM_JOB_NODELIST="n[1-2]",
               SLURM_GPUS_ON_NODE="8", MOE_RL_HOST_IP="10.0.0.1")
    proc = subprocess.Popen(["bash", str(ROOT / "launch" / "slurm_multinode.sbatch"),
                             "trainer.lr=1e-6"], env=env)
    deadline = time.monotonic() + 30
    while "train " not in (log.read_text() if log.exists() else "") and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 138
    calls = log.read_text()
    assert "train got USR1" in calls
    assert "train train --config c.yaml cluster.ray_address=10.0.0.1:6379" in calls and \
        "trainer.lr=1e-6 --resume" in calls
    stops = [line for line in calls.splitlines() if "ray stop" in line]
    assert [s.split("-w ")[1].split()[0] for s in stops] == ["n1", "n2"]
