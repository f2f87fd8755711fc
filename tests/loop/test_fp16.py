"""`moe-rl train` in float16 on CPU: the trainer in float16 with float32 master weights and
megatron's dynamic loss scaler, the engine in float16, the LM head in float32 on both sides.
`make test-loop` (CI) runs R3 with four corrections and the EMA policy; `make test-slow` adds R2
against a bfloat16 engine (the mixed pair, warned about), replay off, the other corrections,
and a resume that continues exactly with the scaler's state."""
import pytest
import torch

from tests.helpers import train_cli
from tests.loop.precision_runs import (WEIGHTS_ONLY, rows_of, weights_in, whole_and_resumed,
                                      workdir, write_tiny_cpu_model)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_cpu_model(tmp_path_factory)

FP16 = ("model.dtype=float16", "model.fp32_output_layer=true",
        "trainer.loss_scale.initial=65536")


@pytest.mark.loop
@pytest.mark.e2e
# `make test-slow`; CI runs float16 in the loss scaler's run below and on SGLang
@pytest.mark.slow
@pytest.mark.parametrize("replay,corrections,engine", [
    ("r3", "[token_tis,seq_mis,icepop,geo_rs]", "float16"),
    ("r2", "[seq_tis,seq_rs,opsm,metropolis]", "bfloat16"),
    ("off", "[trm,snis]", "float16")])
def test_fp16_every_replay_mode_and_correction(tmp_path, model_dir, replay, corrections,
                                               engine):
    """Every replay mode and correction through `moe-rl train` in float16, two RL steps after
    two warm-start steps, weights synced over the process group: finite metrics, each
    correction's own metrics, the loss scale and the skipped steps logged (none skipped at
    2^16), the engine started with the fp32 head, the export float16; a bfloat16 engine is
    warned about by name."""
    work = workdir(tmp_path, model_dir, "run")
    extra = ["trainer.ema.decay=0.9", "trainer.ema.policy=true"] if replay == "r3" else []
    extra += ["algorithm.correction.opsm_delta=1e-3", "algorithm.correction.trm_delta=1e-3"]
    res = train_cli(work, 2, *FP16, f"rollout.engine_dtype={engine}",
                    f"algorithm.replay={replay}", f"algorithm.corrections={corrections}",
                    "cluster.weight_sync=distributed", *extra)
    out = res.stdout + res.stderr
    assert "weight sync (distributed) of version" not in out
    assert ("float16 and bfloat16 round to different grids" in res.stderr) == \
        (engine == "bfloat16")
    assert "--enable-fp32-lm-head" in (work / "run" / "plan.json").read_text()
    rows = rows_of(work)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert all(v is None or v == v for v in r.values() if isinstance(v, float))
        assert r["train/loss_scale"] == 65536 and r["train/skipped_steps"] == 0
        assert r["is/ess"] > 0
        for name in set(corrections.strip("[]").split(",")) - WEIGHTS_ONLY:
            assert 0 <= r[f"correction/{name}/masked_token_frac"] <= 1, name
        assert r["grad_norm"] >= 0 and r["mismatch/k3"] < 1e-3
    final, start = weights_in(work / "run" / "final_hf"), weights_in(model_dir)
    assert all(v.dtype == torch.float16 for v in final.values())
    assert any(not torch.equal(v, start[k].to(torch.float16)) for k, v in final.items())


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.slow   # tests/trainer/test_fp16.py resumes the scaler exactly in CI
def test_fp16_run_resumes_exactly_with_the_loss_scaler(tmp_path, model_dir):
    """Megatron's default initial scale (2^32) skips the first steps (warm start included):
    four deterministic steps in one go equal two, a stop and `--resume` for two more, every
    logged value (loss scale and skipped steps too) and the final float16 weights."""
    whole, parts = whole_and_resumed(tmp_path, model_dir, "model.dtype=float16",
                                     "rollout.engine_dtype=float16")
    rows = rows_of(whole)
    assert rows == rows_of(parts)
    assert rows[0]["train/skipped_steps"] == 1 and rows[0]["train/loss_scale"] < 2.0 ** 32
    final, resumed = weights_in(whole / "run" / "final_hf"), weights_in(parts / "run" / "final_hf")
    assert all(v.dtype == torch.float16 and torch.equal(v, resumed[k]) for k, v in final.items())


@pytest.mark.loop
@pytest.mark.e2e
def test_a_loss_scale_at_its_minimum_ends_the_run_with_one_line(tmp_path, model_dir):
    """The first RL step overflows at 2^32, the scale halves to its minimum (2^31, hysteresis
    1): `moe-rl train` exits 1 with one line naming trainer.loss_scale.min, no traceback."""
    import subprocess
    import sys
    from tests.helpers import engine_base_port
    work = workdir(tmp_path, model_dir, "run")
    res = subprocess.run(
        [sys.executable, "-m", "moe_rl.cli", "train", "--config", "tiny_cpu.yaml",
         f"model.path={work / 'model'}", f"logging.dir={work / 'run'}", "trainer.steps=2",
         "trainer.warmup.steps=0", "logging.progress=false",
         f"rollout.servers.base_port={engine_base_port()}", "rollout.prompts_per_step=4",
         "rollout.n_samples_per_prompt=4", "model.dtype=float16",
         "rollout.engine_dtype=float16", "trainer.loss_scale.initial=4294967296",
         "trainer.loss_scale.min=2147483648", "trainer.loss_scale.hysteresis=1"],
        cwd=work, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-rl train: trainer.loss_scale.min: the float16 loss scale fell "
                           "to its minimum (2.14748e+09)"), last
    assert "Traceback" not in res.stderr
