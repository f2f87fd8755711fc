"""megatron-core MoE model from HF configs: weights round trip, equivalence with transformers
under replayed routing, replay controls and agreement, last-position claim, CPU shims."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.trainer.packing import pack_one
from moe_rl.trainer.forward import forward_logprobs
from moe_rl.weights.hf import (load_hf_into_megatron, megatron_to_hf, qkv_merge, qkv_split,
                                       save_hf_checkpoint, tp_merge, tp_split)
from moe_rl.trainer.model_builder import build_model, load_hf_config
from moe_rl.trainer.parallel import init_distributed, init_model_parallel
from moe_rl.trainer.context_parallel import chunk_positions
from moe_rl.trainer.replay import (ReplayController,
                                   sequence_parallel_slice)
from moe_rl.rollout_record import Sample
from tests.hf_models import MIXTRAL, QWEN, write_hf_model


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


def hf_routing(model, ids):
    """Per-MoE-layer top-k ids [B, S, L, K] that transformers itself chose."""
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    B, S = ids.shape
    k = model.config.num_experts_per_tok
    layers = [r.reshape(B, S, -1).topk(k, dim=-1).indices for r in out.router_logits]
    return torch.stack(layers, dim=2), torch.log_softmax(out.logits.float(), -1)


def sample_from(ids, P, routing):
    return Sample(prompt_ids=ids[:P], response_ids=ids[P:],
                  rollout_logprobs=-torch.ones(len(ids) - P), routing=routing.to(torch.uint8))


@pytest.mark.parametrize("cfg,old", [(QWEN, False), (MIXTRAL, False),
                                     ({**QWEN, "rope_theta": 1e6}, False),
                                     ({**QWEN, "rope_theta": 1e6}, True)],
                         ids=["qwen3_moe", "mixtral", "qwen3_theta1e6_rope_parameters",
                              "qwen3_theta1e6_top_level_rope_theta"])
def test_round_trip_and_equivalence_with_transformers(tmp_path, cfg, old):
    path, hf_model = write_hf_model(tmp_path, cfg, old_rope_layout=old)
    conf = json.load(open(os.path.join(path, "config.json")))
    assert ("rope_parameters" in conf) != old   # both transformers layouts are exercised
    model, spec = build_model(path)
    load_hf_into_megatron(model, spec, path)
    # round trip HF -> Megatron -> HF is bit-identical
    original = load_file(os.path.join(path, "model.safetensors"))
    exported = megatron_to_hf(model, spec)
    assert set(exported) == set(original)
    for k, v in original.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    # equivalence under replayed routing
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 48, (n,), generator=g) for n in (40, 29)]   # rotary shows at length
    P = [5, 4]
    from moe_rl.families.rope import rope_settings
    assert rope_settings(conf)[0] == cfg["rope_theta"]
    samples = []
    for ids, p in zip(seqs, P):
        routing, _ = hf_routing(hf_model, ids[None])
        samples.append(sample_from(ids, p, routing[0, :-1]))
    mb = pack_one(samples, [0, 1], pad_token_id=0, num_experts=spec.moe_shape.num_experts)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, spec.moe_shape.topk, spec.moe_shape.num_experts)
    model.eval()
    ctl.replay(mb.replay_indices())
    with torch.no_grad():
        lp, ent = forward_logprobs(model, mb)
    ctl.finish_forward()
    for b, (ids, p) in enumerate(zip(seqs, P)):
        _, ref = hf_routing(hf_model, ids[None])
        want = ref[0, p - 1:len(ids) - 1].gather(1, ids[p:, None]).squeeze(1)
        got = lp[b, p - 1:len(ids) - 1]
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # the router's own choice equals transformers' (float32, confident routers)
    agree = ctl.agreement(mb.replay_indices(), mb.routing_valid_router_order())
    assert agree["routing/agreement"] == 1.0
    assert set(agree) == {"routing/agreement", "routing/token_differs_frac"} | {
        f"routing/agreement_layer_{i}" for i in spec.moe_shape.moe_layers}
    assert agree["routing/token_differs_frac"] == 0.0
    ctl.close()


def test_replay_changes_outputs_and_last_position_is_free(tmp_path):
    path, hf_model = write_hf_model(tmp_path, QWEN, seed=3)
    model, spec = build_model(path)
    load_hf_into_megatron(model, spec, path)
    model.eval()
    ids = torch.randint(0, 48, (10,), generator=torch.Generator().manual_seed(2))
    routing, _ = hf_routing(hf_model, ids[None])
    s = sample_from(ids, 4, routing[0, :-1])
    mb = pack_one([s], [0], pad_token_id=0, num_experts=8)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, 2, 8)
    ctl.replay(mb.replay_indices())
    with torch.no_grad():
        base, _ = forward_logprobs(model, mb)
    # any valid ids at the last position (index P+R-1, no recorded route) change no scored value
    for trial in range(3):
        idx = [t.clone() for t in mb.replay_indices()]
        last = 9  # s = 9, B = 1
        for t in idx:
            t[last] = torch.randperm(8, generator=torch.Generator().manual_seed(trial))[:2]
        ctl.replay(idx)
        with torch.no_grad():
            other, _ = forward_logprobs(model, mb)
        assert torch.equal(other, base)
    # ... while changing a scored position's route does change the log-probs
    idx = [t.clone() for t in mb.replay_indices()]
    for t in idx:
        t[5] = (t[5] + 3) % 8
    ctl.replay(idx)
    with torch.no_grad():
        moved, _ = forward_logprobs(model, mb)
    assert not torch.allclose(moved, base)
    ctl.close()


def test_record_mode_and_checks(tmp_path):
    path, _ = write_hf_model(tmp_path, QWEN, seed=4)
    model, spec = build_model(path)
    load_hf_into_megatron(model, spec, path)
    ids = torch.randint(0, 48, (7,), generator=torch.Generator().manual_seed(5))
    s = Sample(prompt_ids=ids[:3], response_ids=ids[3:], rollout_logprobs=-torch.ones(4))
    mb = pack_one([s], [0], pad_token_id=0)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, 2, 8)
    assert ctl.num_moe_layers == 2 and ctl.layer_names == [0, 2]
    ctl.record()
    with torch.no_grad():
        free, _ = forward_logprobs(model, mb)
    rec = ctl.recorded()
    assert len(rec) == 2 and rec[0].shape == (7, 2)
    ctl.replay(rec)   # replaying the router's own choice reproduces the free forward
    with torch.no_grad():
        again, _ = forward_logprobs(model, mb)
    assert torch.allclose(again, free, atol=1e-6)
    with pytest.raises(ValueError, match="expected one replay tensor per MoE layer"):
        ctl.replay(rec[:1])
    with pytest.raises(ValueError, match="expert ids must lie in"):
        ctl.replay([rec[0], rec[1] + 8])
    with pytest.raises(ValueError, match=r"expected \[tokens, 2\]"):
        ctl.replay([rec[0][:, :1], rec[1][:, :1]])
    ctl.close()


def test_backward_replay_with_recomputation(tmp_path):
    path, hf_model = write_hf_model(tmp_path, QWEN, seed=6)
    ids = torch.randint(0, 48, (8,), generator=torch.Generator().manual_seed(7))
    routing, _ = hf_routing(hf_model, ids[None])
    mb = pack_one([sample_from(ids, 3, routing[0, :-1])], [0], pad_token_id=0, num_experts=8)
    grads = {}
    for recompute in (False, True):   # replay in the recomputed forward: the same gradients
        model, spec = build_model(path, recompute=recompute)
        load_hf_into_megatron(model, spec, path)
        model.train()
        ctl = ReplayController(model, spec.moe_shape.moe_layers, 2, 8, recompute=recompute)
        ctl.replay(mb.replay_indices())
        lp, _ = forward_logprobs(model, mb)
        ctl.finish_forward()
        with ctl.backward():
            lp.sum().backward()
        grads[recompute] = {n: p.grad.clone() for n, p in model.named_parameters()
                            if p.grad is not None}
        ctl.close()
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for n, g in grads[False].items():
        assert torch.allclose(grads[True][n], g, atol=1e-6), n


def test_fused_router_is_refused(tmp_path):
    path, _ = write_hf_model(tmp_path, QWEN, seed=8)
    model, spec = build_model(path)
    model.decoder.layers[0].mlp.router.config.moe_router_fusion = True
    with pytest.raises(ValueError, match="moe_router_fusion"):
        ReplayController(model, spec.moe_shape.moe_layers, 2, 8)
    model.decoder.layers[0].mlp.router.config.moe_router_fusion = False


def test_replay_slicing_helpers():
    S, B, K = 8, 2, 2
    idx = torch.arange(S * B * K).reshape(S * B, K)
    part = sequence_parallel_slice(idx, S, B, 1, 2)
    assert torch.equal(part, idx[4 * B:8 * B])
    assert chunk_positions(0, 8, 0, 2).tolist() == [0, 1, 6, 7]
    assert chunk_positions(0, 8, 1, 2).tolist() == [2, 3, 4, 5]


def test_weight_mapping_helpers_invert():
    q, k, v = torch.randn(16, 5), torch.randn(8, 5), torch.randn(8, 5)
    fused = qkv_merge(q, k, v, n_groups=2)
    for a, b in zip(qkv_split(fused, 2, 4, 2), (q, k, v)):
        assert torch.equal(a, b)
    full = torch.randn(8, 6)
    for kind in ("column", "row", "fc1", "replicated"):
        shards = [tp_split(full, kind, r, 2) for r in range(2)]
        assert torch.equal(tp_merge(shards, kind), full)


def test_save_hf_checkpoint_loads_in_transformers(tmp_path):
    import transformers
    path, hf_model = write_hf_model(tmp_path, QWEN, seed=9)
    model, spec = build_model(path)
    load_hf_into_megatron(model, spec, path)
    out = tmp_path / "export"
    save_hf_checkpoint(megatron_to_hf(model, spec), spec, str(out))
    again = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 48, (1, 6))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf_model(ids).logits)
    from moe_rl.families.shape import MoEShape
    facts = MoEShape.from_hf(json.loads((out / "config.json").read_text()))
    assert facts.num_experts == 8 and facts.moe_layers == (0, 2)
    assert load_hf_config(str(out))["model_type"] == "qwen3_moe"


def test_cpu_compat_refusals_and_shims():
    from moe_rl.trainer.cpu_compat import apply_cpu_shims, check_cpu_settings, cuda_factories_on_cpu
    assert apply_cpu_shims() and apply_cpu_shims()   # idempotent
    assert torch.cuda.current_device() == "cpu"
    with cuda_factories_on_cpu():
        assert torch.zeros(2, device="cuda").device.type == "cpu"
    base = dict(tensor_parallel=1, pipeline_parallel=1, context_parallel=1,
                sequence_parallel=False, dispatcher="allgather")
    check_cpu_settings(**base)
    for change, key in ((dict(dispatcher="alltoall"), "moe_token_dispatcher_type"),
                        (dict(tensor_parallel=2), "trainer.parallel.tensor"),
                        (dict(sequence_parallel=True), "trainer.parallel.sequence"),
                        (dict(pipeline_parallel=2), "trainer.parallel.pipeline"),
                        (dict(context_parallel=2), "trainer.parallel.context")):
        with pytest.raises(ValueError, match=key):
            check_cpu_settings(**{**base, **change})


def test_local_indices_select_this_stage_layers(tmp_path):
    path, _ = write_hf_model(tmp_path, QWEN, seed=10)
    model, spec = build_model(path)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, 2, 8)
    full = [torch.zeros(6, 2, dtype=torch.long), torch.ones(6, 2, dtype=torch.long)]
    local = ctl.local_indices(full, 3, 2)
    assert [int(t[0, 0]) for t in local] == [0, 1]
    # a stage holding only global layer 2 (the model's second MoE layer) gets the second tensor
    ctl.routers = ctl.routers[1:]
    assert int(ctl.local_indices(full, 3, 2)[0][0, 0]) == 1
    with pytest.raises(ValueError, match="one replay tensor per MoE layer of the model"):
        ctl.local_indices(full[:1], 3, 2)
    ctl.close()


def test_scaled_rotary_is_refused_naming_the_field():
    from moe_rl.families.rope import rope_settings
    assert rope_settings({"rope_theta": 5e5}) == (5e5, 1.0)
    assert rope_settings({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == \
        (1e6, 1.0)
    with pytest.raises(ValueError, match="rope_parameters.rope_type: 'yarn'"):
        rope_settings({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6,
                                           "factor": 4.0}})
    with pytest.raises(ValueError, match="rope_scaling.rope_type: 'linear'"):
        rope_settings({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}})


def test_replay_inputs_are_checked_as_the_peers_do(tmp_path):
    path, hf_model = write_hf_model(tmp_path, QWEN, seed=4)
    model, spec = build_model(path)
    load_hf_into_megatron(model, spec, path)
    model.eval()
    ids = torch.randint(0, 48, (10,), generator=torch.Generator().manual_seed(5))
    routing, _ = hf_routing(hf_model, ids[None])
    mb = pack_one([sample_from(ids, 4, routing[0, :-1])], [0], pad_token_id=0,
                  num_experts=spec.moe_shape.num_experts)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, spec.moe_shape.topk, spec.moe_shape.num_experts)
    good = mb.replay_indices()
    # a row repeating an expert id
    bad = [t.clone() for t in good]
    bad[0][3] = torch.tensor([5, 5])
    with pytest.raises(ValueError, match="row 3 repeats an expert id"):
        ctl.replay(bad)
    # ids >= num_experts
    bad = [t.clone() for t in good]
    bad[1][0, 0] = 8
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"):
        ctl.replay(bad)
    # rows != the router's token count: caught inside the forward, naming the layer
    ctl.replay([t[:-2] for t in good])
    with pytest.raises(RuntimeError, match="routes 10 tokens but the replay tensor has 8 rows"):
        with torch.no_grad():
            forward_logprobs(model, mb)
    # every replay tensor consumed exactly once
    ctl.replay(good)
    with torch.no_grad():
        forward_logprobs(model, mb)
        ctl.finish_forward()
        forward_logprobs(model, mb)
    with pytest.raises(RuntimeError, match="ran 2 times"):
        ctl.finish_forward()
    ctl.close()


def test_megatron_router_needs_no_transformer_engine_on_a_gpu(monkeypatch):
    """megatron-core 0.16.1 reads ``moe_utils.te_general_gemm``, which exists only when TE
    imports: on a GPU without TE every router forward raised NameError (seen on an H100). The
    model builder defines it whatever the device: here as if CUDA were present."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from moe_rl.trainer import cpu_compat
    monkeypatch.setattr(cpu_compat, "cuda_absent", lambda: False)
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    assert cpu_compat.apply_cpu_shims() is False   # no CPU shims on a GPU ...
    assert moe_utils.te_general_gemm is None       # ... but the router's name is defined
