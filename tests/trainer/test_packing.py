"""Packing samples into micro-batches: hand-worked rows, the replay order, padding routes."""
import pytest
import torch

from moe_rl.rollout_record import Sample
from moe_rl.trainer.packing import (pack_micro_batches, pack_one, padding_routing_rows,
                                    plan_micro_batches)
from tests.helpers import random_sample


def test_padding_rows_distinct_and_never_all_zero():
    rows = padding_routing_rows(10, 4, 8)
    assert rows.shape == (10, 4)
    for r in rows:
        assert len(set(r.tolist())) == 4
    assert rows.sum(-1).gt(0).all()
    assert set(rows.flatten().tolist()) == set(range(8))


def test_hand_worked_packing_two_samples():
    # sample A: prompt [5, 6], response [7, 8, 9]; sample B: prompt [1], response [2, 3]
    ra = torch.arange(4 * 2 * 2).reshape(4, 2, 2) % 8
    rb = (torch.arange(2 * 2 * 2).reshape(2, 2, 2) + 3) % 8
    a = Sample(prompt_ids=[5, 6], response_ids=[7, 8, 9], rollout_logprobs=[-0.1, -0.2, -0.3],
               loss_mask=[True, False, True], routing=ra.to(torch.uint8), sample_id=0,
               sampling_mask_offsets=[0, 2, 3, 5], sampling_mask_ids=[7, 1, 8, 9, 2])
    b = Sample(prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[-0.4, -0.5],
               routing=rb.to(torch.uint8), sample_id=1,
               sampling_mask_offsets=[0, 1, 3], sampling_mask_ids=[2, 3, 4])
    mb = pack_one([a, b], [0, 1], pad_token_id=0, num_experts=8)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]]
    assert mb.targets.tolist() == [[6, 7, 8, 9, 0], [2, 3, 0, 0, 0]]
    assert mb.response_mask.tolist() == [[False, True, True, True, False],
                                         [True, True, False, False, False]]
    assert mb.score_mask.tolist() == [[False, True, False, True, False],
                                      [True, True, False, False, False]]
    assert torch.equal(mb.routing[0, :4], ra.long())
    assert torch.equal(mb.routing[1, :2], rb.long())
    assert mb.routing_valid.tolist() == [[True] * 4 + [False], [True, True, False, False, False]]
    B, S = 2, 5
    for bb in range(B):
        for s in range(S):
            if not mb.routing_valid[bb, s]:
                expect = padding_routing_rows(1, 2, 8, start=s * B + bb)[0]
                for layer in range(2):
                    assert mb.routing[bb, s, layer].tolist() == expect.tolist()
    # replay order: token (s, b) at index s * B + b
    replay = mb.replay_indices()
    assert len(replay) == 2 and replay[0].shape == (S * B, 2)
    for layer in range(2):
        for s in range(S):
            for bb in range(B):
                assert replay[layer][s * B + bb].tolist() == mb.routing[bb, s, layer].tolist()
    # kept sets on the response rows, in response_mask order (the kernel's rows)
    off, ids = mb.kept.offsets, mb.kept.ids
    assert off.numel() == int(mb.response_mask.sum()) + 1
    rows = [ids[off[k]:off[k + 1]].tolist() for k in range(off.numel() - 1)]
    assert rows == [[7, 1], [8], [9, 2], [2], [3, 4]]
    # unpack back to per-sample response tensors
    got = mb.unpack(mb.targets.float())   # each response position predicts its token
    assert got[0].tolist() == [7, 8, 9] and got[1].tolist() == [2, 3]
    padded = mb.to_response_padded(mb.targets.float())
    assert padded.tolist() == [[7, 8, 9], [2, 3, 0]]


def test_micro_batch_plan_and_pass_logprobs():
    assert plan_micro_batches([3, 9, 5, 9], micro_batch_size=2) == [[1, 3], [2, 0]]
    assert plan_micro_batches([3, 9, 5, 9], max_tokens_per_micro_batch=18) == [[1, 3], [2, 0]]
    assert plan_micro_batches([3, 9, 5, 9], max_tokens_per_micro_batch=10) == [[1], [3], [2, 0]]
    samples = [random_sample(P=2 + i, R=3, sid=i, seed=i, passes=3) for i in range(5)]
    mbs = pack_micro_batches(samples, pad_token_id=0, micro_batch_size=2, num_experts=8,
                             pad_to_multiple=4)
    assert sorted(i for mb in mbs for i in mb.sample_indices) == list(range(5))
    for mb in mbs:
        assert mb.input_ids.shape[1] % 4 == 0
        for k, i in enumerate(mb.sample_indices):
            assert torch.equal(mb.unpack(mb.targets)[k], samples[i].response_ids.long())
    with pytest.raises(ValueError, match="num_experts"):
        pack_micro_batches(samples, pad_token_id=0, micro_batch_size=2)
