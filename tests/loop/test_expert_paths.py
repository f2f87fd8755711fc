"""`moe-rl train` with each expert path (trainer.experts): the grouped GEMMs and megatron's
loop give the same run, metric for metric, at zero mismatch on identical float32 engine and
trainer; a checkpoint written on one path resumes on the other and continues as the first
would; bfloat16 with float32 master weights trains on the grouped path."""
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, WALL_CLOCK, engine_base_port, init_tiny_model

pytestmark = [pytest.mark.loop, pytest.mark.e2e]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return init_tiny_model(tmp_path_factory.mktemp("expert_paths") / "model")


def train(model, run, *overrides, resume=()):
    got = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--config",
         str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={model}", f"logging.dir={run}",
         f"rollout.servers.base_port={engine_base_port()}", "rollout.prompts_per_step=2",
         "rollout.n_samples_per_prompt=2", "trainer.warmup.steps=2",
         "trainer.checkpoint.interval=1", "rollout.sglang.deterministic_inference=true",
         "logging.progress=false", *overrides, *resume],
        cwd=run.parent, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    return got


def rows(run):
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)}
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "kind" not in r]


def test_both_paths_train_the_same_run_and_a_checkpoint_crosses_them(model, tmp_path):
    grouped = train(model, tmp_path / "grouped", "trainer.steps=3", "trainer.experts=grouped")
    loop = train(model, tmp_path / "loop", "trainer.steps=3", "trainer.experts=sequential")
    assert "trainer experts: grouped (torch._grouped_mm over the local experts)" \
        in grouped.stdout
    assert "trainer experts: sequential (trainer.experts=sequential" in loop.stdout
    assert "trainer attention: sdpa (torch's scaled_dot_product_attention)" in grouped.stdout
    assert "trainer dispatch: sort (every expert local" in grouped.stdout
    want, got = rows(tmp_path / "loop"), rows(tmp_path / "grouped")
    assert [r["step"] for r in got] == [0, 1, 2]
    for a, b in zip(want, got):
        assert a == b   # bit for bit: the same losses, gradients, updates and samples
        assert b["mismatch/k3"] < 1e-6 and b["routing/agreement"] == 1.0
    # the grouped run's step-2 checkpoint resumed on the loop: its step 2 is the grouped one's
    crossed = tmp_path / "crossed"
    shutil.copytree(tmp_path / "grouped", crossed)
    shutil.rmtree(crossed / "checkpoints" / "iter_0000003")
    (crossed / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    again = train(model, crossed, "trainer.steps=3", "trainer.experts=sequential",
                  resume=("--resume",))
    assert "resuming at step 2" in again.stdout
    assert rows(crossed)[2] == got[2]


def test_bfloat16_with_float32_master_weights_trains_grouped(model, tmp_path):
    train(model, tmp_path / "bf16", "trainer.steps=2", "trainer.experts=grouped",
          "model.dtype=bfloat16", "rollout.engine_dtype=bfloat16")
    got = rows(tmp_path / "bf16")
    assert [r["step"] for r in got] == [0, 1]
    for r in got:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        assert r["mismatch/k3"] < 1e-3
    # the warm start and the steps moved the expert weights (float32 master copies, bf16 out)
    from safetensors.torch import load_file
    start, final = (load_file(str(d / "model.safetensors"))
                    for d in (model, tmp_path / "bf16" / "final_hf"))
    experts = [k for k in start if ".experts." in k]
    assert experts and all(final[k].dtype == torch.bfloat16 for k in experts)
    assert any(not torch.equal(final[k].float(), start[k].float()) for k in experts)
