"""gpt-oss models (``gpt_oss``): learned attention sinks, sliding-window layers between full
ones, YaRN, biases on every projection, the router's softmax over its top-k logits, experts
with biases and a clamped SwiGLU, the experts stacked in one HF tensor per layer. The HF
checkpoint round-trips bit for bit, megatron-core scores as transformers does under replayed
and under its own routing, and the reference engine's attention (sinks, windows) is
transformers' own."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.checks.model import check_trainer, transformers_reference, verdict
from moe_rl.config import ConfigError, init_hf_fields, load_config
from moe_rl.families.shape import MoEShape, model_spec
from moe_rl.trainer.model_builder import build_model, transformer_config
from moe_rl.trainer.parallel import ParallelSizes, init_distributed, init_model_parallel
from moe_rl.weights.hf import load_hf_into_megatron, megatron_to_hf, megatron_to_row, row_to_megatron
from tests.helpers import GPT_OSS_INIT
from tests.hf_models import GPT_OSS, assert_scores_as_transformers, write_gpt_oss


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


def test_round_trip_and_equivalence_with_transformers(tmp_path):
    path = str(tmp_path / "hf")
    hf_model = write_gpt_oss(path)
    with open(f"{path}/config.json") as fh:
        conf = json.load(fh)
    assert conf["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    model, spec = build_model(path)
    assert spec.moe_shape.moe_layers == (0, 1, 2)
    load_hf_into_megatron(model, spec, path)
    original = load_file(f"{path}/model.safetensors")
    exported = megatron_to_hf(model, spec)
    assert set(exported) == set(original)
    assert exported["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 32, 32)
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    seqs = assert_scores_as_transformers(model, spec, hf_model)   # 40 and 29 tokens: windows
    shape = MoEShape.from_hf(conf)                                # and YaRN act
    ref = transformers_reference(path, [s.tolist() for s in seqs], shape)
    assert verdict(list(check_trainer(path, ref, shape)), 0.99, 1e-5)[0]


def test_stacked_rows_hand_worked():
    """One expert's row of ``gate_up_proj`` [hidden 2, 2 x inter 2], columns g0 u0 g1 u1, is
    linear_fc1 [g0; g1; u0; u1] (as rows of [out, in]); the bias likewise; down_proj's row is
    transposed."""
    row = torch.tensor([[1., 2., 3., 4.], [5., 6., 7., 8.]])
    fc1 = row_to_megatron("gate_up", row)
    assert fc1.tolist() == [[1., 5.], [3., 7.], [2., 6.], [4., 8.]]
    assert torch.equal(megatron_to_row("gate_up", fc1), row)
    bias = torch.tensor([1., 2., 3., 4.])
    assert row_to_megatron("gate_up_bias", bias).tolist() == [1., 3., 2., 4.]
    assert torch.equal(megatron_to_row("gate_up_bias", row_to_megatron("gate_up_bias", bias)),
                       bias)
    assert torch.equal(row_to_megatron("down", row), row.t())


def test_reference_engine_attention_is_transformers_own(tmp_path):
    """The reference engine's split-KV attention with gpt-oss's sinks and windows scores a
    left-padded batch, and decodes it token by token from its cache, as transformers' eager
    attention does (float32)."""
    import transformers
    from moe_rl.engines.reference import split_kv
    path = str(tmp_path / "hf")
    eager = write_gpt_oss(path)
    split = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=split_kv.register()).eval()
    ids = torch.randint(0, 48, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
        got = split(input_ids=ids, attention_mask=mask).logits
        assert (got - want)[0].abs().max() < 1e-5 and (got - want)[1, 5:].abs().max() < 1e-5
        out = split(input_ids=ids[:, :12], attention_mask=mask[:, :12], use_cache=True)
        cache, steps = out.past_key_values, []
        for t in range(12, 24):
            out = split(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1],
                        cache=cache, use_cache=True)
            steps.append(out.logits[:, -1])
    assert (torch.stack(steps[:-1], 1) - want[:, 12:23]).abs().max() < 1e-5


@pytest.mark.parametrize("change,field", [
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"attention_bias": False}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters.rope_type")])
def test_what_is_not_built_is_refused_naming_the_field(change, field):
    hf = {**GPT_OSS, "model_type": "gpt_oss",
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], **change}
    with pytest.raises(ValueError, match=field):
        spec = model_spec(hf)
        transformer_config(spec)
        spec.family.rotary(hf)


def test_tensor_parallelism_is_refused_naming_the_setting():
    hf = {**GPT_OSS, "model_type": "gpt_oss",
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    spec = model_spec(hf)
    with pytest.raises(ValueError, match="trainer.parallel.tensor"):
        spec.family.megatron_settings(spec, ParallelSizes(tensor=2), 0.0)


@pytest.mark.parametrize("override,key", [
    ("rollout.quantization=fp8", "rollout.quantization"),
    ("trainer.parallel.tensor=2", "trainer.parallel.tensor")])
def test_what_a_gpt_oss_run_cannot_take_is_refused_when_its_configuration_loads(override, key):
    """Before any engine starts: FP8 rollout weights (its stacked experts would be served
    unquantised) and tensor parallelism, on the model.init shape as on a checkpoint."""
    base = ["model.path=/nonexistent/gpt_oss", *GPT_OSS_INIT]
    load_config(None, base)
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*base, override])


def test_the_mxfp4_release_trains_read_dequantised_and_aligned_with_transformers(tmp_path):
    """A checkpoint in the release's form (experts in MXFP4 blocks and scales): its
    configuration loads, megatron-core built from it scores and routes as transformers' own
    MXFP4 loader's model within check-model's 1e-5, and it exports as the unquantised model
    (no quantization_config), the values the engines' bfloat16 copy holds."""
    from tests.hf_models import write_gpt_oss_mxfp4
    from moe_rl.weights.hf import HFCheckpoint
    path = str(tmp_path / "mxfp4")
    write_gpt_oss_mxfp4(path, seed=7)
    load_config(None, [f"model.path={path}"])
    conf = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    shape = MoEShape.from_hf(conf)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 48, (n,), generator=g).tolist() for n in (30, 17)]
    ref = transformers_reference(path, prompts, shape)
    assert verdict(list(check_trainer(path, ref, shape)), 1.0, 1e-5)[0]
    model, spec = build_model(path)
    assert "quantization_config" not in spec.hf_config
    load_hf_into_megatron(model, spec, path)
    exported, ckpt = megatron_to_hf(model, spec), HFCheckpoint(path)
    assert set(exported) == {k.removesuffix("_blocks") for k in ckpt.where
                             if not k.endswith("_scales")}
    for k, v in exported.items():
        assert torch.equal(v, ckpt.get(k).float()), k


def test_gpt_oss_init_shape_is_checked_at_config_time():
    """`moe-rl init-model`'s gpt-oss shape: what transformers or megatron-core could not build
    the same way is refused at load time, naming the key; the shape under config.json's names
    (the expert width is its intermediate_size, windows alternate from the first layer, YaRN
    stretches the original context to max_position_embeddings)."""
    base = ["model.path=/nonexistent/gpt_oss", *GPT_OSS_INIT]
    bad = {"model.init.gpt_oss.yarn_original_max_position_embeddings=512":
           "model.init.gpt_oss.yarn_original_max_position_embeddings",
           "model.init.num_key_value_heads=3": "model.init.num_key_value_heads",
           "model.init.gpt_oss.sliding_window=0": "model.init.gpt_oss.sliding_window"}
    for override, key in bad.items():
        with pytest.raises(ConfigError, match=key):
            load_config(None, [*base, override])
    init = load_config(None, [*base, "model.init.num_hidden_layers=3"]).model.init
    fields = init_hf_fields(init)
    assert fields == {**fields, "model_type": "gpt_oss", "num_local_experts": 8,
                      "intermediate_size": init.moe_intermediate_size, "sliding_window": 4,
                      "layer_types": ["sliding_attention", "full_attention",
                                      "sliding_attention"]}
    assert not {"decoder_sparse_step", "norm_topk_prob", "moe_intermediate_size"} & set(fields)


def _export_under_ep2(rank, port, path, out):
    import os
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moe_rl.trainer.parallel import destroy
    from moe_rl.weights.hf import iter_hf_buckets
    init_distributed(rank=rank, world_size=2)
    init_model_parallel(ParallelSizes(expert=2))
    model, spec = build_model(path, sizes=ParallelSizes(expert=2))
    load_hf_into_megatron(model, spec, path)
    local = sum(1 for n, _ in model.named_parameters()
                if "decoder.layers.0." in n and "local_experts" in n and "fc1.weight" in n)
    streamed = {k: v.clone() for bucket, _ in iter_hf_buckets(model, spec, 4096)
                for k, v in bucket}
    torch.save({"local": local, "streamed": streamed}, f"{out}/rank{rank}.pt")
    destroy()


@pytest.mark.multiproc
def test_stacked_experts_export_whole_from_two_expert_parallel_ranks(tmp_path):
    """Under expert parallel 2 each rank holds 4 of the 8 experts; the streaming exporter (the
    weight sync's and the HF export's) hands the exporting rank every stacked tensor whole, each
    built from both ranks' rows, bit for bit the source checkpoint's, even where the bucket size
    (4 KiB) is below one stacked tensor's (32 KiB)."""
    from moe_rl.trainer.parallel import free_port
    from tests.helpers import start_ranks
    path = str(tmp_path / "hf")
    write_gpt_oss(path, seed=3)
    start_ranks(_export_under_ep2, (free_port(), path, str(tmp_path)), 2)
    first, second = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert first["local"] == second["local"] == 4
    original = load_file(f"{path}/model.safetensors")
    assert set(first["streamed"]) == set(original) and second["streamed"] == {}
    for k, v in original.items():
        assert torch.equal(first["streamed"][k], v), k


def test_the_reference_engine_windows_count_positions_in_a_batch_with_prefix_hits(tmp_path):
    """A batched prefill of a prefix-cache hit beside a miss lays the hit's row out [cached
    KV, pad, new tokens]; its sliding windows count positions, not cache columns, in the
    prefill and in every decode step after it: each response's log-probs equal transformers'
    score of that sequence alone."""
    from moe_rl.engines.reference.engine import ReferenceEngine, Request, SamplingParams
    path = str(tmp_path / "hf")
    hf_model = write_gpt_oss(path)
    eng = ReferenceEngine(path)
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(0, 48, (n,), generator=g).tolist() for n in (14, 9))

    def request(ids, rid, new):
        return Request(ids, SamplingParams(max_new_tokens=new, sampling_seed=3, ignore_eos=True),
                       rid, return_logprob=True)
    eng.run([request(a, "warm", 1)])                       # a's prefix in the cache
    outs = eng.run([request(a + [5, 6, 7], "hit", 8), request(b, "miss", 8)])
    assert outs[0]["meta_info"]["cached_tokens"] == 14    # then 6 pads before its 3 new ones
    for ids, out in zip((a + [5, 6, 7], b), outs):
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        seq = ids + [t for _, t, _ in out["meta_info"]["output_token_logprobs"]]
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([seq])).logits[0].float()
        want = torch.log_softmax(logits, -1)[len(ids) - 1:-1].gather(
            1, torch.tensor(seq[len(ids):])[:, None])[:, 0]
        assert (got - want).abs().max() < 1e-5, (got - want).abs().max()


def test_the_router_logits_are_computed_in_the_models_dtype(tmp_path):
    """SGLang (TinyGemmLinear in the model's dtype) and transformers (F.linear) compute gpt-oss's
    router logits in bfloat16 for a bfloat16 model; megatron-core's router does too (it computed
    them in float32), bit for bit on CPU."""
    path = str(tmp_path / "hf")
    write_gpt_oss(path)
    model, spec = build_model(path, dtype=torch.bfloat16)
    load_hf_into_megatron(model, spec, path)
    router = model.decoder.layers[0].mlp.router
    x = torch.randn(5, GPT_OSS["hidden_size"], generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        got = router.gating(x)
    want = torch.nn.functional.linear(x, router.weight, router.bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
