"""Packed sequences (``trainer.pack_sequences``): the first-fit-decreasing plan, the packed row's
layout, and the megatron forward on packed rows (THD: each slot attended on its own) against the
same samples in padded rows and against the packed row under a block-diagonal causal mask
(log-probs, entropies, gradients and routing; R3 on and off; Qwen3-MoE and DeepSeek-V3 MLA)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_rl.trainer.packing import pack_one, plan, plan_micro_batches, plan_packed_micro_batches
from moe_rl.trainer.forward import forward_logprobs
from moe_rl.trainer.model_builder import build_model
from moe_rl.trainer.parallel import init_distributed, init_model_parallel
from moe_rl.trainer.replay import ReplayController
from moe_rl.rollout_record import Sample, compact_routing
from moe_rl.weights.hf import load_hf_into_megatron
from tests.helpers import engine_samples, write_tiny_qwen
from tests.hf_models import YARN, hf_forward, write_deepseek


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    init_distributed()
    init_model_parallel()
    yield


def test_first_fit_decreasing_hand_cases():
    # longest first: 9 (1) opens row A, 9 (3) row B, 5 (2) row C, 3 (0) fills A to 12,
    # 2 (4) goes to B (11)
    assert plan_packed_micro_batches([3, 9, 5, 9, 2], max_tokens_per_micro_batch=12) == \
        [[1, 0], [3, 4], [2]]
    # slots rounded up to 4: 12, 12, 8 (+4 for sample 0 = 12), and 4 for sample 4 alone
    assert plan_packed_micro_batches([3, 9, 5, 9, 2], max_tokens_per_micro_batch=12,
                                     slot_multiple=4) == [[1], [3], [2, 0], [4]]
    # a sample longer than the budget gets its own row; the row cap counts samples
    assert plan_packed_micro_batches([20, 1, 1, 1], max_tokens_per_micro_batch=8,
                                     micro_batch_size=2) == [[0], [1, 2], [3]]
    # plan: the trainer's one entry, padded or packed
    lengths = [3, 9, 5, 9, 2]
    assert plan(lengths, micro_batch_size=2, max_tokens_per_micro_batch=None) == \
        plan_micro_batches(lengths, micro_batch_size=2)
    assert plan(lengths, micro_batch_size=None, max_tokens_per_micro_batch=12,
                pack_sequences=True) == [[1, 0], [3, 4], [2]]
    with pytest.raises(ValueError, match="packed rows need a token budget"):
        plan(lengths, micro_batch_size=2, max_tokens_per_micro_batch=None, pack_sequences=True)


def _sample(P, R, base, mask=False):
    ids = torch.arange(base, base + P + R)
    return Sample(prompt_ids=ids[:P], response_ids=ids[P:], rollout_logprobs=torch.zeros(R),
                  loss_mask=[j % 2 == 0 for j in range(R)],
                  routing=torch.full((P + R - 1, 1, 2), base, dtype=torch.uint8),
                  sampling_mask_offsets=torch.arange(R + 1) * 2 if mask else None,
                  sampling_mask_ids=torch.stack([ids[P:], 100 + torch.arange(R)], 1).flatten()
                  if mask else None)


def test_packed_row_layout():
    a, b = _sample(3, 2, 10, mask=True), _sample(2, 3, 40, mask=True)
    mb = pack_one([a, b], [0, 1], pad_token_id=0, num_experts=64, packed=True, slot_multiple=4,
                  pad_to_multiple=12)
    # slots 5 -> 8 and 5 -> 8; the row 16 -> 24 (a multiple of 12), its tail a third slot
    assert mb.shape == (1, 24) and mb.packed
    assert mb.segments[0].tolist() == [0] * 8 + [1] * 8 + [2] * 8
    assert mb.position_ids[0].tolist() == list(range(8)) * 3
    assert mb.cu_seqlens().tolist() == [0, 8, 16, 24]
    assert mb.input_ids[0, :5].tolist() == list(range(10, 15))
    assert mb.input_ids[0, 8:13].tolist() == list(range(40, 45))
    assert mb.targets[0, :4].tolist() == list(range(11, 15))
    assert mb.targets[0, 8:12].tolist() == list(range(41, 45))
    assert mb.response_mask[0].nonzero().flatten().tolist() == [2, 3, 9, 10, 11]
    assert mb.score_mask[0].nonzero().flatten().tolist() == [2, 9, 11]
    assert mb.response_slices() == [(0, slice(2, 4)), (0, slice(9, 12))]
    assert mb.routing_valid[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert (mb.routing[0, :4] == 10).all() and (mb.routing[0, 8:12] == 40).all()
    assert mb.sample_positions(torch.tensor([False, True]))[0].nonzero().flatten().tolist() == \
        [8, 9, 10, 11]
    # the kernel's rows are the response positions in order: a's two sets, then b's three
    assert mb.kept.offsets.tolist() == [0, 2, 4, 6, 8, 10]
    assert mb.kept.ids.tolist() == [13, 100, 14, 101, 42, 100, 43, 101, 44, 102]
    # attention follows the slots (THD): no dense mask
    assert mb.attention_mask is None
    # response-aligned values come back per sample
    values = torch.arange(24, dtype=torch.float32)[None]
    assert mb.to_response_padded(values).tolist() == [[2, 3, 0], [9, 10, 11]]
    # grown for expert parallelism: the new positions are a slot of their own
    grown = mb.padded_to(1, 26, 64)
    assert grown.segments[0, 24:].tolist() == [3, 3]
    assert grown.cu_seqlens().tolist() == [0, 8, 16, 24, 26] and grown.attention_mask is None
    with pytest.raises(ValueError, match="a packed micro-batch is one row"):
        mb.padded_to(2, 26, 64)
    assert grown.response_slices() == mb.response_slices()


def _grads_and_outputs(model, ctl, mb, replay: bool, weight: torch.Tensor):
    """Log-probs, entropies [N, R_max] of ``mb``, the gradient of a fixed weighting of both,
    and the routing the routers chose (per sample, compact)."""
    model.zero_grad()
    if replay:
        ctl.replay(mb.replay_indices())
    else:
        ctl.record()
    lp, ent = forward_logprobs(model, mb)
    ctl.finish_forward()
    lp_r, ent_r = mb.to_response_padded(lp), mb.to_response_padded(ent)
    (lp_r * weight).sum().add((ent_r * weight.flip(1)).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    chosen = ctl.own_choice() if replay else ctl.recorded()
    B, S = mb.shape
    per = torch.stack([t.reshape(S, B, -1) for t in chosen], dim=2)
    routes = []
    for i in range(len(mb.sample_indices)):
        n = int(mb.prompt_lens[i] + mb.response_lens[i]) - 1
        o, b = int(mb.sample_starts[i]), int(mb.sample_rows[i])
        routes.append(per[o:o + n, b].sort(-1).values)
    return lp_r.detach(), ent_r.detach(), grads, routes


def _check_packed_equals_padded(model_dir, samples):
    model, spec = build_model(str(model_dir))
    load_hf_into_megatron(model, spec, str(model_dir))
    model.eval()
    f = spec.moe_shape
    num_experts = f.num_experts
    ctl = ReplayController(model, f.moe_layers, f.topk, num_experts)
    idx = list(range(len(samples)))
    padded = pack_one(samples, idx, pad_token_id=0, num_experts=num_experts)
    packed = pack_one(samples, idx, pad_token_id=0, num_experts=num_experts, packed=True,
                      slot_multiple=4)
    R = max(s.response_len for s in samples)
    weight = torch.randn(len(samples), R, generator=torch.Generator().manual_seed(0))
    # an independent reference for the packed row: the same row forwarded as one ordinary row
    # under a block-diagonal causal mask (rotary embedding is relative: the slots' offsets cancel)
    seg = packed.segments[0]
    causal = torch.triu(torch.ones(seg.numel(), seg.numel(), dtype=torch.bool), diagonal=1)
    block = replace(packed, segments=None, attention_mask=(causal | (seg[:, None] != seg[None]))
                    [None, None], position_ids=torch.arange(seg.numel())[None])
    for replay in (True, False):
        a = _grads_and_outputs(model, ctl, padded, replay, weight)
        for other in (packed, block):
            b = _grads_and_outputs(model, ctl, other, replay, weight)
            assert torch.allclose(a[0], b[0], atol=2e-5), (replay, (a[0] - b[0]).abs().max())
            assert torch.allclose(a[1], b[1], atol=2e-5), (replay, (a[1] - b[1]).abs().max())
            assert set(a[2]) == set(b[2])
            for name in a[2]:
                assert torch.allclose(a[2][name], b[2][name], atol=1e-5, rtol=1e-4), \
                    (replay, name, (a[2][name] - b[2][name]).abs().max())
            for x, y in zip(a[3], b[3]):   # the same experts for every routed position
                assert torch.equal(x, y), replay
    ctl.close()


def test_packed_equals_padded_qwen3(tmp_path):
    hf_model = write_tiny_qwen(tmp_path / "qwen")
    samples = engine_samples(hf_model, n_groups=2, group_size=2, seed=5, prompt_len=6,
                             max_resp=9)
    _check_packed_equals_padded(tmp_path / "qwen", samples)


@pytest.mark.parametrize("overrides", [{}, {"rope_parameters": YARN}], ids=["mla", "mla_yarn"])
def test_packed_equals_padded_deepseek_v3(tmp_path, overrides):
    hf_model = write_deepseek(tmp_path / "ds", **overrides)
    g = torch.Generator().manual_seed(3)
    samples = []
    for n, P in ((20, 5), (17, 4), (11, 6)):   # 20 + 17 + 11 -> slots 20, 20, 12 = 52 < 64
        ids = torch.randint(0, 48, (n,), generator=g)
        _, routing = hf_forward(hf_model, ids)
        samples.append(Sample(prompt_ids=ids[:P], response_ids=ids[P:],
                              rollout_logprobs=-torch.ones(n - P),
                              routing=compact_routing(routing[:-1], 16)))
    _check_packed_equals_padded(tmp_path / "ds", samples)
