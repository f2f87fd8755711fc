"""GLM-4.5-style models (``glm4_moe``): grouped-query attention with q/k/v biases and optional
q/k norm, partial rotary, DeepSeek-V3's router with shared experts and a dense first layer. The
HF checkpoint round-trips bit for bit, and megatron-core scores as transformers does under
replayed and under its own routing (its routers choose transformers' experts)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.model_check import check_trainer, transformers_reference, verdict
from moe_rl.moe_shape import MoEShape
from moe_rl.packing import pack_one
from moe_rl.trainer.forward import forward_logprobs
from moe_rl.trainer.model_builder import build_model
from moe_rl.trainer.parallel import init_distributed, init_model_parallel
from moe_rl.trainer.replay import ReplayController
from moe_rl.types import Sample
from moe_rl.weights.hf import load_hf_into_megatron, megatron_to_hf
from tests.hf_models import hf_forward, write_deepseek


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


@pytest.mark.parametrize("overrides", [{}, {"use_qk_norm": True, "attention_bias": False,
                                            "n_group": 1, "topk_group": 1}],
                         ids=["biases_grouped_router", "qk_norm"])
def test_round_trip_and_equivalence_with_transformers(tmp_path, overrides):
    path = str(tmp_path / "hf")
    hf_model = write_deepseek(path, glm=True, **overrides)
    with open(f"{path}/config.json") as fh:
        conf = json.load(fh)
    assert conf["model_type"] == "glm4_moe"
    model, spec = build_model(path)
    assert spec.facts.moe_layers == (1, 2)
    load_hf_into_megatron(model, spec, path)
    original = load_file(f"{path}/model.safetensors")
    exported = megatron_to_hf(model, spec)
    assert set(exported) == set(original)
    assert ("model.layers.0.self_attn.q_proj.bias" in exported) == conf["attention_bias"]
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in exported
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 48, (n,), generator=g) for n in (40, 29)]   # rotary shows at length
    P = 5
    refs = [hf_forward(hf_model, ids) for ids in seqs]
    samples = [Sample(prompt_ids=ids[:P], response_ids=ids[P:],
                      rollout_logprobs=-torch.ones(len(ids) - P),
                      routing=routing[:-1].to(torch.uint8))
               for ids, (_, routing) in zip(seqs, refs)]
    mb = pack_one(samples, [0, 1], pad_token_id=0, num_experts=8)
    ctl = ReplayController(model, spec.facts.moe_layers, spec.facts.topk, spec.facts.num_experts)
    model.eval()
    for mode in ("replay", "own routing"):
        if mode == "replay":   # transformers' biased (and group-limited) choice replayed
            ctl.replay(mb.replay_indices())
        else:   # the trainer's own choice must then be the same on these confident routers
            ctl.off()
        with torch.no_grad():
            lp, _ = forward_logprobs(model, mb)
        if mode == "replay":
            agreement = ctl.agreement(mb.replay_indices(), mb.routing_valid_router_order())
            assert agreement["routing/agreement"] == 1.0
        ctl.finish_forward()
        for b, (ids, (ref, _)) in enumerate(zip(seqs, refs)):
            want = ref[P - 1:len(ids) - 1].gather(1, ids[P:, None]).squeeze(1)
            got = lp[b, P - 1:len(ids) - 1]
            assert torch.allclose(got, want, atol=1e-4), (mode, (got - want).abs().max())
    ctl.close()
    # and `moe-rl check-model`'s trainer side finds it aligned
    shape = MoEShape.from_hf(conf)
    ref = transformers_reference(path, [s.tolist() for s in seqs], shape)
    assert verdict(list(check_trainer(path, ref, shape)), 0.99, 1e-4)[0]
