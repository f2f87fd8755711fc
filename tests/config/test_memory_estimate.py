"""The memory estimates of `moe-rl plan` (moe_rl/config/memory_estimate.py): parameters counted on
transformers' model of Qwen3-30B-A3B's published config.json (built on the meta device), each
term of one trainer GPU and one SGLang GPU worked by hand, and the command printing them with
the idle-GPU warning."""
import json
import subprocess
import sys

import pytest

from moe_rl.config import load_config
from moe_rl.engines.factory import engine_kind
from moe_rl.config.memory_estimate import ParamCounts, param_counts, trainer_memory
from moe_rl.config.release_shapes import RELEASES
from tests.helpers import ROOT

QWEN3_30B_A3B = RELEASES["Qwen3-30B-A3B"]
GIB = 1 << 30
COUNTS = ParamCounts(experts=48 * 128 * 3 * 2048 * 768, embedding=2 * 151936 * 2048,
                     dense=918_763_520)


def test_qwen3_30b_a3b_counts_its_published_30_5b_parameters():
    """Experts: 48 layers x 128 x (gate, up, down) of 2048 x 768; the embedding and the untied
    head 151936 x 2048 each; the rest (attention, norms, routers) from the model itself."""
    counts = param_counts(QWEN3_30B_A3B)
    assert counts == COUNTS
    assert counts.total == 30_532_122_624   # "30.5B in total" (the model card)
    per_layer_attention = 2048 * 32 * 128 * 2 + 2048 * 4 * 128 * 2 + 2 * 128
    per_layer = per_layer_attention + 2 * 2048 + 128 * 2048   # norms, router
    assert counts.dense == 48 * per_layer + 2048   # and the final norm


def test_one_trainer_gpu_of_the_four_node_config_worked_by_hand():
    """16 ranks, EP 8, bfloat16, distributed optimizer, EMA, recompute, 16384-token
    micro-batches (configs/qwen3_30b_a3b_r3_gspo.yaml)."""
    cfg = load_config(str(ROOT / "configs" / "qwen3_30b_a3b_r3_gspo.yaml"))
    m = trainer_memory(cfg, QWEN3_30B_A3B, COUNTS, seq_len=4096)
    dense, experts = COUNTS.dense + COUNTS.embedding, COUNTS.experts / 8
    params = dense + experts
    assert m.weights == pytest.approx(2 * params)
    assert m.gradients == pytest.approx(4 * params)   # float32 gradient buffers
    # Adam m, v and the float32 master weights, sharded: dense over DP 16, experts over
    # expert DP 16 / 8 = 2
    assert m.optimizer == pytest.approx(12 * (dense / 16 + experts / 2))
    assert m.ema == pytest.approx(4 * params) and m.reference == 0   # the float32 EMA
    assert m.tokens == 16384
    # recompute: 2h bytes kept per token and layer, and one MoE layer's 15h + 19h * 8 * 768 / 4h
    one_layer = 15 * 2048 + 19 * 2048 * (8 * 768) / (4 * 2048)
    assert m.activations == pytest.approx(16384 * (2 * 2048 * 48 + one_layer))
    assert m.logits == pytest.approx(1024 * 151936 * 4 * 2 + 16384 * 2048 * 4)
    assert 70 * GIB < m.total < 80 * GIB


def test_without_recompute_every_layer_keeps_its_activations_and_tp_cp_split_them():
    cfg = load_config(str(ROOT / "configs" / "qwen3_30b_a3b_r3_gspo.yaml"), [
        "trainer.recompute_activations=false", "trainer.parallel.tensor=2",
        "trainer.parallel.sequence=true", "trainer.parallel.context=2",
        "trainer.parallel.expert=4", "trainer.optim.distributed=false",
        "trainer.ema.decay=null"])
    m = trainer_memory(cfg, QWEN3_30B_A3B, COUNTS, seq_len=4096)
    params = (COUNTS.dense + COUNTS.embedding) / 2 + COUNTS.experts / 8
    assert m.optimizer == pytest.approx(12 * params) and m.ema == 0
    one_layer = 15 * 2048 + 19 * 2048 * (8 * 768) / (4 * 2048)
    assert m.tokens == 16384 / 2
    assert m.activations == pytest.approx(8192 * 48 * one_layer / 2)


def test_one_sglang_gpu_holds_its_weight_share_and_the_rest_of_its_fraction_as_kv():
    cfg = load_config(str(ROOT / "configs" / "qwen3_30b_a3b_r3_gspo.yaml"))
    e = engine_kind(cfg).gpu_memory(QWEN3_30B_A3B, COUNTS.total, 80 * GIB)   # TP 4, 0.8
    assert e.weights == pytest.approx(COUNTS.total * 2 / 4)
    assert e.kv_pool == pytest.approx(0.8 * 80 * GIB - e.weights)
    # K and V of 48 layers, 4 KV heads over 4 GPUs, head_dim 128, bfloat16
    assert e.kv_tokens == int(e.kv_pool // (2 * 48 * 1 * 128 * 2))
    mla = dict(QWEN3_30B_A3B, kv_lora_rank=512, qk_rope_head_dim=64)
    assert engine_kind(cfg).gpu_memory(mla, COUNTS.total, 80 * GIB).kv_tokens == \
        int(e.kv_pool // (48 * (512 + 64) * 2))
    cpu = load_config(str(ROOT / "configs" / "tiny_cpu.yaml"))
    assert engine_kind(cpu).gpu_memory(QWEN3_30B_A3B, COUNTS.total, 80 * GIB) is None


def test_moe_rl_plan_prints_the_layout_the_memory_and_the_idle_gpus(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "plan", "--config",
                          str(ROOT / "configs" / "qwen3_30b_a3b_r3_gspo.yaml"), "--no-inputs",
                          f"model.path={tmp_path}", "--nodes", "8", "--gpu-memory-gib", "40"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert ("trainer ranks: TP 1 x CP 1 x DP 16 x PP 1 (experts: EP 8 x expert DP 2 x PP 1)"
            in out)
    assert "  trainer 9    tp 0  cp 0  dp 9  pp 0  ep 1  edp 1" in out
    assert "memory per trainer GPU (estimate, micro-batches of 16384 tokens): weights 9.6 GiB" \
        in out and "total 74.6 GiB of 40.0 GiB" in out
    assert "warning: the trainer's estimate (74.6 GiB) exceeds the 40.0 GiB of a GPU" in out
    assert "memory per SGLang GPU (estimate): weights 14.2 GiB, KV pool 17.8 GiB" in out
    assert "warning: 32 of the 8 x 8 GPUs are idle in this plan" in out


def test_plan_estimates_a_shipped_config_before_its_checkpoint_and_warns_without_headroom(
        tmp_path):
    """The shipped 4-node Qwen3 config on its 80 GiB GPUs, /models/Qwen3-30B-A3B absent: the
    release's published shape, 93 % of the GPU (under the 10 % headroom docs/clusters.md asks)
    warned with the biggest parts, the float32 EMA named; a tiny config's model.init shape; the
    KV pool's tokens grouped."""
    def plan(config, *extra):
        got = subprocess.run([sys.executable, "-m", "moe_rl.cli", "plan", "--config", config,
                              "--no-inputs", *extra], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert got.returncode == 0, got.stderr[-2000:]
        return got.stdout
    out = plan("qwen3_30b_a3b_r3_gspo")
    assert ("no config.json in model.path (/models/Qwen3-30B-A3B) yet: memory estimated for "
            "Qwen3-30B-A3B's published shape") in out
    assert "total 74.6 GiB of 80.0 GiB (93%)" in out
    warning = next(line for line in out.splitlines() if "headroom" in line)
    assert warning.startswith("warning: the trainer's estimate (74.6 GiB, 93% of 80.0 GiB) "
                              "leaves less than the 10% headroom")
    assert ("the biggest parts: optimizer (Adam's moments, float32 master weights) 21.3 GiB; "
            "gradients (float32) 19.2 GiB; EMA (float32; only the final export reads it")\
        in warning
    assert "KV pool 49.8 GiB (~2,175,025 tokens per server)" in out
    assert "headroom" not in plan("qwen3_30b_a3b_r3_gspo", "trainer.ema.decay=null")
    tiny = plan("tiny_one_gpu", f"model.path={tmp_path}/none")
    assert "memory estimated for the model.init shape" in tiny and "headroom" not in tiny


GLM45_AIR = RELEASES["GLM-4.5-Air"]


def test_the_glm45_air_config_fits_its_80_gib_gpus():
    """configs/glm45_air_r3_gspo.yaml: GLM-4.5-Air's 106.9B parameters (its card: 106B; the
    MTP layer is not built) on 64 trainer ranks, TP 2 x DP 32, EP 16 x expert DP 2 (each expert
    split over the tensor-parallel pair too, megatron-core's default), and two
    SGLang servers of TP 8, each GPU's estimate inside 80 GiB with room to spare."""
    cfg = load_config(str(ROOT / "configs" / "glm45_air_r3_gspo.yaml"))   # layout checked
    counts = param_counts(GLM45_AIR)
    # 45 MoE layers x 128 experts x (gate, up, down) of 4096 x 1408
    assert counts.experts == 45 * 128 * 3 * 4096 * 1408
    assert counts.embedding == 2 * 151552 * 4096
    assert round(counts.total / 1e9, 1) == 106.9
    m = trainer_memory(cfg, GLM45_AIR, counts, seq_len=4096)
    dense, experts = (counts.dense + counts.embedding) / 2, counts.experts / (16 * 2)
    assert m.weights == pytest.approx(2 * (dense + experts))
    assert m.optimizer == pytest.approx(12 * (dense / 32 + experts / 2))
    assert 55 * GIB < m.total < 65 * GIB
    e = engine_kind(cfg).gpu_memory(GLM45_AIR, counts.total, 80 * GIB)   # TP 8, 0.7
    assert e.weights == pytest.approx(counts.total * 2 / 8)
    assert e.kv_pool == pytest.approx(0.7 * 80 * GIB - e.weights) and e.kv_pool > 30 * GIB


GPT_OSS_20B = RELEASES["gpt-oss-20b"]


def test_the_gpt_oss_20b_config_fits_its_80_gib_gpus():
    """configs/gpt_oss_20b_r3_gspo.yaml: gpt-oss-20b's 20.9B parameters (its card: 21B;
    gpt-oss-120b's shape, 36 layers of 128 experts, counts its card's 117B) on 8 trainer ranks,
    EP 8 without tensor parallelism, and 8 SGLang servers of one GPU each: each GPU's estimate
    inside 80 GiB."""
    cfg = load_config(str(ROOT / "configs" / "gpt_oss_20b_r3_gspo.yaml"))
    counts = param_counts(GPT_OSS_20B)
    # 24 layers x 32 experts x (gate_up [2880, 5760] + its bias, down [2880, 2880] + its bias)
    assert counts.experts == 24 * 32 * (2880 * 5760 + 5760 + 2880 * 2880 + 2880)
    assert counts.embedding == 2 * 201088 * 2880
    assert round(counts.total / 1e9, 1) == 20.9
    bigger = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
              "layer_types": ["sliding_attention", "full_attention"] * 18}
    assert round(param_counts(bigger).total / 1e9) == 117
    m = trainer_memory(cfg, GPT_OSS_20B, counts, seq_len=4096)
    dense, experts = counts.dense + counts.embedding, counts.experts / 8
    assert m.weights == pytest.approx(2 * (dense + experts))
    assert m.optimizer == pytest.approx(12 * (dense / 8 + experts))
    assert 50 * GIB < m.total < 65 * GIB
    e = engine_kind(cfg).gpu_memory(GPT_OSS_20B, counts.total, 80 * GIB)   # TP 1, 0.8
    assert e.weights == pytest.approx(counts.total * 2)
    assert e.kv_pool == pytest.approx(0.8 * 80 * GIB - e.weights) and e.kv_pool > 20 * GIB


MINIMAX_M2 = RELEASES["MiniMax-M2"]


def test_the_minimax_m2_config_fits_its_141_gib_gpus():
    """configs/minimax_m2_r3_gspo.yaml: MiniMax-M2's 228.7B parameters (its card: 230B) on 64
    trainer ranks at EP 64 without tensor parallelism, and two SGLang servers of TP 8, each
    GPU's estimate inside an H200's 141 GiB."""
    cfg = load_config(str(ROOT / "configs" / "minimax_m2_r3_gspo.yaml"))
    counts = param_counts(MINIMAX_M2)
    # 62 layers x 256 experts x (gate, up, down) of 3072 x 1536
    assert counts.experts == 62 * 256 * 3 * 3072 * 1536
    assert round(counts.total / 1e9, 1) == 228.7
    m = trainer_memory(cfg, MINIMAX_M2, counts, seq_len=4096)
    dense, experts = counts.dense + counts.embedding, counts.experts / 64
    assert m.weights == pytest.approx(2 * (dense + experts))
    assert m.optimizer == pytest.approx(12 * (dense / 64 + experts))
    assert 80 * GIB < m.total < 110 * GIB
    e = engine_kind(cfg).gpu_memory(MINIMAX_M2, counts.total, 141 * GIB)   # TP 8, 0.85
    assert e.weights == pytest.approx(counts.total * 2 / 8)
    assert e.kv_pool == pytest.approx(0.85 * 141 * GIB - e.weights) and e.kv_pool > 50 * GIB
