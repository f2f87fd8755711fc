"""MiniMax-M2 models (``minimax_m2``): a q/k RMSNorm over all heads at once (megatron-core's
per-head norm swapped for :mod:`moe_rl.trainer.full_width_qk_norm`), half-head rotary (the
release's ``rotary_dim``), DeepSeek-V3's sigmoid router with its expert bias on the MoE block,
Mixtral's expert names. The HF checkpoint round-trips bit for bit and megatron-core scores as
transformers does under replayed and under its own routing."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.checks.model import check_trainer, transformers_reference, verdict
from moe_rl.config import ConfigError, init_hf_fields, load_config
from moe_rl.families.shape import MoEShape, model_spec
from moe_rl.trainer.full_width_qk_norm import FullWidthRMSNorm
from moe_rl.trainer.model_builder import build_model, transformer_config
from moe_rl.trainer.parallel import ParallelSizes, init_distributed, init_model_parallel
from moe_rl.weights.hf import load_hf_into_megatron, megatron_to_hf
from tests.hf_models import MINIMAX_M2, assert_scores_as_transformers, write_minimax_m2


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


def test_round_trip_and_equivalence_with_transformers(tmp_path):
    path = str(tmp_path / "hf")
    hf_model = write_minimax_m2(path)
    model, spec = build_model(path)
    norms = [m for n, m in model.named_modules() if n.endswith(("q_layernorm", "k_layernorm"))]
    assert len(norms) == 4 and all(isinstance(m, FullWidthRMSNorm) for m in norms)
    load_hf_into_megatron(model, spec, path)
    original = load_file(f"{path}/model.safetensors")
    assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in original
    exported = megatron_to_hf(model, spec)
    assert set(exported) == set(original)
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    seqs = assert_scores_as_transformers(model, spec, hf_model)
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    shape = MoEShape.from_hf(conf)
    ref = transformers_reference(path, [s.tolist() for s in seqs], shape)
    assert verdict(list(check_trainer(path, ref, shape)), 1.0, 1e-5)[0]


def test_the_norm_spans_every_head_by_hand():
    """Two heads of two: the mean square is over all four values, not each head's two."""
    norm = FullWidthRMSNorm(2, 2, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.tensor([[[1.0, 1.0], [3.0, 3.0]]])        # mean square 5
    want = torch.tensor([[[1.0, 2.0], [9.0, 12.0]]]) / 5 ** 0.5
    assert torch.allclose(norm(x), want)


def test_the_releases_rotary_dim_sets_the_rotary_fraction():
    """The released config.json says ``rotary_dim`` (64 of a 128 head) where transformers'
    layout says partial_rotary_factor: the rotary turns half of each head either way."""
    release = {**MINIMAX_M2, "model_type": "minimax_m2", "head_dim": 128, "rotary_dim": 64,
               "rope_parameters": None, "rope_theta": 5000000}
    assert model_spec(release).family.rotary(release)["rotary_percent"] == 0.5


@pytest.mark.parametrize("change,field", [
    ({"qk_norm_type": "per_head"}, "qk_norm_type"),
    ({"use_routing_bias": False}, "use_routing_bias"),
    ({"shared_intermediate_size": 64}, "shared_intermediate_size"),
    ({"scoring_func": "softmax"}, "scoring_func")])
def test_what_is_not_built_is_refused_naming_the_field(change, field):
    spec = model_spec({**MINIMAX_M2, "model_type": "minimax_m2", **change})
    with pytest.raises(ValueError, match=field):
        transformer_config(spec)
    with pytest.raises(ValueError, match="trainer.parallel.tensor"):
        spec.family.megatron_settings(model_spec({**MINIMAX_M2, "model_type": "minimax_m2"}),
                                      ParallelSizes(tensor=2), 0.0)


def test_minimax_init_shape_and_tensor_parallelism_at_config_time():
    """`moe-rl init-model`'s MiniMax-M2 shape under config.json's names; tensor parallelism
    and a rotary fraction that leaves an odd number of dimensions are refused naming the key."""
    base = ["model.path=/nonexistent/minimax", "model.init.architecture=minimax_m2"]
    fields = init_hf_fields(load_config(None, base).model.init)
    assert fields == {**fields, "model_type": "minimax_m2", "num_local_experts": 8,
                      "intermediate_size": 64, "partial_rotary_factor": 0.5}
    for override, key in {"model.init.glm.partial_rotary_factor=0.1":
                          "model.init.glm.partial_rotary_factor",
                          "trainer.parallel.tensor=2": "trainer.parallel.tensor"}.items():
        with pytest.raises(ConfigError, match=key):
            load_config(None, [*base, override, "cluster.gpus_per_node=8"])
