"""Tiny random HF checkpoints written by transformers itself (Qwen3-MoE, Mixtral-free Qwen
layout, DeepSeek-V3 with YaRN, GLM-4.5, gpt-oss), and transformers' own forward pass as the
reference."""
from __future__ import annotations

import json

import torch

from tests.helpers import sharpen

DEEPSEEK = dict(vocab_size=48, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=2.5,
                kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=8,
                qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=4,
                first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64,
                num_nextn_predict_layers=0, rms_norm_eps=1e-6, tie_word_embeddings=False)


GLM4_MOE = dict(vocab_size=48, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
                n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, n_group=2,
                topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6,
                tie_word_embeddings=False)


YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


GPT_OSS = dict(vocab_size=48, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
               num_experts_per_tok=2, sliding_window=4, swiglu_limit=0.5,
               max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                    original_max_position_embeddings=16, beta_fast=32.0,
                                    beta_slow=1.0, truncate=False))


MINIMAX_M2 = dict(vocab_size=48, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rotary_dim=4, scoring_func="sigmoid",
                  use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer",
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                       partial_rotary_factor=0.5))


def write_minimax_m2(path, seed=0, bias_std=0.1, **overrides):
    """A random MiniMaxM2ForCausalLM saved to ``path``: q/k norms over all heads with weights
    far from 1 (a per-head norm would score otherwise), rotary on half of each head, confident
    routers, a non-zero expert bias. Returns the transformers model."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.MiniMaxM2ForCausalLM(
        transformers.MiniMaxM2Config(**{**MINIMAX_M2, **overrides}))
    sharpen(model)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * bias_std)
    model.eval()
    model.save_pretrained(path)
    return model


def write_gpt_oss(path, seed=0, **overrides):
    """A random GptOssForCausalLM saved to ``path``: windows of 4 keys on layers 0 and 2, YaRN,
    a SwiGLU limit of 0.5 that clamps, random biases and sinks, confident routers. Returns the
    transformers model."""
    import transformers
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**GPT_OSS, **overrides}))
    sharpen(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("bias", "sinks")):
                p.copy_(torch.randn(p.shape) * 0.5)
            elif n.endswith("router.weight"):
                p.mul_(20.0)
            elif "experts" in n:
                p.normal_(0, 0.3)
    model.eval()
    model.save_pretrained(path)
    return model


def write_deepseek(path, seed=0, bias_std=0.1, glm=False, **overrides):
    """A random DeepseekV3ForCausalLM (or, with ``glm``, Glm4MoeForCausalLM: DeepSeek-V3's
    router under grouped-query attention; non-trivial norms and attention biases, confident
    routers, a non-zero expert bias) saved to ``path``; returns the transformers model."""
    import transformers
    torch.manual_seed(seed)
    if glm:
        model = transformers.Glm4MoeForCausalLM(
            transformers.Glm4MoeConfig(**{**GLM4_MOE, **overrides}))
    else:
        model = transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(**{**DEEPSEEK, **overrides}))
    sharpen(model)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * bias_std)
        for n, p in model.named_parameters():
            if n.endswith("_proj.bias"):   # attention biases, zero at initialisation
                p.copy_(torch.randn(p.shape) * 0.5)
    model.eval()
    model.save_pretrained(path)
    return model


def hf_forward(model, ids):
    """(log-probs [S, V], the routers' choices [S, L_moe, K]) of transformers on ``ids``."""
    picks = []
    routers = [getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
               for layer in model.model.layers]
    hooks = [r.register_forward_hook(lambda m, i, o: picks.append(o[2]))
             for r in routers if r is not None]
    with torch.no_grad():
        out = model(input_ids=ids[None])
    for h in hooks:
        h.remove()
    return torch.log_softmax(out.logits.float()[0], -1), torch.stack(picks, 1)


def assert_scores_as_transformers(model, spec, hf_model, prompt_len: int = 5) -> list:
    """megatron-core ``model`` scores two random sequences (40 and 29 tokens: the rotary
    embedding shows at length) as transformers' ``hf_model`` does (atol 1e-4), with
    transformers' routing replayed and with its own, whose choice must then be transformers'
    (confident routers). Returns the sequences."""
    from moe_rl.trainer.packing import pack_one
    from moe_rl.trainer.forward import forward_logprobs
    from moe_rl.trainer.replay import ReplayController
    from moe_rl.rollout_record import Sample, routing_dtype
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, hf_model.config.vocab_size, (n,), generator=g) for n in (40, 29)]
    P = prompt_len
    refs = [hf_forward(hf_model, ids) for ids in seqs]
    samples = [Sample(prompt_ids=ids[:P], response_ids=ids[P:],
                      rollout_logprobs=-torch.ones(len(ids) - P),
                      routing=routing[:-1].to(routing_dtype(spec.moe_shape.num_experts)))
               for ids, (_, routing) in zip(seqs, refs)]
    mb = pack_one(samples, [0, 1], pad_token_id=0, num_experts=spec.moe_shape.num_experts)
    ctl = ReplayController(model, spec.moe_shape.moe_layers, spec.moe_shape.topk, spec.moe_shape.num_experts)
    model.eval()
    for mode in ("replay", "own routing"):
        if mode == "replay":   # transformers' (biased, group-limited) choice replayed
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
    return seqs


QWEN = dict(model_type="qwen3_moe", vocab_size=48, hidden_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
            moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
            mlp_only_layers=[1], norm_topk_prob=True, max_position_embeddings=64,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)

MIXTRAL = dict(model_type="mixtral", vocab_size=48, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=16,
               num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
               rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def write_hf_model(tmp_path, cfg, seed=0, old_rope_layout=False):
    """A random transformers model of ``cfg`` saved as a HF checkpoint; returns (dir, model).
    ``old_rope_layout``: config.json rewritten with a top-level ``rope_theta`` and
    ``rope_scaling: null`` (transformers < 5) instead of ``rope_parameters``."""
    import transformers
    torch.manual_seed(seed)
    if cfg["model_type"] == "qwen3_moe":
        hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        model = transformers.Qwen3MoeForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.MixtralConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        model = transformers.MixtralForCausalLM(hf_cfg)
    sharpen(model)
    model.eval()
    path = tmp_path / cfg["model_type"]
    model.save_pretrained(path)
    if old_rope_layout:
        conf = json.loads((path / "config.json").read_text())
        params = conf.pop("rope_parameters")
        conf.update(rope_theta=params["rope_theta"], rope_scaling=None)
        (path / "config.json").write_text(json.dumps(conf))
    return str(path), model


def mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked expert tensor ``w`` [E, in, out] as an MXFP4 checkpoint stores it: blocks
    [E, out, in / 32, 16] (two E2M1 codes a byte, the earlier element in the lower nibble) and
    E8M0 scales [E, out, in / 32], by moe_rl's MXFP4 rounding (``weights/mxfp4.py``)."""
    from moe_rl.weights.mxfp4 import BLOCK, E2M1, block_scale_exponents, round_to_e2m1
    rows = w.float().transpose(1, 2)                               # [E, out, in]
    groups = rows.reshape(*rows.shape[:-1], -1, BLOCK)
    exponent = block_scale_exponents(groups)                       # [E, out, G, 1]
    values = round_to_e2m1(groups / torch.exp2(exponent))
    magnitude = (values.abs()[..., None] == torch.tensor(E2M1)).int().argmax(-1)
    codes = (magnitude + 8 * (values < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def write_gpt_oss_mxfp4(path, seed=0) -> dict[str, torch.Tensor]:
    """A random gpt-oss (experts 32 wide, so that every expert matrix has whole blocks of 32)
    saved as its release is (:func:`as_mxfp4_release`). Returns the tensors it stores."""
    write_gpt_oss(path, seed=seed, intermediate_size=32)
    return as_mxfp4_release(path)


def as_mxfp4_release(path) -> dict[str, torch.Tensor]:
    """The gpt-oss checkpoint at ``path`` rewritten in the form of gpt-oss's release: each
    stacked expert tensor in MXFP4 blocks and scales, the rest in bfloat16, ``quantization_config``
    {quant_method: mxfp4}. Returns the tensors it stores."""
    import json
    import os
    from safetensors.torch import load_file, save_file
    plain = load_file(os.path.join(path, "model.safetensors"))
    stored = {}
    for name, t in plain.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[name + "_blocks"], stored[name + "_scales"] = mxfp4_pack(t)
        else:
            stored[name] = t.to(torch.bfloat16)
    save_file(stored, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as fh:
        conf = json.load(fh)
    conf.update(dtype="bfloat16", quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(conf, fh)
    return stored
