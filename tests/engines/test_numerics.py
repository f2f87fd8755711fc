"""The reference engine's real numerical differences from the trainer: batch-variant split-KV
attention (a sequence's last bits depend on the batch it runs in; deterministic inference fixes
the split), checked against transformers' own attention and through `moe-rl train`."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from moe_rl.engines.reference import split_kv
from moe_rl.trainer.parallel import free_port
from tests.helpers import init_tiny_model
from tests.helpers import engine_base_port
from tests.helpers import assert_serves_like, write_tiny_qwen

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_chunk_bounds_follow_the_batch():
    """More rows -> fewer splits (the work slots fill up); deterministic: fixed chunks."""
    counts = [len(split_kv.chunk_bounds(b, 2, 12, False)) - 1 for b in (1, 4, 8, 16, 32, 64)]
    assert counts == [12, 8, 4, 2, 1, 1]
    assert split_kv.chunk_bounds(8, 2, 40, True) == [0, 16, 32, 40]
    assert split_kv.chunk_bounds(1, 2, 40, True) == split_kv.chunk_bounds(64, 8, 40, True)
    b = split_kv.chunk_bounds(4, 2, 10, False)
    assert b[0] == 0 and b[-1] == 10 and all(x < y for x, y in zip(b, b[1:]))


def _attention_reference(q, k, v, mask):
    """float64 softmax attention with GQA and an additive mask."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = q.double() @ k.transpose(2, 3) / q.shape[-1] ** 0.5 + mask.double()
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def test_split_kv_equals_softmax_attention_in_float32():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 5, 8), torch.randn(3, 2, 9, 8), torch.randn(3, 2, 9, 6)
    allowed = torch.ones(5, 9, dtype=torch.bool).tril(4)[None, None].repeat(3, 1, 1, 1)
    allowed[0, :, :, :3] = False                         # left padding of row 0
    mask = torch.zeros(3, 1, 5, 9).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for b in (1, 8, 64):
        with split_kv.split_policy(b == 64):
            out, _ = split_kv.split_kv_attention(None, q, k, v, mask, scaling=8 ** -0.5)
        assert out.shape == (3, 5, 4, 6)
        torch.testing.assert_close(out.double(), _attention_reference(q, k, v, mask),
                                   atol=1e-6, rtol=1e-5)
    masked_row = torch.full((1, 1, 1, 9), torch.finfo(torch.float32).min)
    out, _ = split_kv.split_kv_attention(None, q[:1, :, :1], k[:1], v[:1], masked_row, 0.3)
    assert torch.equal(out, torch.zeros_like(out))       # a row that sees nothing: 0, not NaN


def test_engine_results_depend_on_the_batch_unless_deterministic(tmp_path):
    """bfloat16 engine: a sequence scored alone and beside others differs in the last bits;
    with deterministic inference, bit for bit the same."""
    from moe_rl.engines.reference.engine import ReferenceEngine, Request, SamplingParams
    write_tiny_qwen(tmp_path / "m")

    def score(eng, seqs):
        reqs = [Request(input_ids=s, params=SamplingParams(max_new_tokens=0), rid=str(i),
                        return_logprob=True, logprob_start_len=0) for i, s in enumerate(seqs)]
        return [[e[0] for e in r["meta_info"]["input_token_logprobs"][1:]]
                for r in eng.run(reqs)]
    seq = list(range(3, 15))
    others = [list(range(20, 20 + n)) for n in (5, 9, 14)]
    for deterministic in (False, True):
        eng = ReferenceEngine(str(tmp_path / "m"), dtype="bfloat16",
                              deterministic_inference=deterministic, prefix_cache_tokens=0)
        alone = score(eng, [seq])[0]
        together = score(eng, [*others, seq])[-1]
        assert (alone == together) == deterministic


def _train(model, run_dir, *overrides):
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", "--config",
           str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={model}",
           f"logging.dir={run_dir}", "trainer.steps=1", "trainer.warmup.steps=0",
           "trainer.checkpoint.export_hf=false", "rollout.prompts_per_step=2",
           "rollout.n_samples_per_prompt=4", f"rollout.servers.base_port={engine_base_port()}",
           "logging.progress=false", "logging.tensorboard=false", "algorithm.pi_old=engine_avg",
           "algorithm.pi_old_passes=2", *overrides]
    res = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("numerics") / "model"
    init_tiny_model(str(out))
    return out


@pytest.mark.loop
# `make test-slow`: the batch-dependence itself is held by
# test_engine_results_depend_on_the_batch_unless_deterministic, engine_avg by the zero-mismatch runs
@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True])
def test_engine_passes_differ_like_a_loaded_server(tiny_model, tmp_path, deterministic):
    """engine_avg's n passes run in batches of other sizes: they differ (pass_std > 0) on the
    default engine and are bit-identical with deterministic inference; either way the float32
    engine still agrees with the float32 trainer (zero-mismatch invariant)."""
    # 4 passes of 16 samples: enough batches of different sizes that the passes of some sample
    # land in batches that split the KV differently (2 passes of 8 samples at times did not)
    m = _train(tiny_model, tmp_path / "run",
               f"rollout.sglang.deterministic_inference={str(deterministic).lower()}",
               "algorithm.pi_old_passes=4", "rollout.prompts_per_step=4")
    assert (m["pi_old/pass_std"] == 0.0) == deterministic, m["pi_old/pass_std"]
    assert m["mismatch/k3"] < 1e-6 and m["ratio/first_minibatch_max_dev"] < 1e-5


# ---------------------------------------------------------------------- FP8

def _e4m3_grid() -> torch.Tensor:
    """Every finite E4M3 (fn) value, from its bit patterns, in float64."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    return vals[torch.isfinite(vals)].unique()


def _quantize_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 block quantiser: per 128x128 block scale amax/448, round to nearest E4M3 (ties
    to even mantissa), dequantised."""
    grid = _e4m3_grid()
    N, K = w.shape
    out = torch.empty_like(w, dtype=torch.float64)
    scales = torch.empty((-(-N // 128), -(-K // 128)), dtype=torch.float64)
    for bi in range(scales.shape[0]):
        for bj in range(scales.shape[1]):
            blk = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].double()
            scale = max(float(blk.abs().max()), 1e-300) / 448.0
            x = (blk / scale).clamp(-448, 448)
            idx = (x[..., None] - grid).abs().argmin(-1)
            out[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128] = grid[idx] * scale
            scales[bi, bj] = scale
    return out, scales


def test_block_quantiser_against_float64_reference():
    from moe_rl.weights.fp8 import dequantize_blockwise, quantize_blockwise
    torch.manual_seed(0)
    w = torch.randn(200, 300) * torch.logspace(-3, 1, 300)    # blocks of very different ranges
    q, scale = quantize_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    deq = dequantize_blockwise(q, scale).double()
    ref, ref_scale = _quantize_reference(w)
    torch.testing.assert_close(scale.double(), ref_scale, rtol=1e-6, atol=0)
    # one scale per block: the block's largest magnitude maps to exactly 448
    for bi in range(2):
        for bj in range(3):
            blk = q[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].float()
            assert float(blk.abs().max()) == 448.0
    # equal to the reference except at exact rounding ties (none expected in random data)
    assert (deq - ref).abs().max() <= 1e-6 * ref.abs().max()
    # round-trip error: half an E4M3 step, 2^-4 relative for normals, 2^-10 x scale below
    full = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300].double()
    bound = torch.maximum(w.double().abs() * 2 ** -4, full * 2 ** -10)
    assert ((deq - w.double()).abs() <= bound * (1 + 1e-6)).all()


def test_saturation_and_activation_groups():
    from moe_rl.engines.reference.fp8_inference import quantize_activations
    from moe_rl.weights.fp8 import quantize_blockwise
    q, _ = quantize_blockwise(torch.tensor([[1000.0, -1000.0, 1.0]]), scale=torch.ones(1, 1))
    assert q.float().tolist() == [[448.0, -448.0, 1.0]]           # saturates at +-448
    x = torch.zeros(2, 260)
    x[0, :128], x[0, 128:256], x[0, 256:] = 1e-3, 5.0, 300.0      # three groups, own scales
    x[1] = torch.linspace(-2, 2, 260)
    deq = quantize_activations(x)
    assert deq[0, :128].eq(1e-3).all() and deq[0, 128:256].eq(5.0).all()
    assert deq[0, 256:].eq(300.0).all()
    for g in range(3):
        part = x[1, g * 128:(g + 1) * 128].double()
        err = (deq[1, g * 128:(g + 1) * 128].double() - part).abs()
        assert (err <= torch.maximum(part.abs() * 2 ** -4,
                                     part.abs().max() / 448 * 2 ** -10 * torch.ones(1))).all()


def test_fp8_engine_quantises_what_sglang_quantises_and_requantises_on_update(tmp_path):
    from moe_rl.weights.fp8 import dequantize_blockwise, quantize_blockwise
    from moe_rl.engines.reference.engine import ReferenceEngine, Request, SamplingParams
    write_tiny_qwen(tmp_path / "a", seed=0)
    write_tiny_qwen(tmp_path / "b", seed=1)
    eng = ReferenceEngine(str(tmp_path / "a"), quantization="fp8", prefix_cache_tokens=0)
    full = ReferenceEngine(str(tmp_path / "a"), prefix_cache_tokens=0)
    mods = dict(eng.model.named_modules())
    attn = mods["model.layers.0.self_attn.q_proj"]
    expect = dequantize_blockwise(*quantize_blockwise(attn.weight))
    assert torch.equal(attn.fp8_weight, expect)
    experts = mods["model.layers.0.mlp.experts"]
    assert experts.fp8_gate_up.shape == experts.gate_up_proj.shape
    for name in ("lm_head", "model.layers.0.mlp.gate", "model.embed_tokens"):
        assert not hasattr(mods[name], "fp8_weight"), name          # left unquantised
    assert hasattr(mods["model.layers.1.mlp.gate_proj"], "fp8_weight")   # the dense layer
    req = lambda: [Request(input_ids=list(range(3, 20)), params=SamplingParams(  # noqa: E731
        max_new_tokens=0), rid="s", return_logprob=True, logprob_start_len=0)]
    lp = lambda e: torch.tensor([x[0] for x in e.run(req())[0]["meta_info"]   # noqa: E731
                                 ["input_token_logprobs"][1:]])
    diff = (lp(eng) - lp(full)).abs()
    assert 1e-5 < float(diff.max()) < 0.5                            # a real, bounded change
    eng.load(str(tmp_path / "b"))                                    # a weight update
    attn = dict(eng.model.named_modules())["model.layers.0.self_attn.q_proj"]
    assert torch.equal(attn.fp8_weight, dequantize_blockwise(*quantize_blockwise(attn.weight)))
    assert not torch.equal(attn.fp8_weight, expect)


def _scored(engine, ids) -> torch.Tensor:
    from moe_rl.engines.reference.engine import Request, SamplingParams
    out = engine.run([Request(input_ids=ids, params=SamplingParams(max_new_tokens=0), rid="s",
                              return_logprob=True, logprob_start_len=0)])
    return torch.tensor([x[0] for x in out[0]["meta_info"]["input_token_logprobs"][1:]],
                        dtype=torch.float64)


def test_a_float16_engine_serves_closer_to_float32_than_bfloat16_does(tmp_path):
    """The same sequences scored by the engine in float32, float16 and bfloat16: both 16-bit
    engines differ from float32 (a real rounding), float16 (10 mantissa bits) by less than
    bfloat16 (7)."""
    from moe_rl.engines.reference.engine import ReferenceEngine
    write_tiny_qwen(tmp_path / "m", seed=0)
    ids = [list(range(3 + k, 40 + k)) for k in range(4)]
    err = {}
    full = ReferenceEngine(str(tmp_path / "m"), prefix_cache_tokens=0)
    want = torch.cat([_scored(full, i) for i in ids])
    for dtype in ("float16", "bfloat16"):
        eng = ReferenceEngine(str(tmp_path / "m"), dtype=dtype, prefix_cache_tokens=0)
        assert {p.dtype for p in eng.model.parameters()} == {getattr(torch, dtype)}
        err[dtype] = float((torch.cat([_scored(eng, i) for i in ids]) - want).abs().mean())
    assert 0 < err["float16"] < err["bfloat16"] / 2, err


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_engines_fp32_lm_head_is_a_float32_matmul_and_survives_an_update(tmp_path, dtype):
    """--enable-fp32-lm-head (SGLang's flag): the head's matmul takes the 16-bit hidden states
    and weights cast to float32 and returns float32 logits (a float64 reference of the same
    operands: float32 accuracy); without it the logits round to the 16-bit grid. A weight update
    (a new load) keeps it."""
    from moe_rl.engines.reference.engine import ReferenceEngine
    write_tiny_qwen(tmp_path / "a", seed=0)
    write_tiny_qwen(tmp_path / "b", seed=1)
    low = getattr(torch, dtype)
    plain = ReferenceEngine(str(tmp_path / "a"), dtype=dtype, prefix_cache_tokens=0)
    fp32 = ReferenceEngine(str(tmp_path / "a"), dtype=dtype, prefix_cache_tokens=0,
                           fp32_lm_head=True)
    gen = torch.Generator().manual_seed(0)
    for engine_path in ("a", "b"):
        if engine_path == "b":
            plain.load(str(tmp_path / "b"))
            fp32.load(str(tmp_path / "b"))
        head = fp32.model.get_output_embeddings()
        weight = head.weight.detach()
        assert weight.dtype == low   # the weights stay 16-bit: only the matmul is float32
        h = torch.randn(6, weight.shape[1], generator=gen).to(low)
        ref = h.double() @ weight.double().T
        with torch.no_grad():
            got, rounded = head(h), plain.model.get_output_embeddings()(h)
        assert got.dtype == torch.float32 and rounded.dtype == low
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
        assert float((rounded.double() - ref).abs().max()) > \
            10 * float((got.double() - ref).abs().max())
    ids = list(range(3, 30))
    assert not torch.equal(_scored(plain, ids), _scored(fp32, ids))


@pytest.mark.loop
def test_fp8_rollouts_through_moe_rl_train(tiny_model, tmp_path):
    """rollout.quantization=fp8 through `moe-rl train` (Ray, HTTP) with the distributed weight
    sync (the trainer streams E4M3 weights and scales; the disk path runs in the demo test):
    the engine's log-probs differ from the float32 trainer's (mismatch/k3 > 0), R3 replays."""
    m = _train(tiny_model, tmp_path / "run", "rollout.quantization=fp8",
               "algorithm.pi_old=trainer", "cluster.weight_sync=distributed", "trainer.steps=2")
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2 and json.loads(rows[1])["mismatch/k3"] > 1e-8
    assert m["mismatch/k3"] > 1e-8 and m["mismatch/abs_diff_max"] > 1e-4
    assert m["routing/agreement"] <= 1.0


# ---------------------------------------------------------------------- model presets

def test_preset_warm_up_moves_the_routers_and_is_cached(tmp_path):
    """`moe-rl init-model --preset`: the preset's shape, supervised warm-up steps that move the
    routers off their initialisation, and a cached folder reused as it is."""
    from safetensors.torch import load_file
    from moe_rl.models.presets import PRESETS, write_preset
    from moe_rl.models.tiny import write_tiny_model
    from moe_rl.models.presets import preset_init
    cold = tmp_path / "cold"
    write_tiny_model(preset_init("tiny"), str(cold))
    out = tmp_path / "warm"
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--preset", "tiny",
                          "--out", str(out), "--warmup-steps", "3"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = json.loads((out / "config.json").read_text())
    init = PRESETS["tiny"]["init"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"]) == (
        init["num_experts"], init["num_experts_per_tok"], init["hidden_size"])
    a = load_file(str(cold / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(a[gate], b[gate])                    # routers warmed up
    marker = json.loads((out / "moe_rl_preset.json").read_text())
    assert marker["warmup_steps"] == 3 and marker["final_loss"] > 0
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert write_preset("tiny", str(out), 3) == str(out)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp   # reused, not rebuilt
    bad = subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "exactly one of --config FILE or --preset NAME" in bad.stdout


@pytest.mark.loop
@pytest.mark.slow   # `make test-slow`: test_fp8_rollouts_through_moe_rl_train runs fp8 in the loop
def test_demo_runs_on_fp8_and_reports_what_replay_removed(tmp_path):
    """`moe-rl demo` (a few steps): the FP8 engine, then the reward rise and the replay summary."""
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "demo", "trainer.steps=3",
                          "trainer.warmup.steps=2", f"model.path={tmp_path / 'model'}",
                          f"logging.dir={tmp_path / 'run'}", "logging.progress=false",
                          "trainer.checkpoint.export_hf=false", f"rollout.servers.base_port={engine_base_port()}",
                          "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    import yaml   # the resolved config is in the run directory (one line says where)
    resolved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert resolved["rollout"]["quantization"] == "fp8"
    assert resolved["rollout"]["engine_dtype"] == "bfloat16"
    assert f"resolved config: {tmp_path / 'run' / 'config.yaml'}" in res.stdout
    assert "run finished: 3 RL steps" in res.stdout
    assert "engine: fp8 bfloat16 reference engine; trainer: float32" in res.stdout
    assert "without replay the trainer's own routers would have agreed with the engine on" \
        in res.stdout and "with R3 the trainer replays the engine's routing: mismatch/k3" \
        in res.stdout


def test_fp8_checkpoint_format_and_the_engine_serves_its_values(tmp_path):
    """write_fp8_checkpoint: E4M3 weights + float32 weight_scale_inv per 128x128 block for what
    SGLang quantises, the rest untouched, quantization_config in config.json (the format SGLang
    serves block-wise FP8 from); the reference engine serves exactly those values."""
    from safetensors import safe_open
    from moe_rl.weights.fp8 import (QUANTIZATION_CONFIG, dequantize_blockwise,
                                    is_fp8_checkpoint, quantize_blockwise, read_fp8_checkpoint,
                                    write_fp8_checkpoint)
    from moe_rl.engines.reference.engine import ReferenceEngine, checkpoint_spec
    write_tiny_qwen(tmp_path / "bf", seed=2)
    out = write_fp8_checkpoint(str(tmp_path / "bf"), str(tmp_path / "fp8"))
    assert is_fp8_checkpoint(out) and not is_fp8_checkpoint(str(tmp_path / "bf"))
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())[
        "quantization_config"] == QUANTIZATION_CONFIG
    assert (tmp_path / "fp8" / "tokenizer_config.json").exists() or not (
        tmp_path / "bf" / "tokenizer_config.json").exists()
    spec = checkpoint_spec(out)
    q_name = "model.layers.0.self_attn.q_proj.weight"
    assert spec[q_name][1] == "torch.float8_e4m3fn"
    assert spec["model.layers.0.self_attn.q_proj.weight_scale_inv"] == ([1, 1], "torch.float32")
    assert spec["model.layers.0.mlp.experts.3.up_proj.weight"][1] == "torch.float8_e4m3fn"
    for kept in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert spec[kept][1] == "torch.float32" and kept[:-6] + "weight_scale_inv" not in spec
    with safe_open(str(tmp_path / "bf" / "model.safetensors"), "pt") as fh:
        original = fh.get_tensor(q_name)
    assert torch.equal(read_fp8_checkpoint(out)[q_name],
                       dequantize_blockwise(*quantize_blockwise(original)))
    eng = ReferenceEngine(out, dtype="bfloat16", prefix_cache_tokens=0)
    deq = read_fp8_checkpoint(out)
    mods = dict(eng.model.named_modules())
    assert torch.equal(mods["model.layers.0.self_attn.q_proj"].fp8_weight, deq[q_name])
    experts = mods["model.layers.0.mlp.experts"]
    assert torch.equal(experts.fp8_gate_up[3], torch.cat([
        deq["model.layers.0.mlp.experts.3.gate_proj.weight"],
        deq["model.layers.0.mlp.experts.3.up_proj.weight"]]))
    assert torch.equal(experts.fp8_down[5], deq["model.layers.0.mlp.experts.5.down_proj.weight"])
    assert eng.checkpoint_spec == spec     # updates are checked against the FP8 names


@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_fp8_weights_over_the_distributed_path(tmp_path):
    """An engine serving an FP8 checkpoint takes a distributed update of E4M3 weights and
    scales (gloo carries their bytes) and then serves exactly the new FP8 checkpoint."""
    import threading
    from safetensors.torch import load_file
    from moe_rl.families.shape import MoEShape
    from moe_rl.engines.sglang.client import SGLangEngine
    from moe_rl.weights.fp8 import quantise_named, write_fp8_checkpoint
    from moe_rl.engines.sglang.pool import ServerPool
    from moe_rl.engines.reference.launcher import ReferenceServer
    from moe_rl.engines.sglang.weights import broadcast_tensors, close_group, open_group
    write_tiny_qwen(tmp_path / "a", seed=1)
    write_tiny_qwen(tmp_path / "b", seed=2)
    a8 = write_fp8_checkpoint(str(tmp_path / "a"), str(tmp_path / "a8"))
    b8 = write_fp8_checkpoint(str(tmp_path / "b"), str(tmp_path / "b8"))
    layout = MoEShape.from_hf(json.loads((tmp_path / "a" / "config.json").read_text()))
    proc = ReferenceServer(a8, free_port(), dtype="bfloat16").start()
    ref = ReferenceServer(b8, free_port(), dtype="bfloat16").start()
    try:
        eng = SGLangEngine(lambda: ServerPool([proc.url], max_retries=0), layout,
                           need_routing=True, need_mask=False)
        port, joined = free_port(), {}
        t = threading.Thread(target=lambda: joined.update(
            group=open_group("gloo", "127.0.0.1", port, 0, 2, "fp8_update")))
        t.start()
        eng.weights.join_group("127.0.0.1", port, "fp8_update", "gloo")
        t.join(60)
        named = quantise_named(sorted(load_file(str(tmp_path / "b" / "model.safetensors"))
                                      .items()))
        assert any(t.dtype == torch.float8_e4m3fn for _, t in named)
        eng.weights.begin()
        sender = threading.Thread(target=broadcast_tensors, args=(joined["group"], named))
        sender.start()
        eng.weights.announce_bucket(named, 3, "fp8_update", True)
        sender.join(60)
        eng.weights.end()
        assert_serves_like(eng, ref.url, layout, [[6, 7, 20, 12, 30]])
        eng.run_with_pool(lambda pool: pool.broadcast("/destroy_weights_update_group",
                                                      {"group_name": "fp8_update"}))
    finally:
        if "group" in joined:   # the group's name is process-wide: leave it
            close_group(joined["group"])
        proc.stop()
        ref.stop()


def test_fp8_checkpoint_keeps_every_router_gate_unquantised(tmp_path):
    """Mixtral's router is ``block_sparse_moe.gate``: SGLang builds it unquantised (it would copy
    raw E4M3 values into it), so the FP8 writer must leave it as it is, as for Qwen3-MoE's
    ``mlp.gate``; the writer and the reference engine quantise the same set."""
    import transformers
    from moe_rl.engines.reference.fp8_inference import is_quantised_linear
    from moe_rl.weights.fp8 import quantised_weight_name, write_fp8_checkpoint
    from moe_rl.engines.reference.engine import checkpoint_spec
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     intermediate_size=16, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64,
                                     tie_word_embeddings=False)
    model = transformers.MixtralForCausalLM(cfg)
    model.save_pretrained(tmp_path / "mixtral")
    spec = checkpoint_spec(write_fp8_checkpoint(str(tmp_path / "mixtral"), str(tmp_path / "q")))
    gates = [n for n in spec if n.endswith("block_sparse_moe.gate.weight")]
    assert len(gates) == 2
    for g in gates:
        assert spec[g][1] != "torch.float8_e4m3fn" and g[:-6] + "weight_scale_inv" not in spec
    assert spec["model.layers.0.block_sparse_moe.experts.1.w2.weight"][1] == \
        "torch.float8_e4m3fn"
    quantised = {n for n, (_, dt) in spec.items() if dt == "torch.float8_e4m3fn"}
    assert quantised == {n for n, (shape, _) in spec.items()
                         if quantised_weight_name(n, torch.empty(shape, device="meta"))}
    linears = {f"{n}.weight" for n, m in model.named_modules() if is_quantised_linear(n, m)}
    assert linears and linears <= quantised
    assert not any(n.endswith("gate.weight") for n in linears)
