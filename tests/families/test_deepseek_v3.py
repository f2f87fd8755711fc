"""DeepSeek-V3-style models: megatron-core (MLA, sigmoid router with expert bias, group-limited
top-k, shared experts, dense leading layers) against transformers' DeepseekV3ForCausalLM, the
replay semantics of the biased sigmoid router, the expert-bias update, the engine's routing
layout, and the refusals."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_rl.config import ConfigError, load_config
from moe_rl.trainer.packing import pack_one
from moe_rl.trainer.forward import forward_logprobs
from moe_rl.weights.hf import load_hf_into_megatron, megatron_to_hf
from moe_rl.families.shape import model_spec
from moe_rl.trainer.model_builder import build_model, transformer_config
from moe_rl.checks.model import check_trainer, transformers_reference, verdict
from moe_rl.families.shape import MoEShape
from moe_rl.trainer.parallel import init_distributed, init_model_parallel
from moe_rl.trainer.replay import ReplayController
from moe_rl.rollout_record import RolloutBatch, Sample
from tests.hf_models import DEEPSEEK, YARN, assert_scores_as_transformers, hf_forward, write_deepseek
from tests.helpers import start_ranks


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}, {"rope_parameters": YARN}],
                         ids=["q_lora", "no_q_lora", "yarn"])
def test_round_trip_and_equivalence_with_transformers(tmp_path, overrides):
    hf_model = write_deepseek(tmp_path / "hf", **overrides)
    model, spec = build_model(str(tmp_path / "hf"))
    assert spec.moe_shape.moe_layers == (1, 2)
    load_hf_into_megatron(model, spec, str(tmp_path / "hf"))
    original = load_file(tmp_path / "hf" / "model.safetensors")
    exported = megatron_to_hf(model, spec)
    assert set(exported) == set(original)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in exported
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    assert_scores_as_transformers(model, spec, hf_model)


def _router_reference(x, weight, bias, ids, scale):
    """float64: the gate weights of replayed ``ids`` (sigmoid scores without the bias,
    renormalised over the k ids, times the routed scaling factor) and the biased,
    group-limited (4 groups of 4, top-2 groups by their two best) top-4 choice."""
    scores = torch.sigmoid(x.double() @ weight.double().t())
    gates = scores.gather(1, ids)
    gates = gates / (gates.sum(1, keepdim=True) + 1e-20) * scale
    biased = scores + bias.double()
    group_rank = biased.view(-1, 4, 4).topk(2, dim=-1).values.sum(-1)
    groups = group_rank.topk(2, dim=-1).indices
    allowed = torch.zeros_like(group_rank).scatter(1, groups, 1.0).repeat_interleave(4, dim=1)
    own = biased.masked_fill(allowed == 0, -math.inf).topk(4, dim=-1).indices
    return gates, own


# Kimi-K2's layout at tiny width: DeepSeek-V3's MLA with q-LoRA, 384 routed experts in one group
# (no group limit), top-8, routed_scaling_factor 2.827, as many KV heads as heads, YaRN rotary
# (factor 32, beta_fast = beta_slow = 1, theta 50000); its config.json says kimi_k2
KIMI_K2 = dict(n_routed_experts=384, n_group=1, topk_group=1, num_experts_per_tok=8,
               routed_scaling_factor=2.827, num_attention_heads=4, num_key_value_heads=4,
               rope_parameters=dict(YARN, rope_theta=50000.0, factor=32.0, beta_fast=1.0,
                                    beta_slow=1.0))


def test_kimi_k2_is_the_deepseek_v3_family(tmp_path):
    """A checkpoint of Kimi-K2's shape under its own ``model_type: kimi_k2`` (architectures
    DeepseekV3ForCausalLM, its DeepSeek code shipped beside it and never run): the DeepSeek-V3
    family builds it, the checkpoint round-trips bit for bit, megatron-core scores it as
    transformers' DeepSeek-V3 does under replayed and its own routing over 384 experts, and
    `moe-rl check-model`'s trainer side finds it aligned with transformers."""
    path = tmp_path / "kimi"
    hf_model = write_deepseek(path, **KIMI_K2)
    conf = json.loads((path / "config.json").read_text())
    conf.update(model_type="kimi_k2", auto_map={
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (path / "config.json").write_text(json.dumps(conf))
    model, spec = build_model(str(path))
    assert (spec.moe_shape.num_experts, spec.moe_shape.topk, spec.moe_shape.moe_layers) == (384, 8, (1, 2))
    load_hf_into_megatron(model, spec, str(path))
    original = load_file(path / "model.safetensors")
    exported = megatron_to_hf(model, spec)
    assert set(exported) == set(original)
    for k, v in original.items():
        assert torch.equal(exported[k], v), k
    seqs = assert_scores_as_transformers(model, spec, hf_model)
    # `moe-rl check-model`'s transformers side loads it by the family's type (no tokenizer here:
    # the token ids straight in)
    shape = MoEShape.from_hf(conf)
    ref = transformers_reference(str(path), [s.tolist() for s in seqs], shape)
    assert verdict(list(check_trainer(str(path), ref, shape)), 1.0, 1e-4)[0]


def test_replayed_sigmoid_router_uses_its_own_unbiased_scores_and_keeps_its_gradient(tmp_path):
    write_deepseek(tmp_path / "hf", bias_std=0.3)
    model, spec = build_model(str(tmp_path / "hf"))
    load_hf_into_megatron(model, spec, str(tmp_path / "hf"))
    router = model.decoder.layers[1].mlp.router
    assert spec.moe_shape.moe_layers == (1, 2) and not hasattr(model.decoder.layers[0].mlp, "router")
    g = torch.Generator().manual_seed(3)
    tokens = 24
    x = torch.randn(tokens, 1, 32, generator=g)
    # replay ids that are NOT the router's choice: a random valid top-4 per token
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(tokens)])
    ctl = ReplayController(model, spec.moe_shape.moe_layers, spec.moe_shape.topk, spec.moe_shape.num_experts)
    ctl.replay([ids, ids])
    probs, routing_map = router(x)
    model.decoder.layers[2].mlp.router(x)   # every MoE layer routes once per forward
    want_gates, want_own = _router_reference(x[:, 0], router.weight, router.expert_bias, ids,
                                             2.5)
    # the replayed ids fix the choice
    assert torch.equal(routing_map, torch.zeros(tokens, 16, dtype=torch.bool).scatter(1, ids, True))
    # the gate weights are the trainer's sigmoid scores at those ids, without the bias
    got = probs.gather(1, ids)
    assert torch.allclose(got.double(), want_gates, atol=1e-6)
    assert router.expert_bias.abs().max() > 0.1   # the bias is there, and not in the gates
    # the agreement metric compares the trainer's own biased, group-limited choice
    own = ctl.own_choice()[0]
    assert torch.equal(own.sort(1).values, want_own.sort(1).values)
    assert not torch.equal(own.sort(1).values, ids.sort(1).values)
    # the router still gets its gradient through the gate weights (float64 reference)
    c = torch.randn(tokens, 16, generator=g)
    (probs * c).sum().backward()
    w64 = router.weight.detach().double().requires_grad_(True)
    ref_gates, _ = _router_reference(x[:, 0], w64, router.expert_bias, ids, 2.5)
    (ref_gates * c.double().gather(1, ids)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert torch.allclose(router.weight.grad.double(), w64.grad, atol=1e-5)
    assert router.expert_bias.grad is None   # a buffer: the bias never learns by gradient
    ctl.off()
    ctl.close()


@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_expert_bias_is_frozen_by_default_and_follows_megatron_update_with_a_rate(tmp_path, rate):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from moe_rl.trainer.update import finalize_grads
    write_deepseek(tmp_path / "hf", bias_std=0.05)
    model, spec = build_model(str(tmp_path / "hf"), expert_bias_update_rate=rate)
    load_hf_into_megatron(model, spec, str(tmp_path / "hf"))
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), model)
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    before = [r.expert_bias.clone() for r in routers]
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]
    model.train()
    ddp(ids, torch.arange(12)[None].expand(2, -1), mask).float().mean().backward()
    counts = [r.local_tokens_per_expert.clone() for r in routers]
    assert all(int(c.sum()) == 2 * 12 * 4 for c in counts)   # every token counted k times
    finalize_grads(ddp)
    for r, b0, c in zip(routers, before, counts):
        want = b0 + torch.sign(c.mean() - c) * rate   # under-used experts gain, over-used lose
        assert torch.equal(r.expert_bias, want)
        assert r.local_tokens_per_expert.abs().sum() == 0   # one optimizer step's counts each
    if rate == 0.0:
        assert all(torch.equal(r.expert_bias, b0) for r, b0 in zip(routers, before))
    else:   # the updated bias is what the next weight sync sends to the engine
        exported = megatron_to_hf(model, spec)
        assert torch.equal(exported["model.layers.1.mlp.gate.e_score_correction_bias"],
                           routers[0].expert_bias)


def test_engine_serves_the_tiny_model_with_dense_layers_as_zeros_and_r3_matches_it(tmp_path):
    from moe_rl.config import ModelInitConfig
    from moe_rl.models.tiny import write_tiny_model
    from tests.helpers import sample_from_response
    from moe_rl.engines.reference.engine import ReferenceEngine, Request, SamplingParams
    init = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs",
                                    "deepseek_tiny_cpu.yaml")).model.init
    assert isinstance(init, ModelInitConfig) and init.architecture == "deepseek_v3"
    path = write_tiny_model(init, str(tmp_path / "tiny"))
    conf = json.load(open(os.path.join(path, "config.json")))
    assert (conf["model_type"], conf["num_hidden_layers"], conf["first_k_dense_replace"],
            conf["n_routed_experts"], conf["n_group"], conf["topk_group"],
            conf["num_experts_per_tok"], conf["n_shared_experts"]) == \
        ("deepseek_v3", 4, 1, 16, 4, 2, 4, 1)
    engine = ReferenceEngine(path, dtype="float32", seed=0, return_routed_experts=True)
    reqs = [Request(input_ids=list(range(5, 5 + n)), rid=str(n), return_logprob=True,
                    return_routed_experts=True,
                    params=SamplingParams(max_new_tokens=6, ignore_eos=True)) for n in (3, 6)]
    responses = engine.run(reqs)
    model, spec = build_model(path)
    load_hf_into_megatron(model, spec, path)
    samples = []
    for i, (req, resp) in enumerate(zip(reqs, responses)):
        import base64
        import numpy as np
        full = np.frombuffer(base64.b64decode(resp["meta_info"]["routed_experts"]), "<i4")
        full = full.reshape(len(req.input_ids) + 5, 4, 4)
        assert (full[:, 0] == 0).all()   # the dense layer, as SGLang reports it
        assert all(len(set(row)) == 4 for row in full[:, 1:].reshape(-1, 4).tolist())
        # at most topk_group groups per token (group-limited)
        assert max(len({e // 4 for e in row}) for row in full[:, 1:].reshape(-1, 4).tolist()) <= 2
        samples.append(sample_from_response(resp, req.input_ids, spec.moe_shape, need_routing=True,
                                            need_mask=False, group_id=i, sample_id=i))
    assert samples[0].routing.shape[1:] == (3, 4)   # MoE layers only: dense layer skipped
    mb = pack_one(samples, [0, 1], pad_token_id=0, num_experts=16)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, spec.moe_shape.topk, spec.moe_shape.num_experts)
    model.eval()
    ctl.replay(mb.replay_indices())
    with torch.no_grad():
        lp, _ = forward_logprobs(model, mb)
    agreement = ctl.agreement(mb.replay_indices(), mb.routing_valid_router_order())
    ctl.finish_forward()
    ctl.close()
    assert agreement["routing/agreement"] == 1.0
    for got, s in zip(mb.unpack(lp), samples):
        assert torch.allclose(got, s.rollout_logprobs, atol=1e-5)


def test_unsupported_deepseek_settings_are_refused_naming_the_field(tmp_path):
    base = {**DEEPSEEK, "model_type": "deepseek_v3", "rope_interleave": True}
    cases = {
        "rope_interleave": {"rope_interleave": False},
        "topk_group": {"topk_group": 1, "n_group": 4},
        "norm_topk_prob": {"norm_topk_prob": False},
        "scoring_func": {"scoring_func": "softmax"},
        "attention_bias": {"attention_bias": True},
        "rope_parameters.rope_type": {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 1e4}},
    }
    for field, change in cases.items():
        with pytest.raises(ValueError, match=field):
            transformer_config(model_spec({**base, **change}))
    # all groups allowed: no group limit, any top-k
    cfg = transformer_config(model_spec({**base, "topk_group": 4, "num_experts_per_tok": 3}))
    assert cfg.moe_router_group_topk is None and cfg.moe_router_topk == 3
    # a checkpoint that carries multi-token-prediction layers is refused, naming them
    write_deepseek(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    model, spec = build_model(str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"multi-token-prediction layer\(s\) \[3\]"):
        load_hf_into_megatron(model, spec, str(tmp_path / "hf"))


def test_deepseek_init_shape_is_checked_at_config_time():
    cfg = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "deepseek_tiny_cpu.yaml")
    bad = {"model.init.deepseek.topk_group=3": "model.init.deepseek.topk_group",
           "model.init.deepseek.n_group=5": "model.init.deepseek.n_group",
           "model.init.deepseek.qk_rope_head_dim=7": "model.init.deepseek.qk_rope_head_dim",
           "model.init.deepseek.first_k_dense_replace=4":
               "model.init.deepseek.first_k_dense_replace"}
    for override, key in bad.items():
        with pytest.raises(ConfigError, match=key):
            load_config(cfg, [override, "model.path=/nonexistent/deepseek"])


def _rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


@pytest.mark.loop
@pytest.mark.e2e
# `make test-slow`: `make test-upstream` runs a DeepSeek-V3 through `moe-rl train` with R3, and
# `make test` converts this family both ways
@pytest.mark.slow
def test_cpu_twin_config_trains_through_the_loop_with_r3_and_converts(tmp_path):
    """`moe-rl init-model` + `moe-rl train --config configs/deepseek_tiny_cpu.yaml` (R3, IcePop
    then seq-MIS, the keep-sampling mask with top-k/top-p, a supervised warm start, through Ray
    and HTTP): float32 engine and trainer agree (routing agreement 1, mismatch/k3 ~0, nothing
    corrected away); the expert bias stays frozen; a checkpoint converts to the exported HF model
    exactly; then `trainer.expert_bias_update_rate` > 0 moves the bias through the loop."""
    import shutil
    import subprocess
    import sys
    from tests.helpers import ROOT, train_cli
    subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config",
                    str(ROOT / "configs" / "deepseek_tiny_cpu.yaml"), "--out",
                    str(tmp_path / "model")], check=True, capture_output=True, timeout=120)
    train_cli(tmp_path, 3, "algorithm.keep_sampling_mask=true", "rollout.sampling.top_k=8",
              "rollout.sampling.top_p=0.9", config="deepseek_tiny_cpu.yaml")
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["routing/agreement"] == 1.0 and r["routing/agreement_layer_1"] == 1.0
        assert "routing/agreement_layer_0" not in r   # the dense layer has no router
        assert abs(r["mismatch/k3"]) < 1e-6 and r["mismatch/abs_diff_max"] < 1e-4
        assert 1 <= r["sampling_mask/kept_mean"] <= 8
        assert r["correction/icepop/masked_token_frac"] == 0.0
        assert r["correction/seq_mis/masked_seq_frac"] == 0.0
    start = load_file(tmp_path / "model" / "model.safetensors")
    final = load_file(tmp_path / "run" / "final_hf" / "model.safetensors")
    biases = [k for k in start if k.endswith("e_score_correction_bias")]
    assert len(biases) == 3 and all(torch.equal(start[k], final[k]) for k in biases)
    assert not torch.equal(start["model.layers.1.mlp.gate.weight"],
                           final["model.layers.1.mlp.gate.weight"])   # the router learned
    res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", "--to", "hf",
                          "--checkpoint", str(tmp_path / "run" / "checkpoints"), "--out",
                          str(tmp_path / "converted")], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    converted = load_file(tmp_path / "converted" / "model.safetensors")
    assert converted.keys() == final.keys()
    assert all(torch.equal(converted[k], final[k]) for k in final)
    # trainer.expert_bias_update_rate > 0 through the loop: the bias moves by +-rate per
    # optimizer step, and the engine serves it (the float32 engine still equals the trainer)
    shutil.rmtree(tmp_path / "run")
    train_cli(tmp_path, 2, "trainer.expert_bias_update_rate=0.01", "trainer.warmup.steps=0",
              config="deepseek_tiny_cpu.yaml")
    moved = load_file(tmp_path / "run" / "final_hf" / "model.safetensors")
    for k in biases:
        steps = (moved[k] - start[k]) / 0.01
        assert steps.abs().max() > 0.5 and torch.allclose(steps, steps.round(), atol=1e-3)
        assert steps.abs().max() <= 2.0 + 1e-3   # two optimizer steps
    assert all(abs(r["mismatch/k3"]) < 1e-6 for r in _rows(tmp_path / "run"))


@pytest.mark.loop
@pytest.mark.e2e
@pytest.mark.upstream
def test_a_deepseek_v3_without_query_lora_trains_with_r3_and_gspo(tmp_path):
    """A Moonlight-style DeepSeek-V3 (``q_lora_rank: null``: the query projection reads the
    layer's normalised input, no norm of its own) through `moe-rl init-model` and `moe-rl
    train` with R3 and GSPO, disk sync: megatron-core builds it (0.17+ with the checkpoint's
    query projection, see moe_rl/trainer/mla_query.py), loads its HF weights, and the float32
    engine equals the trainer at every step (routing agreement 1, k3 ~0); the query projection
    learns (a supervised warm start, then RL) and is served back under its HF name."""
    import subprocess
    import sys
    from tests.helpers import ROOT, train_cli
    no_lora = "model.init.deepseek.q_lora_rank=null"
    subprocess.run([sys.executable, "-m", "moe_rl.cli", "init-model", "--config",
                    str(ROOT / "configs" / "deepseek_tiny_cpu.yaml"), "--out",
                    str(tmp_path / "model"), no_lora], check=True, capture_output=True,
                   timeout=120)
    start = load_file(tmp_path / "model" / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in start
    assert not any("q_a_" in k for k in start)
    train_cli(tmp_path, 2, no_lora, "algorithm.loss=gspo",
              "algorithm.aggregation=seq-mean-token-mean", "algorithm.clip_low=3e-4",
              "algorithm.clip_high=4e-4", "algorithm.corrections=[]",
              "cluster.weight_sync=disk", config="deepseek_tiny_cpu.yaml")
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["routing/agreement"] == 1.0
        assert abs(r["mismatch/k3"]) < 1e-6 and r["mismatch/abs_diff_max"] < 1e-4
    final = load_file(tmp_path / "run" / "final_hf" / "model.safetensors")
    assert final.keys() == start.keys()
    assert not torch.equal(start["model.layers.1.self_attn.q_proj.weight"],
                           final["model.layers.1.self_attn.q_proj.weight"])   # warm start, RL
    assert any(r["grad_norm"] > 0 for r in rows)


@pytest.mark.slow   # `make test-slow`: every line it runs is run in CI (suite_time.md)
def test_convert_round_trip_through_the_cli_is_bit_identical(tmp_path):
    """`moe-rl convert --to megatron` then `--to hf`: every tensor of the DeepSeek-V3
    checkpoint (MLA projections, shared experts, expert bias) comes back bit-identical."""
    import subprocess
    import sys
    write_deepseek(tmp_path / "hf", q_lora_rank=None)

    def convert(*args):
        res = subprocess.run([sys.executable, "-m", "moe_rl.cli", "convert", *args],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr

    convert("--to", "megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m.pt"))
    convert("--to", "hf", "--megatron", str(tmp_path / "m.pt"), "--hf", str(tmp_path / "hf"),
            "--out", str(tmp_path / "back"))
    original = load_file(tmp_path / "hf" / "model.safetensors")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == original.keys()
    assert "model.layers.2.self_attn.q_proj.weight" in back   # the no-q-LoRA variant
    assert all(torch.equal(back[k], original[k]) for k in original)


def replayed_logprobs(model_dir, samples, sizes=None):
    """(model, spec, log-probs [B, S]) of megatron on ``samples`` with their routing replayed."""
    from moe_rl.trainer.parallel import ParallelSizes
    model, spec = build_model(model_dir, sizes=sizes or ParallelSizes())
    load_hf_into_megatron(model, spec, model_dir)
    mb = pack_one(samples, list(range(len(samples))), pad_token_id=0,
                  num_experts=spec.moe_shape.num_experts)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, spec.moe_shape.topk, spec.moe_shape.num_experts)
    ctl.replay(mb.replay_indices())
    model.eval()
    with torch.no_grad():
        lp, _ = forward_logprobs(model, mb)
    ctl.finish_forward()
    ctl.close()
    return model, spec, lp


def _ep_worker(rank, port, model_dir, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moe_rl.trainer.parallel import ParallelSizes, destroy
    init_distributed(rank=rank, world_size=2)
    init_model_parallel(ParallelSizes(expert=2))
    samples = RolloutBatch.load(os.path.join(out_dir, "samples.st")).samples
    model, spec, lp = replayed_logprobs(model_dir, samples, ParallelSizes(expert=2))
    torch.save({"lp": lp, "exported": megatron_to_hf(model, spec),
                "local_experts": sum(1 for n, _ in model.named_parameters()
                                     if "decoder.layers.1.mlp.experts.local_experts" in n
                                     and n.endswith("fc1.weight"))},
               os.path.join(out_dir, f"ep{rank}.pt"))
    destroy()


@pytest.mark.multiproc
def test_expert_parallel_2_matches_one_process(tmp_path):
    """EP 2 over gloo: 8 routed experts per rank, shared experts and expert bias replicated;
    log-probs under replay equal one process's, and the export is the whole checkpoint."""
    from moe_rl.trainer.parallel import free_port
    hf_model = write_deepseek(tmp_path / "hf")
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 48, (n,), generator=g) for n in (17, 12)]
    samples = []
    for ids in seqs:
        _, routing = hf_forward(hf_model, ids)
        samples.append(Sample(prompt_ids=ids[:4], response_ids=ids[4:],
                              rollout_logprobs=-torch.ones(len(ids) - 4),
                              routing=routing[:-1].to(torch.uint8)))
    RolloutBatch(samples).save(str(tmp_path / "samples.st"))
    start_ranks(_ep_worker, (free_port(), str(tmp_path / "hf"), str(tmp_path)), 2)
    _, _, ref = replayed_logprobs(str(tmp_path / "hf"), samples)
    original = load_file(tmp_path / "hf" / "model.safetensors")
    for r in range(2):
        out = torch.load(tmp_path / f"ep{r}.pt")
        assert out["local_experts"] == 8
        assert torch.allclose(out["lp"], ref, atol=1e-5), (out["lp"] - ref).abs().max()
        assert out["exported"].keys() == original.keys()
        assert all(torch.equal(out["exported"][k], v) for k, v in original.items())


def test_packing_an_mla_model_warns_where_neither_megatron_nor_te_handles_its_head_sizes(
        monkeypatch):
    """Packed rows of MLA (query/key head 24, value head 16) on Transformer Engine's spec: a
    warning naming trainer.pack_sequences when megatron-core does not pad the values itself
    (0.16.1) and TE is older than 2.20; none with TE 2.20, with a megatron that pads, unpacked,
    or with equal head sizes."""
    import types
    import megatron.core.transformer.multi_latent_attention as mla
    from moe_rl.trainer import model_builder
    monkeypatch.setattr(model_builder, "te_available", lambda: True)
    te = ["2.19.0"]
    monkeypatch.setattr(model_builder, "version", lambda name: te[0])
    monkeypatch.delattr(mla, "_prepare_mla_core_attention_value", raising=False)
    config = types.SimpleNamespace(multi_latent_attention=True, qk_head_dim=16,
                                   qk_pos_emb_head_dim=8, v_head_dim=16)
    warning = model_builder.mla_packing_warning(config, packed=True)
    assert warning.startswith("trainer.pack_sequences:") and "Transformer Engine 2.19.0" in warning
    assert model_builder.mla_packing_warning(config, packed=False) is None
    equal = types.SimpleNamespace(**{**vars(config), "v_head_dim": 24})
    assert model_builder.mla_packing_warning(equal, packed=True) is None
    te[0] = "2.20.0.dev0+abc"
    assert model_builder.mla_packing_warning(config, packed=True) is None
    te[0] = "2.19.0"
    monkeypatch.setattr(mla, "_prepare_mla_core_attention_value", lambda *a: None, raising=False)
    assert model_builder.mla_packing_warning(config, packed=True) is None


@pytest.mark.parametrize("q_lora", [24, None], ids=["q_lora", "no_q_lora"])
def test_a_weight_sync_keeps_what_sglang_fuses_in_one_bucket(tmp_path, q_lora):
    """SGLang loads a q-LoRA layer's q_a_proj and kv_a_proj_with_mqa as one fused tensor only
    when both arrive in the same update call: streamed one parameter per bucket, each layer's
    pair still shares a bucket (its FP8 scales are made inside the bucket); without q-LoRA
    nothing is held together. Every tensor is sent once."""
    from moe_rl.weights.hf import iter_hf_buckets
    write_deepseek(tmp_path / "hf", q_lora_rank=q_lora)
    model, spec = build_model(str(tmp_path / "hf"))
    buckets = [[n for n, _ in bucket] for bucket, _ in iter_hf_buckets(model, spec, 1)]
    names = [n for b in buckets for n in b]
    assert len(names) == len(set(names)) == len(megatron_to_hf(model, spec))
    for layer in range(DEEPSEEK["num_hidden_layers"]):
        a = f"model.layers.{layer}.self_attn."
        (kv,) = [b for b in buckets if a + "kv_a_proj_with_mqa.weight" in b]
        if q_lora:
            assert sorted(kv) == [a + "kv_a_proj_with_mqa.weight", a + "q_a_proj.weight"]
        else:
            assert kv == [a + "kv_a_proj_with_mqa.weight"]
