"""`moe-rl train` in the precision the GPU configs run, on CPU: the trainer in bfloat16 with
float32 master weights (megatron's mixed-precision optimizer) and the engine in bfloat16. A run
resumes exactly, its checkpoint and export round-trip in bfloat16, the EMA policy moves the
weights, and every replay mode and correction runs. `make test-loop` (CI) runs R3 with four
corrections and the shipped Qwen3 config; `make test-slow` adds R2, replay off, the other
corrections and the shipped DeepSeek-style config."""
import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import init_tiny_model
from tests.helpers import train_cli
from tests.loop.precision_runs import (ROOT, WEIGHTS_ONLY, rows_of, weights_in,
                                      whole_and_resumed, workdir, write_tiny_cpu_model)

BF16 = ("model.dtype=bfloat16", "rollout.engine_dtype=bfloat16")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_cpu_model(tmp_path_factory)


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_bf16_run_resumes_exactly_and_round_trips_in_bf16(tmp_path, model_dir):
    """Four deterministic steps in one go equal two steps, a stop and `--resume` for two more:
    every logged value and the final bfloat16 weights (the float32 master weights and Adam's
    state come back from the checkpoint). The export is bfloat16 and says so; converting the
    last checkpoint gives the same tensors; the engine (bf16) and the trainer (bf16) differ a
    little (k3 > 0) but route alike."""
    whole, parts = whole_and_resumed(tmp_path, model_dir, *BF16)
    rows = rows_of(whole)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows == rows_of(parts)
    assert all(0 < r["mismatch/k3"] < 1e-3 and r["routing/agreement"] > 0.95 for r in rows)
    assert json.loads((whole / "run" / "final_hf" / "config.json").read_text())["dtype"] == \
        "bfloat16"
    final, resumed = weights_in(whole / "run" / "final_hf"), weights_in(parts / "run" / "final_hf")
    start = weights_in(model_dir)
    assert final.keys() == resumed.keys() == start.keys()
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, resumed[k]) for k, v in final.items())
    assert any(not torch.equal(v, start[k].to(torch.bfloat16)) for k, v in final.items())
    out = tmp_path / "converted"
    subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", "--to", "hf", "--checkpoint",
                    str(whole / "run" / "checkpoints"), "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    converted = weights_in(out)
    assert all(torch.equal(converted[k], v) for k, v in final.items())


@pytest.mark.loop
@pytest.mark.e2e
# `make test-slow`; CI runs bfloat16 in the shipped Qwen3 config's run and on SGLang
@pytest.mark.slow
@pytest.mark.parametrize("replay,corrections,ema", [
    ("r3", "[token_tis,seq_mis,icepop,geo_rs]", True),
    ("r2", "[seq_tis,seq_rs,opsm,metropolis]", False),
    ("off", "[trm,snis]", False)])
def test_bf16_every_replay_mode_and_correction(tmp_path, model_dir, replay, corrections, ema):
    """Every replay mode and every correction through `moe-rl train` in bfloat16, two RL steps,
    weights synced over the process group: finite metrics, each correction's own metrics
    logged; with the EMA policy (decay 0.9 from step 0) the served policy moves off the initial
    weights."""
    work = workdir(tmp_path, model_dir, "run")
    extra = ["trainer.ema.decay=0.9", "trainer.ema.policy=true"] if ema else []
    extra += ["algorithm.correction.opsm_delta=1e-3", "algorithm.correction.trm_delta=1e-3"]
    res = train_cli(work, 2, *BF16, f"algorithm.replay={replay}",
                    f"algorithm.corrections={corrections}", "cluster.weight_sync=distributed",
                    *extra)
    # the bf16 policy's buckets go into the float32 checkpoint the engine started from (as into
    # SGLang, which loads an announced dtype into its own): no sync falls back to disk
    assert "weight sync (distributed) of version" not in res.stdout + res.stderr
    rows = rows_of(work)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert all(v is None or v == v for v in r.values() if isinstance(v, float))
        assert r["is/ess"] > 0
        for name in set(corrections.strip("[]").split(",")) - WEIGHTS_ONLY:   # masks log theirs
            assert 0 <= r[f"correction/{name}/masked_token_frac"] <= 1, name
        assert r["grad_norm"] >= 0 and r["mismatch/k3"] < 1e-3
    final, start = weights_in(work / "run" / "final_hf"), weights_in(model_dir)
    assert any(not torch.equal(v, start[k].to(torch.bfloat16)) for k, v in final.items())


CPU_SCALE = ["rollout.engine=reference", "rollout.num_servers=1", "rollout.engine_dtype=bfloat16",
             "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
             "rollout.max_new_tokens=8", "rollout.servers.concurrency=16", "trainer.parallel.expert=2",
             "cluster.num_nodes=1", "cluster.gpus_per_node=0", "cluster.trainer_workers=2",
             "data.source=toy", "data.path=null", "data.chat_template=false", "data.reward=toy"]


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.parametrize("config,model_config,extra", [
    ("qwen3_30b_a3b_r3_gspo.yaml", "tiny_cpu.yaml",
     ["rollout.max_oversample=8", "trainer.max_tokens_per_micro_batch=64"]),
    pytest.param("deepseek_style_r3_grpo.yaml", "deepseek_tiny_cpu.yaml", ["rollout.sampling.top_k=16"],
                 marks=pytest.mark.slow),
    # the one-GPU config (colocated, tensor sync on the shared GPU): on CPU the reference engine
    # is colocated too and synced from disk (the tensor sync needs SGLang on GPUs)
    pytest.param("tiny_one_gpu.yaml", "tiny_one_gpu.yaml", ["cluster.weight_sync=disk"],
                 marks=pytest.mark.slow),
    # GLM-4.5-Air's config on its own tiny twin (128 experts, top-8); tensor and sequence
    # parallelism are GPU-only in megatron-core's local spec
    pytest.param("glm45_air_r3_gspo.yaml", "glm45_air_r3_gspo.yaml",
                 ["trainer.parallel.tensor=1", "trainer.parallel.sequence=false",
                  "rollout.sampling.top_k=16", "trainer.max_tokens_per_micro_batch=64"],
                 marks=pytest.mark.slow),
    # gpt-oss-20b's config on its tiny twin (32 experts, top-4, windows, sinks, YaRN)
    pytest.param("gpt_oss_20b_r3_gspo.yaml", "gpt_oss_20b_r3_gspo.yaml",
                 ["rollout.sampling.top_k=16", "trainer.max_tokens_per_micro_batch=64"],
                 marks=pytest.mark.slow),
    # MiniMax-M2's config on its tiny twin (256 experts, top-8, the q/k norm over all heads)
    pytest.param("minimax_m2_r3_gspo.yaml", "minimax_m2_r3_gspo.yaml",
                 ["rollout.sampling.top_k=16", "trainer.max_tokens_per_micro_batch=64"],
                 marks=pytest.mark.slow)])   # CI runs the Qwen3 config; make test-slow all
def test_each_shipped_gpu_config_trains_in_bf16_on_cpu(tmp_path, config, model_config, extra):
    """Each shipped GPU config, run as shipped except for its scale (tiny model, one reference
    engine, 2 trainer ranks with expert parallel 2 instead of 16 with 8, toy data, gloo): its
    bfloat16 policy with every training option it sets (Qwen3: GSPO + seq-MIS, the fp32 LM
    head, the Polyak EMA, dynamic sampling, one step of staleness, packed rows under a token
    budget, recomputation, 4 mini-batches, LR warm-up, the collapse guard; DeepSeek-style: MLA
    and the biased router, PPO with dual clip, pi_old the mean of 4 engine passes over 32-token
    windows, the keep-sampling mask, IcePop + seq-MIS, the off-policy-corrected k3 KL;
    GLM-4.5-Air: the sigmoid router with its frozen expert bias, partial rotary, attention
    biases, R3 + GSPO + seq-MIS with the keep-sampling mask, retracted samples masked;
    gpt-oss-20b: sinks, sliding windows, YaRN, biases everywhere, the clamped SwiGLU, under the
    same algorithm; MiniMax-M2: the q/k norm over all heads, 256 experts, top-8) for three RL
    steps, weights synced over the process group with no fallback."""
    init_tiny_model(str(tmp_path / "model"), str(ROOT / "configs" / model_config))
    from tests.helpers import engine_base_port
    res = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--config", str(ROOT / "configs" / config),
         f"model.path={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}",
         "logging.progress=false", "trainer.steps=3", "trainer.checkpoint.interval=3",
         f"rollout.servers.base_port={engine_base_port()}", *CPU_SCALE, *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "weight sync (distributed) of version" not in res.stdout + res.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    # the trainer's own routers against the engine's choices (R3 replays the engine's): in
    # bfloat16 a top-8 of 128 sigmoid scores has more near-ties at its edge than a top-2 of 8
    # (GLM-4.5-Air's twin measured 0.87 here, MiniMax-M2's 0.96; every family is 1.0 in float32)
    floor = 0.8 if config.startswith("glm45") else 0.9
    for r in rows:
        assert r["mismatch/k3"] < 1e-3 and r["routing/agreement"] > floor
        assert all(v == v for v in r.values() if isinstance(v, float))
    cfg = json.loads((tmp_path / "run" / "final_hf" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.slow   # `make test-slow`: tests/rollout/test_partial.py runs them in float32
def test_bf16_partial_rollouts(tmp_path, model_dir):
    """Partial rollouts in the GPU configs' precision (bfloat16 engine and policy, fp32 master
    weights): responses span weight versions, each segment scored at its own version (R3 with
    the kept set); the same-version mismatch stays at bf16's level and nothing goes unscored."""
    work = workdir(tmp_path, model_dir, "run")
    train_cli(work, 6, *BF16, "rollout.partial.enabled=true", "rollout.max_staleness=2",
              "rollout.max_new_tokens=40", "algorithm.keep_sampling_mask=true",
              "rollout.sampling.top_k=20")
    rows = rows_of(work)
    assert max(r["rollout/partial_frac"] for r in rows) > 0.0
    for r in rows:
        assert 0 <= r["mismatch/k3"] < 1e-3 and r["routing/agreement"] > 0.95, r
        assert r["staleness/unscored_samples"] == 0.0
        assert r["rollout/token_version_lag_max"] <= 2.0
        assert all(v == v for v in r.values() if isinstance(v, float))
