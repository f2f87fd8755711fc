"""The rollout record: validation messages, pickle-free round trips, compact routing."""
import pytest
import torch

from moe_rl.families.shape import MoEShape
from moe_rl.rollout_record import RecordError, RolloutBatch, Sample, compact_routing, routing_dtype
from tests.helpers import random_sample as make_sample


def _shape(moe_layers: int, topk: int, num_experts: int) -> MoEShape:
    return MoEShape(num_layers=moe_layers, moe_layers=tuple(range(moe_layers)), topk=topk,
                    num_experts=num_experts)


SPEC = _shape(2, 2, 8)


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


def test_an_edited_header_is_refused():
    import json
    import struct
    from moe_rl.rollout_record import RecordError, RolloutBatch, Sample
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
