"""What a new user's first runs say (the first hour, round 3), through `moe-rl train`: a run
that learns nothing says so with the likely causes; float16's skipped steps show on the
progress line, the default loss scale skips none of the warm start, and a float16 trainer
against the float32 engine default is warned about."""
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, engine_base_port, init_tiny_model

SMALL = ("rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
         "trainer.checkpoint.interval=100", "logging.progress=true")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("first_hour") / "model")


def train(model, run, *overrides, env=None):
    got = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--config",
         str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={model}", f"logging.dir={run}",
         f"rollout.servers.base_port={engine_base_port()}", *SMALL, *overrides],
        cwd=run.parent, capture_output=True, text=True, timeout=600, env=env)
    assert got.returncode == 0, got.stderr[-3000:]
    return got


@pytest.mark.loop
@pytest.mark.e2e
def test_a_run_whose_rewards_are_all_zero_says_it_learns_nothing(model, tmp_path):
    (tmp_path / "zero_reward.py").write_text(
        "def zero(prompt, response, answer, metadata):\n    return 0.0\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    got = train(model, tmp_path / "run", "trainer.steps=3", "trainer.warmup.steps=0",
                "data.reward=zero_reward:zero", env=env)
    said = [line for line in got.stdout.splitlines() if "no learning signal" in line]
    assert len(said) == 1, got.stdout[-3000:]
    assert said[0].startswith("warning: step 2: no learning signal for 3 steps")
    assert "(every reward 0; advantage/zero_frac 1)" in said[0]
    assert "warm it up with trainer.warmup.steps" in said[0]
    assert "the reward (zero_reward:zero)" in said[0]


@pytest.mark.loop
@pytest.mark.e2e
def test_float16_skipped_steps_show_and_the_default_scale_skips_none(model, tmp_path):
    """At a scale every gradient overflows, each warm-start step is skipped and the progress
    line counts them; at the default (2^14) none of four is, and model.dtype=float16 set alone
    is warned about (the engine stays float32)."""
    fp16 = ("model.dtype=float16", "trainer.steps=1", "trainer.warmup.steps=4")
    high = train(model, tmp_path / "high", *fp16, "rollout.engine_dtype=float16",
                 "trainer.loss_scale.initial=1e18")
    lines = [ln for ln in high.stdout.splitlines() if ln.startswith("warm start")]
    assert [ln.split(" | ")[2] for ln in lines[:4]] == [f"skipped {n}" for n in (1, 2, 3, 4)]
    assert lines[4].startswith("warm start: 4 supervised steps (4 skipped: float16 gradients "
                               "overflowed at the loss scale)")
    assert "rollout.engine_dtype=float32" not in high.stderr
    default = train(model, tmp_path / "default", *fp16)
    progress = [ln for ln in default.stdout.splitlines() if ln.startswith(("warm start", "RL "))]
    assert len(progress) == 6 and not any("skipped" in ln for ln in progress), progress
    assert ("warning: rollout.engine_dtype=float32: the engine serves in float32 while the "
            "trainer trains in float16") in default.stderr


@pytest.mark.loop
@pytest.mark.e2e
def test_a_float16_run_whose_every_step_was_skipped_does_not_end_as_a_success(model, tmp_path):
    """A loss scale far too high that never comes down within the run (hysteresis 1000):
    every RL step's update is skipped, and the run ends in failure saying so, not `run
    finished`."""
    run = tmp_path / "run"
    (tmp_path / "length_reward.py").write_text(   # rewards that differ: gradients to overflow
        "def by_length(prompt, response, answer, metadata):\n"
        "    return float(sum(map(ord, response)) % 7)\n")
    got = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--config",
         str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={model}", f"logging.dir={run}",
         f"rollout.servers.base_port={engine_base_port()}", *SMALL, "trainer.steps=2",
         "trainer.warmup.steps=0", "model.dtype=float16", "rollout.engine_dtype=float16",
         "trainer.loss_scale.initial=1e18", "trainer.loss_scale.hysteresis=1000",
         "data.reward=length_reward:by_length", "rollout.n_samples_per_prompt=4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"))
    assert got.returncode == 1, got.stdout[-2000:] + got.stderr[-2000:]
    assert got.stderr.strip().splitlines()[-1].startswith(
        "moe-rl train: every optimizer step of the run's 2 RL steps was skipped")
