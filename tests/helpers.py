"""Test helpers: a tiny random Qwen3-MoE written as a HF checkpoint and rollout samples scored by
transformers itself (log-probs and routing), as an engine would return them."""
from __future__ import annotations

import pytest
import torch

from moe_rl.types import Sample, compact_routing

TINY_QWEN = dict(vocab_size=48, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, intermediate_size=48,
                 moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                 decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
                 max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)


def sharpen(model) -> None:
    """Non-trivial norms (a mapping mix-up shows) and confident routers (no near-ties)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "gate.weight" in n:
                p.mul_(20.0)


def sglang_cpu_python() -> str:
    """The interpreter of the SGLang CPU environment (``make test-sglang`` sets
    ``MOE_RL_SGLANG_PYTHON``); the test fails without one."""
    import os
    python = os.environ.get("MOE_RL_SGLANG_PYTHON")
    if not python:
        pytest.fail("MOE_RL_SGLANG_PYTHON is not set: the real-engine tests need the SGLang CPU "
                    "environment; run them with `make test-sglang`")
    return python


def write_tiny_qwen(path, seed: int = 0, **overrides):
    """Save a random tiny Qwen3-MoE (confident routers) to ``path``; returns the model."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(**{**TINY_QWEN, **overrides})
    model = transformers.Qwen3MoeForCausalLM(cfg)
    sharpen(model)
    model.eval()
    model.save_pretrained(path)
    return model


def engine_samples(model, n_groups: int = 2, group_size: int = 2, seed: int = 0,
                   prompt_len: int = 4, max_resp: int = 5, noise: float = 0.0):
    """Samples with responses drawn from ``model``; rollout log-probs and routing recorded from
    a transformers forward (plus optional Gaussian ``noise`` on the log-probs, clamped <= 0)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    k = model.config.num_experts_per_tok
    n_exp = model.config.num_experts
    samples = []
    sid = 0
    for grp in range(n_groups):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g)
        for _ in range(group_size):
            r = int(torch.randint(2, max_resp + 1, (1,), generator=g))
            resp = torch.randint(0, vocab, (r,), generator=g)
            ids = torch.cat([prompt, resp])[None]
            with torch.no_grad():
                out = model(input_ids=ids, output_router_logits=True)
            logp = torch.log_softmax(out.logits.float()[0], -1)
            lp = logp[prompt_len - 1:-1].gather(1, resp[:, None]).squeeze(1)
            if noise:
                lp = (lp + noise * torch.randn(lp.shape, generator=g)).clamp(max=0.0)
            routing = torch.stack([rl.topk(k, dim=-1).indices for rl in out.router_logits], 1)
            samples.append(Sample(prompt_ids=prompt, response_ids=resp, rollout_logprobs=lp,
                                  routing=compact_routing(routing[:-1], n_exp),
                                  reward=float(torch.rand((), generator=g)), group_id=grp,
                                  sample_id=sid))
            sid += 1
    return samples


def kernel_on_logits(logits, targets, offsets, ids, temperature=1.0):
    """The log-prob kernel on logits themselves (hidden = logits, output weight = identity)."""
    from moe_rl_kernels import logprob_entropy
    eye = torch.eye(logits.shape[1], dtype=logits.dtype)
    return logprob_entropy(logits, eye, targets, temperature=temperature, kept_offsets=offsets,
                           kept_ids=ids, backend="torch")


def assert_serves_like(eng, ref_url: str, layout, prompt: list[list[int]]):
    """``eng`` generates exactly what the server at ``ref_url`` generates for ``prompt`` (same
    seed): token ids and log-probs bit for bit. Returns (eng's sample, the reference's)."""
    from moe_rl.engines.base import SamplingConfig
    from moe_rl.engines.sglang.client import SGLangEngine
    from moe_rl.engines.sglang.pool import ServerPool
    from moe_rl.rollout.trajectories import generate_samples
    sampling = SamplingConfig(max_new_tokens=4)
    got = generate_samples(eng, prompt, 1, sampling, seed=3)[0]
    want = generate_samples(SGLangEngine(lambda: ServerPool([ref_url]), layout,
                                         need_routing=True, need_mask=False),
                            prompt, 1, sampling, seed=3)[0]
    assert got.response_ids.tolist() == want.response_ids.tolist()
    assert torch.equal(got.rollout_logprobs, want.rollout_logprobs)
    return got, want


def sample_from_response(resp: dict, prompt: list[int], layout, *, need_routing: bool,
                         need_mask: bool, group_id: int, sample_id: int):
    """One ``/generate`` response through the rollout's single-turn path: decoded into a turn
    (the SGLang client's decoder), then made a sample (the one-turn trajectory)."""
    from moe_rl.engines.sglang.decode import decode_turn
    from moe_rl.rollout.trajectories import sample_of_turn
    turn = decode_turn(resp, len(prompt), layout, need_routing=need_routing,
                       need_mask=need_mask)
    return sample_of_turn(prompt, turn, group_id=group_id, sample_id=sample_id)
