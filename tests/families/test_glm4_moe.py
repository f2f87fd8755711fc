"""GLM-4.5-style models (``glm4_moe``): grouped-query attention with q/k/v biases and optional
q/k norm, partial rotary, DeepSeek-V3's router with shared experts and a dense first layer. The
HF checkpoint round-trips bit for bit, and megatron-core scores as transformers does under
replayed and under its own routing (its routers choose transformers' experts)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.config import ConfigError, init_hf_fields, load_config
from moe_rl.checks.model import check_trainer, transformers_reference, verdict
from moe_rl.families.shape import MoEShape
from moe_rl.trainer.model_builder import build_model
from moe_rl.trainer.parallel import init_distributed, init_model_parallel
from moe_rl.weights.hf import load_hf_into_megatron, megatron_to_hf
from tests.helpers import GLM_INIT
from tests.hf_models import assert_scores_as_transformers, write_deepseek


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
    assert spec.moe_shape.moe_layers == (1, 2)
    load_hf_into_megatron(model, spec, path)
    original = load_file(f"{path}/model.safetensors")
    exported = megatron_to_hf(model, spec)
    assert set(exported) == set(original)
    assert ("model.layers.0.self_attn.q_proj.bias" in exported) == conf["attention_bias"]
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in exported
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    seqs = assert_scores_as_transformers(model, spec, hf_model)
    # and `moe-rl check-model`'s trainer side finds it aligned
    shape = MoEShape.from_hf(conf)
    ref = transformers_reference(path, [s.tolist() for s in seqs], shape)
    assert verdict(list(check_trainer(path, ref, shape)), 0.99, 1e-4)[0]


def test_glm_init_shape_is_checked_at_config_time():
    """`moe-rl init-model`'s GLM-4.5 shape: what transformers or megatron-core could not build
    the same way is refused at load time, naming the key."""
    glm = ["model.path=/nonexistent/glm", *GLM_INIT]
    bad = {"model.init.glm.partial_rotary_factor=0.3": "model.init.glm.partial_rotary_factor",
           "model.init.glm.partial_rotary_factor=0": "model.init.glm.partial_rotary_factor",
           "model.init.num_key_value_heads=3": "model.init.num_key_value_heads",
           "model.init.deepseek.n_group=3": "model.init.deepseek.n_group",
           "model.init.num_experts_per_tok=2": "model.init.deepseek.topk_group"}
    for override, key in bad.items():
        with pytest.raises(ConfigError, match=key):
            load_config(None, [*glm, override])
    init = load_config(None, glm).model.init
    assert init_hf_fields(init) == {**init_hf_fields(init), "model_type": "glm4_moe",
                                    "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
                                    "partial_rotary_factor": 0.5, "attention_bias": True,
                                    "use_qk_norm": True, "first_k_dense_replace": 1}
    assert "decoder_sparse_step" not in init_hf_fields(init)
