"""Fixtures shared across test modules."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def train_cli(workdir, steps, *extra, resume=False, config="tiny_cpu.yaml"):
    """`moe-rl train` of the tiny CPU config (or ``config`` of configs/) in ``workdir`` (model in workdir/model, run in
    workdir/run): SFT warm start, checkpoints every 2 steps; returns the finished process.
    ``rollout.base_port`` is held busy by another socket all along: the engine must skip it."""
    from moe_rl.engines.process import bind_port
    from moe_rl.trainer.parallel import free_port
    with bind_port("127.0.0.1", free_port()) as busy:
        cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config",
               str(ROOT / "configs" / config), f"model.path={workdir / 'model'}",
               f"logging.dir={workdir / 'run'}", f"trainer.steps={steps}",
               "trainer.sft_warmup_steps=2", "trainer.save_interval=2", "logging.progress=false",
               f"rollout.base_port={busy.getsockname()[1]}", "rollout.prompts_per_step=4",
               "rollout.n_samples_per_prompt=4", *extra]
        if resume:
            cmd.append("--resume")
        res = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """One short real run (3 steps, IcePop then seq-MIS, a HF export at step 2), shared by the
    loop, convert and report tests; tests that change it work on a copy."""
    base = tmp_path_factory.mktemp("trained")
    subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config",
                    str(ROOT / "configs" / "tiny_cpu.yaml"), "--out", str(base / "model")],
                   check=True, capture_output=True, timeout=120)
    train_cli(base, 3, "algorithm.corrections=[icepop,seq_mis]", "trainer.export_hf_interval=2")
    return base


@pytest.fixture(scope="module")
def parallel_state():
    """megatron's process groups for a one-process trainer (a module's own fixture of this name
    takes precedence)."""
    from moe_rl.trainer.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel()
    yield
