"""The rollout record: validation messages, pickle-free round trips, compact routing, packing."""
import pytest
import torch

from moe_rl.moe_shape import MoEShape
from moe_rl.packing import pack_micro_batches, pack_one, padding_routing_rows, plan_micro_batches
from moe_rl.types import RecordError, RolloutBatch, Sample, compact_routing, routing_dtype


def _shape(moe_layers: int, topk: int, num_experts: int) -> MoEShape:
    return MoEShape(num_layers=moe_layers, moe_layers=tuple(range(moe_layers)), topk=topk,
                    num_experts=num_experts)


SPEC = _shape(2, 2, 8)


def make_sample(P=3, R=4, sid=0, group=0, seed=0, routing=True, mask=True, passes=0, vocab=20):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=g)
    resp = torch.randint(0, vocab, (R,), generator=g)
    kw = {}
    if routing:
        kw["routing"] = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(
            (P + R - 1) * 2)]).reshape(P + R - 1, 2, 2).to(torch.uint8)
    if mask:
        sets = []
        for tok in resp.tolist():
            extra = torch.randperm(vocab, generator=g)[:3].tolist()
            sets.append(sorted(set(extra) | {tok}))
        off = [0]
        for s_ in sets:
            off.append(off[-1] + len(s_))
        kw["sampling_mask_offsets"] = torch.tensor(off)
        kw["sampling_mask_ids"] = torch.tensor([i for s_ in sets for i in s_], dtype=torch.int32)
    if passes:
        kw["pass_logprobs"] = -torch.rand(passes, R, generator=g)
    return Sample(prompt_ids=prompt, response_ids=resp, rollout_logprobs=-torch.rand(R, generator=g),
                  loss_mask=torch.tensor([True] * (R - 1) + [False]), reward=0.5 * sid,
                  group_id=group, weight_version=3, sample_id=sid, metadata={"answer": "42"}, **kw)


def _same(a: Sample, b: Sample):
    for name in ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "pass_logprobs",
                 "routing", "sampling_mask_offsets", "sampling_mask_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.reward, a.group_id, a.weight_version, a.sample_id, a.metadata) == \
        (b.reward, b.group_id, b.weight_version, b.sample_id, b.metadata)


def test_routing_dtype_choice_and_compaction():
    assert routing_dtype(256) == torch.uint8
    assert routing_dtype(257) == torch.int16
    r = torch.tensor([[[3, 255]]], dtype=torch.int32)
    assert compact_routing(r, 256).dtype == torch.uint8
    with pytest.raises(ValueError, match="expert ids must lie in"):
        compact_routing(torch.tensor([[[256]]]), 256)


def test_round_trip_bit_exact_with_shared_and_differing_prompt_routing(tmp_path):
    a = make_sample(sid=0, group=7, seed=1, passes=2)
    b = make_sample(sid=1, group=7, seed=2, passes=2)
    b.prompt_ids = a.prompt_ids.clone()
    b.routing[:a.prompt_len] = a.routing[:a.prompt_len]   # same prefix-cache routing
    c = make_sample(sid=2, group=7, seed=3, passes=2)      # same group, different prompt rows
    d = make_sample(sid=3, group=8, seed=4, passes=2, mask=False)
    batch = RolloutBatch([a, b, c, d])
    data = batch.to_bytes()
    # the format is safetensors: an 8-byte length, a JSON header declaring every tensor (dtype,
    # shape, byte range) and the scalars as strings, then raw bytes: nothing to unpickle
    import json
    import struct
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    assert all(set(v) == {"dtype", "shape", "data_offsets"}
               for k, v in header.items() if k != "__metadata__")
    assert all(isinstance(v, str) for v in header["__metadata__"].values())
    assert max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__") \
        == len(data) - 8 - n
    back = RolloutBatch.from_bytes(data, vocab_size=20, moe_shape=SPEC)
    for x, y in zip(batch.samples, back.samples):
        _same(x, y)
    # the shared prompt block is stored once: 3 blocks for 4 samples
    from safetensors.torch import load
    t = load(data)
    assert t["routing_prompt_offsets"].numel() - 1 == 3
    batch.save(tmp_path / "b.st")
    for x, y in zip(batch.samples, RolloutBatch.load(tmp_path / "b.st").samples):
        _same(x, y)


def test_int16_routing_round_trip():
    s = make_sample(routing=False)
    s.routing = torch.randint(0, 300, (s.routed_positions, 2, 2),
                              generator=torch.Generator().manual_seed(0)).to(torch.int16)
    s.routing[0, 0, 0] = 299   # an id beyond uint8
    s.validate()
    back = RolloutBatch.from_bytes(RolloutBatch([s]).to_bytes(),
                                   moe_shape=_shape(2, 2, 300))
    _same(s, back.samples[0])
    assert back.samples[0].routing.dtype == torch.int16 and int(back.samples[0].routing.max()) > 255


def test_corrupt_and_truncated_data():
    data = RolloutBatch([make_sample()]).to_bytes()
    with pytest.raises(RecordError, match="truncated"):
        RolloutBatch.from_bytes(data[:5])
    with pytest.raises(RecordError):
        RolloutBatch.from_bytes(data[:len(data) // 2])
    with pytest.raises(RecordError, match="header"):
        RolloutBatch.from_bytes(data[:8] + b"\xff" * (len(data) - 8))


@pytest.mark.parametrize("mutate,field", [
    (lambda s: setattr(s, "routing", s.routing[:-1]), "routing: expected 6 positions"),
    (lambda s: setattr(s, "routing", s.routing.to(torch.int32)), "routing: expected dtype uint8"),
    (lambda s: setattr(s, "loss_mask", s.loss_mask[:-1]), "loss_mask: expected 4 entries"),
    (lambda s: s.rollout_logprobs.__setitem__(1, float("nan")), "rollout_logprobs: non-finite"),
    (lambda s: s.rollout_logprobs.__setitem__(1, 0.5), "rollout_logprobs: log-probs must be <= 0"),
    (lambda s: setattr(s, "pass_logprobs", torch.zeros(2, 3)), "pass_logprobs: expected [n_passes"),
    (lambda s: s.sampling_mask_offsets.__setitem__(2, 100), "sampling_mask_offsets"),
    (lambda s: setattr(s, "reward", float("inf")), "reward: expected a finite number"),
])
def test_validation_names_sample_and_field(mutate, field):
    s = make_sample(sid=17)
    mutate(s)
    with pytest.raises(RecordError) as info:
        s.validate()
    assert str(info.value).startswith("sample 17: ") and field in str(info.value)


def test_validation_against_model_spec_and_vocab():
    s = make_sample(sid=5)
    with pytest.raises(RecordError, match="sample 5: routing: expected 3 MoE layers"):
        s.validate(moe_shape=_shape(3, 2, 8))
    with pytest.raises(RecordError, match="sample 5: routing: expected top-k 4"):
        s.validate(moe_shape=_shape(2, 4, 8))
    with pytest.raises(RecordError, match="sample 5: routing: expert id"):
        s.validate(moe_shape=_shape(2, 2, 4))
    s.prompt_ids = s.prompt_ids.clamp(max=10)
    s.response_ids = s.response_ids.clone()
    s.response_ids[0] = 19
    with pytest.raises(RecordError, match="sample 5: response_ids: token ids must lie in"):
        s.validate(vocab_size=19)
    with pytest.raises(RecordError, match="sample 6: sampling_mask_ids: response token 1 "
                                          r"\(id 4\) is not in its kept set"):
        Sample(prompt_ids=[1], response_ids=[3, 4], rollout_logprobs=[-1.0, -1.0], sample_id=6,
               sampling_mask_offsets=[0, 1, 3], sampling_mask_ids=[3, 5, 6])
    with pytest.raises(RecordError, match="sample 7: sampling_mask_ids: response token 0 has an "
                                          "empty kept set"):
        Sample(prompt_ids=[1], response_ids=[3], rollout_logprobs=[-1.0], sample_id=7,
               sampling_mask_offsets=[0, 0], sampling_mask_ids=[])
    with pytest.raises(RecordError, match="sample 8: sampling_mask_ids: a response token's kept "
                                          "set lists an id twice"):
        Sample(prompt_ids=[1], response_ids=[3, 4], rollout_logprobs=[-1.0, -1.0], sample_id=8,
               sampling_mask_offsets=[0, 1, 3], sampling_mask_ids=[3, 4, 4])
    s = make_sample(sid=5)
    # validation also runs on load
    data = RolloutBatch([s]).to_bytes()
    with pytest.raises(RecordError, match="sample 5: routing"):
        RolloutBatch.from_bytes(data, moe_shape=_shape(3, 2, 8))


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
    samples = [make_sample(P=2 + i, R=3, sid=i, seed=i, passes=3) for i in range(5)]
    mbs = pack_micro_batches(samples, pad_token_id=0, micro_batch_size=2, num_experts=8,
                             pad_to_multiple=4)
    assert sorted(i for mb in mbs for i in mb.sample_indices) == list(range(5))
    for mb in mbs:
        assert mb.input_ids.shape[1] % 4 == 0
        for k, i in enumerate(mb.sample_indices):
            assert torch.equal(mb.unpack(mb.targets)[k], samples[i].response_ids.long())
    with pytest.raises(ValueError, match="num_experts"):
        pack_micro_batches(samples, pad_token_id=0, micro_batch_size=2)


def test_an_edited_header_is_refused():
    import json
    import struct
    from moe_rl.types import RecordError, RolloutBatch, Sample
    batch = RolloutBatch([Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5],
                                 rollout_logprobs=[-0.1, -0.2]),
                          Sample(prompt_ids=[6], response_ids=[7, 8, 9],
                                 rollout_logprobs=[-0.3, -0.4, -0.5], sample_id=1)])
    data = batch.to_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    samples = json.loads(header["__metadata__"]["samples"])
    samples[0]["prompt_len"], samples[0]["response_len"] = 4, 1   # same totals, moved tokens
    header["__metadata__"]["samples"] = json.dumps(samples)
    raw = json.dumps(header).encode()
    raw += b" " * (n - len(raw)) if len(raw) <= n else b""
    edited = struct.pack("<Q", len(raw)) + raw + data[8 + n:]
    with pytest.raises(RecordError, match="sample 0: header lengths"):
        RolloutBatch.from_bytes(edited)
    assert RolloutBatch.from_bytes(data).samples[0].prompt_ids.tolist() == [1, 2, 3]
