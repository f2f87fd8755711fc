"""Every family's tiny HF checkpoint, a small batch and the trainer's log-probs with every
gradient: what the tests comparing two ways of computing the same model share (the grouped
experts against megatron's loop, fused attention against the local kernel)."""
from __future__ import annotations

import torch

from moe_rl.rollout_record import Sample
from moe_rl.trainer.forward import forward_logprobs
from moe_rl.trainer.packing import pack_one
from moe_rl.trainer.replay import ReplayController
from tests.hf_models import (MIXTRAL, QWEN, write_deepseek, write_gpt_oss, write_hf_model,
                             write_minimax_m2)

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "minimax_m2"]


def write_family(kind: str, tmp_path):
    """The tiny random checkpoint of family ``kind`` (seed 5) under ``tmp_path``."""
    if kind in ("qwen3_moe", "mixtral"):
        return write_hf_model(tmp_path, QWEN if kind == "qwen3_moe" else MIXTRAL, seed=5)[0]
    path = tmp_path / kind
    {"deepseek_v3": lambda: write_deepseek(path, seed=5),
     "glm4_moe": lambda: write_deepseek(path, seed=5, glm=True),
     "gpt_oss": lambda: write_gpt_oss(path, seed=5),
     "minimax_m2": lambda: write_minimax_m2(path, seed=5)}[kind]()
    return path


def three_samples(spec, seed=0, pinned=None, packed=False):
    """Three samples in one micro-batch (padded rows, or one packed row); ``pinned``: every
    position routed to these experts of every MoE layer."""
    g = torch.Generator().manual_seed(seed)
    vocab, layers = spec.vocab_size, len(spec.moe_shape.moe_layers)
    samples = [Sample(prompt_ids=torch.randint(0, vocab, (p,), generator=g).tolist(),
                      response_ids=torch.randint(0, vocab, (r,), generator=g).tolist(),
                      rollout_logprobs=-torch.ones(r),
                      routing=None if pinned is None else torch.tensor(
                          pinned, dtype=torch.uint8).expand(p + r - 1, layers, len(pinned)))
               for p, r in ((5, 7), (3, 9), (8, 4))]
    return pack_one(samples, [0, 1, 2], pad_token_id=0, num_experts=spec.moe_shape.num_experts,
                    packed=packed)


def logprobs_and_grads(model, spec, mb, replay_ids=None):
    """Log-probs and every parameter's gradient of a weighted sum of them (``replay_ids``: the
    routing replayed)."""
    ctl = None
    if replay_ids is not None:
        ctl = ReplayController(model, spec.moe_shape.moe_layers, spec.moe_shape.topk,
                               spec.moe_shape.num_experts)
        ctl.replay(replay_ids)
    model.zero_grad()
    lp, _ = forward_logprobs(model, mb)
    w = torch.linspace(0.5, 1.5, lp.numel()).reshape(lp.shape)
    (lp.float() * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if ctl is not None:
        ctl.close()
    return lp.detach(), grads
