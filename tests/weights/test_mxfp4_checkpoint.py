"""Released MXFP4 checkpoints (gpt-oss's) read dequantised: the E2M1 codes and E8M0 scales by
hand, transformers' own MXFP4 loader as the judge of what a stored tensor means, whole tensors
and one expert's rows, and the bfloat16 copy the engines serve."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.weights.hf import HFCheckpoint, write_dequantised_mxfp4
from moe_rl.weights.mxfp4_checkpoint import (dequantise, is_mxfp4_checkpoint,
                                             transformers_dequantising)
from tests.hf_models import write_gpt_oss_mxfp4

STACKED = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj")


def test_codes_and_scales_by_hand():
    """One expert, one output row, one block of 32: byte 0x21 holds 0.5 (low nibble 1, the
    earlier element) then 1.0 (2); 0xF8 holds -0 then -6; the scale 128 doubles, 126 halves;
    the result is [in, out]."""
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0], blocks[0, 0, 0, 1] = 0x21, 0xF8
    blocks[0, 1, 0, 15] = 0x7B                  # -1.5 then 6, the block's last two elements
    scales = torch.tensor([[[128], [126]]], dtype=torch.uint8)
    w = dequantise(blocks, scales, torch.float32)
    assert w.shape == (1, 32, 2)
    assert w[0, :4, 0].tolist() == [1.0, 2.0, -0.0, -12.0] and w[0, 4:, 0].abs().sum() == 0
    assert w[0, 30:, 1].tolist() == [-0.75, 3.0] and w[0, :30, 1].abs().sum() == 0


def test_pairs_that_do_not_match_are_refused():
    with pytest.raises(ValueError, match=r"do not pair: expected uint8"):
        dequantise(torch.zeros(2, 4, 1, 16, dtype=torch.uint8),
                   torch.zeros(2, 4, 2, dtype=torch.uint8))


def test_the_reader_dequantises_as_transformers_own_loader(tmp_path):
    """transformers' MXFP4 loader, asked to dequantise (as check-model asks it: transformers 5.25
    would fetch Triton kernels from the Hub where triton is installed), and moe_rl's reader give the same
    tensors bit for bit, whole and one expert's row; the plain tensors are read as stored."""
    import transformers
    path = str(tmp_path / "mxfp4")
    stored = write_gpt_oss_mxfp4(path, seed=5)
    assert is_mxfp4_checkpoint(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path, **transformers_dequantising(path)).state_dict()
    ckpt = HFCheckpoint(path)
    for name in STACKED:
        ours = ckpt.get(name)
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs[name]), name
        assert ours.abs().max() > 0 and torch.equal(ckpt.get_row(name, 3), ours[3])
    bias = "model.layers.0.mlp.experts.gate_up_proj_bias"
    assert torch.equal(ckpt.get(bias), stored[bias])


def test_the_copy_the_engines_serve_is_the_same_model_unquantised(tmp_path):
    src, dst = str(tmp_path / "mxfp4"), str(tmp_path / "bf16")
    write_gpt_oss_mxfp4(src, seed=6)
    write_dequantised_mxfp4(src, dst)
    conf = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in conf and conf["model_type"] == "gpt_oss"
    assert not is_mxfp4_checkpoint(dst)
    copy, ckpt = load_file(f"{dst}/model.safetensors"), HFCheckpoint(src)
    assert not any(k.endswith(("_blocks", "_scales")) for k in copy)
    assert set(copy) == {k.removesuffix("_blocks") for k in ckpt.where
                         if not k.endswith("_scales")}
    for k, v in copy.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, ckpt.get(k)), k
