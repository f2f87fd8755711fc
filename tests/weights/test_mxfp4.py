"""MXFP4 rollout weights (rollout.quantization: mxfp4): the quantiser against a float64 one
built from every E2M1 code, hand-worked rounding (ties to even, saturation), the layers the
reference engine quantises, and a run through `moe-rl train`."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from moe_rl.weights.mxfp4 import E2M1, mxfp4_round_trip

# every FP4 E2M1 code: sign bit, 2 exponent bits, 1 mantissa bit (bias 1; exponent 0 subnormal)
CODES = []
for sign, exp, man in itertools.product((0, 1), range(4), range(2)):
    mag = (man / 2) if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    CODES.append(((-1) ** sign * mag, man))   # (value, mantissa bit: even code when 0)


def reference_round_trip(x: list[float]) -> list[float]:
    """One block, in float64: scale 2^(floor(log2 amax) - 2), each element to the code nearest
    x / scale (ties: the code with mantissa bit 0), times the scale."""
    amax = max(abs(v) for v in x)
    if amax == 0:
        return [0.0] * len(x)
    scale = 2.0 ** (math.floor(math.log2(amax)) - 2)
    out = []
    for v in x:
        t = v / scale
        best = min(CODES, key=lambda c: (abs(t - c[0]), c[1], -math.copysign(1, c[0]) *
                                         math.copysign(1, t)))
        out.append(best[0] * scale)
    return out


def test_the_codes_are_e2m1():
    assert sorted({abs(v) for v, _ in CODES}) == list(E2M1)


def test_against_the_float64_quantiser_from_every_code():
    g = torch.Generator().manual_seed(0)
    for scale_exp in (-9, -3, 0, 4):
        w = torch.randn(6, 96, generator=g) * 2.0 ** scale_exp
        w[0, :32] = 0.0                                          # an all-zero block
        w[1, 5] = 7.9 * w[1, :32].abs().max()                    # a block whose amax sets it
        got = mxfp4_round_trip(w)
        for row in range(6):
            for b in range(3):
                block = w[row, 32 * b:32 * (b + 1)].double().tolist()
                want = reference_round_trip(block)
                assert got[row, 32 * b:32 * (b + 1)].double().tolist() == pytest.approx(
                    want, abs=0, rel=1e-12), (scale_exp, row, b)


def test_hand_worked_block_ties_to_even_and_saturation():
    # amax 7 -> scale 2^(2 - 2) = 1: the midpoints go to the even code, 7 saturates at 6
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.3, 2.9, -0.75, -5.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.5, 3.0, -1.0, -4.0]
    assert mxfp4_round_trip(x).tolist() == want
    # the same block scaled by 2^-5: the same codes, the scale follows
    assert mxfp4_round_trip(x * 2 ** -5).tolist() == [v * 2 ** -5 for v in want]
    # a 40-wide row is a block of 32 and a block of 8, each with its own scale
    row = torch.cat([torch.full((32,), 100.0), torch.full((8,), 0.3)])
    assert mxfp4_round_trip(row).tolist() == [96.0] * 32 + [0.25] * 8   # 6 x 16; 0.3 x 16 = 4.8 -> 4
    assert mxfp4_round_trip(row.to(torch.bfloat16)).dtype == torch.bfloat16


def test_the_engine_quantises_the_fp8_paths_layers_only(tmp_path):
    import transformers
    from moe_rl.config import ModelInitConfig
    from moe_rl.engines.reference.mxfp4_inference import apply_mxfp4
    from moe_rl.models.tiny import write_tiny_model
    path = write_tiny_model(ModelInitConfig(seed=3), str(tmp_path / "m"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    count = apply_mxfp4(model)
    after = dict(model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert count > 0 and changed
    for n in before:
        untouched = ("embed_tokens" in n or "lm_head" in n or "norm" in n
                     or n.endswith("mlp.gate.weight"))
        if untouched:
            assert n not in changed, n
        else:
            assert torch.equal(after[n], mxfp4_round_trip(before[n])), n


@pytest.mark.loop
def test_mxfp4_rollouts_through_moe_rl_train(tmp_path):
    """4-bit rollout weights against the float32 trainer: a real mismatch (k3 well above the
    float32 engine's 1e-14), routing that differs, and the run trains through it."""
    from tests.helpers import train_tiny
    _, rows = train_tiny(tmp_path, 2, 4, "rollout.quantization=mxfp4")
    assert len(rows) == 2
    assert all(r["mismatch/k3"] > 1e-5 for r in rows)
    assert all(r["routing/agreement"] < 1.0 for r in rows)


def test_experts_stacked_in_out_are_quantised_along_their_input_dimension(tmp_path):
    """gpt-oss's experts (transformers' is_transposed: [E, in, out]) get blocks of 32 along
    dim -2, their biases none: the rollout weights equal what gpt-oss's MXFP4 release format
    holds for the same weights (packed as the release packs them, read back as transformers'
    own MXFP4 loader reads it: tests/weights/test_mxfp4_checkpoint.py)."""
    import transformers
    from moe_rl.engines.reference.mxfp4_inference import apply_mxfp4
    from moe_rl.weights.mxfp4_checkpoint import dequantise
    from tests.hf_models import mxfp4_pack, write_gpt_oss
    write_gpt_oss(str(tmp_path / "m"), intermediate_size=32)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"),
                                                              dtype=torch.float32)
    experts = model.model.layers[1].mlp.experts
    assert experts.is_transposed
    before = {n: p.detach().clone() for n, p in experts.named_parameters()}
    apply_mxfp4(model)
    for n in ("gate_up_proj", "down_proj"):
        want = dequantise(*mxfp4_pack(before[n]), dtype=torch.float32)
        assert torch.equal(getattr(experts, n), want), n
        assert not torch.equal(want, mxfp4_round_trip(before[n])), n   # not along dim -1
    for n in ("gate_up_proj_bias", "down_proj_bias"):
        assert torch.equal(getattr(experts, n), before[n]), n


@pytest.mark.loop
@pytest.mark.slow
def test_mxfp4_rollouts_of_gpt_oss_through_moe_rl_train(tmp_path):
    """4-bit rollout weights of the tiny gpt-oss against its float32 trainer: a real mismatch,
    and the run trains through it."""
    from tests.helpers import GPT_OSS_INIT, init_tiny_model, train_tiny
    model = init_tiny_model(tmp_path / "gpt_oss", "tiny_cpu.yaml", *GPT_OSS_INIT)
    _, rows = train_tiny(tmp_path, 2, 4, "rollout.quantization=mxfp4", f"model.path={model}")
    assert len(rows) == 2
    assert all(r["mismatch/k3"] > 1e-5 for r in rows)
