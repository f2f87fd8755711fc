"""Core attention through torch's fused kernel (moe_rl/trainer/sdpa_attention.py) against
megatron-core's local kernel: equal within float32 rounding, forward and backward, on padded and
packed (THD) rows, grouped-query heads and MLA's narrower value heads; every family's model
built on it but gpt-oss (attention sinks, sliding windows), whose attention stays local."""
import functools

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from moe_rl.trainer.cpu_compat import apply_cpu_shims
from moe_rl.trainer.local_attention import PackedLocalAttention
from moe_rl.trainer.local_mla import LocalMLACoreAttention
from moe_rl.trainer.model_builder import build_model
from moe_rl.trainer.parallel import init_distributed, init_model_parallel
from moe_rl.trainer.sdpa_attention import SDPAttention, attention_unsupported, varlen_kernel
from moe_rl.weights.hf import load_hf_into_megatron
from tests.trainer_runs import FAMILIES, logprobs_and_grads, three_samples, write_family

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    apply_cpu_shims()
    init_distributed()
    init_model_parallel()
    yield


def _config(heads=4, groups=2, dim=8, **extra):
    return TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=dim, attention_dropout=0.0,
                             hidden_dropout=0.0, use_cpu_initialization=True,
                             cuda_graph_scope=[], **extra)


def _qkv(s, b, heads, groups, qk_dim, v_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = (lambda h, d: torch.randn(s, b, h, d, generator=g).requires_grad_())
    return make(heads, qk_dim), make(groups, qk_dim), make(groups, v_dim)


def _both(local, fused, args, kwargs):
    outs, grads = [], []
    for module in (local, fused):
        q, k, v = (t.detach().clone().requires_grad_() for t in args)
        out = module(q, k, v, **kwargs)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        outs.append(out.detach())
        grads.append([q.grad, k.grad, v.grad])
    return outs, grads


def _causal(s):
    return torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]


def _block_diagonal(lengths):
    """Causal inside each block, nothing across (True = masked)."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return _causal(seg.numel()) | (seg[:, None] != seg[None])[None, None]


@pytest.mark.parametrize("mask", ["none", "causal", "block"])
@pytest.mark.parametrize("groups", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_padded_rows_equal_the_local_kernel(groups, mask):
    """No mask (causal: the forwarder's rows), the causal triangle given, or another mask
    (block-diagonal), which is followed, not taken for causal."""
    cfg = _config(groups=groups)
    args = (cfg, 1, AttnMaskType.causal, "self")
    local, fused = PackedLocalAttention(*args), SDPAttention(*args)
    given = {"none": None, "causal": _causal(7), "block": _block_diagonal([3, 4])}[mask]
    (want, got), (want_g, got_g) = _both(local, fused, _qkv(7, 3, 4, groups, 8, 8),
                                         dict(attention_mask=given))
    assert got.shape == want.shape == (7, 3, 32)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, **TOL)


def test_packed_rows_equal_the_local_kernel_slot_by_slot():
    cfg = _config()
    args = (cfg, 1, AttnMaskType.causal, "self")
    cu = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=5, max_seqlen_kv=5)
    q, k, v = (t[:, 0] for t in _qkv(12, 1, 4, 2, 8, 8))
    (want, got), (want_g, got_g) = _both(PackedLocalAttention(*args), SDPAttention(*args),
                                         (q, k, v), dict(attention_mask=None,
                                                         packed_seq_params=params))
    assert got.shape == (12, 32)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, **TOL)


def _varlen_stand_in(signature: str):
    """A variable-length attention with the installed torch's ``signature`` (torch's own runs
    on CUDA only; this one attends slot by slot from the bounds it is given, so that what
    moe_rl hands the kernel, not the kernel, is under test here)."""
    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, enable_gqa=False, **causal):
        assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
        assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
        assert causal in ({"window_size": (-1, 0)}, {"is_causal": True})
        if signature == "old_no_gqa":
            assert q.shape[1] == k.shape[1]   # the grouped heads were repeated for it
        bounds = cu_q.tolist()
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=scale,
            enable_gqa=enable_gqa)[0].transpose(0, 1) for a, b in zip(bounds, bounds[1:])])
    if signature == "new":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                        window_size=(-1, -1), enable_gqa=False):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                          enable_gqa=enable_gqa, window_size=window_size)
    elif signature == "old":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                        is_causal=False, scale=None, enable_gqa=False):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                          enable_gqa=enable_gqa, is_causal=is_causal)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                        is_causal=False, scale=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                          is_causal=is_causal)
    return varlen_attn


@pytest.mark.parametrize("signature", ["new", "old", "old_no_gqa"])
def test_packed_rows_go_to_the_variable_length_kernel_in_one_call(monkeypatch, signature):
    """Where torch's variable-length attention runs (CUDA, 16-bit): one call for the whole
    packed row with its padded bounds, the longest slot, the scale and the grouped heads,
    through whichever causal switch the installed torch has (2.10's ``is_causal``, 2.13's
    ``window_size``); equal to the slot-by-slot path. A torch without a known switch keeps
    the slots."""
    import types
    calls = []
    kernel = _varlen_stand_in(signature)

    @functools.wraps(kernel)   # its signature is the one read
    def counted(*a, **k):
        calls.append(a[5])
        return kernel(*a, **k)
    monkeypatch.setitem(__import__("sys").modules, "torch.nn.attention.varlen",
                        types.SimpleNamespace(varlen_attn=counted))
    cfg = _config()
    args = (cfg, 1, AttnMaskType.causal, "self")
    fused = SDPAttention(*args)
    assert fused._varlen is not None
    monkeypatch.setattr(fused, "_varlen_fits", lambda q, v: True)
    cu = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=5, max_seqlen_kv=5)
    q, k, v = (t[:, 0] for t in _qkv(12, 1, 4, 2, 8, 8))
    (want, got), (want_g, got_g) = _both(PackedLocalAttention(*args), fused, (q, k, v),
                                         dict(attention_mask=None, packed_seq_params=params))
    assert calls == [5]
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, **TOL)
    monkeypatch.setitem(__import__("sys").modules, "torch.nn.attention.varlen",
                        types.SimpleNamespace(varlen_attn=lambda q, k, v, cu, max_len: q))
    assert varlen_kernel() is None


def test_the_variable_length_kernel_takes_only_what_flash_attention_runs():
    fused = SDPAttention(_config(), 1, AttnMaskType.causal, "self")
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert not fused._varlen_fits(q, q)   # on the CPU: slot by slot
    if torch.cuda.is_available():
        assert fused._varlen_fits(q.cuda(), q.cuda())
        assert not fused._varlen_fits(q.float().cuda(), q.float().cuda())
        assert not fused._varlen_fits(q.cuda(), q[..., :4].cuda())   # MLA's narrower values


def test_sdpa_false_keeps_the_local_kernel_for_comparisons(tmp_path):
    model, _ = build_model(write_family("qwen3_moe", tmp_path), sdpa=False)
    assert model.attention_path[0] == "local" and "sdpa=False" in model.attention_path[1]
    assert not any(isinstance(m, SDPAttention) for m in model.modules())
    assert any(isinstance(m, PackedLocalAttention) for m in model.modules())


def test_mlas_narrower_values_and_its_softmax_scale():
    """MLA: query/key heads of 24, values of 16, the scale MLA passes (YaRN's mscale)."""
    cfg = _config(heads=4, groups=4, dim=24)
    args = (cfg, 1, AttnMaskType.causal, "self")
    kw = dict(softmax_scale=0.3, k_channels=24, v_channels=16)
    local, fused = LocalMLACoreAttention(*args, **kw), SDPAttention(*args, **kw)
    (want, got), (want_g, got_g) = _both(local, fused, _qkv(6, 2, 4, 4, 24, 16),
                                         dict(attention_mask=None))
    assert got.shape == (6, 2, 64)
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, **TOL)


def test_sinks_and_sliding_windows_stay_local():
    assert attention_unsupported(_config()) is None
    assert "sliding-window" in attention_unsupported(_config(window_size=(8, 0)))


def test_bfloat16_the_gpu_configs_precision_agrees_within_its_rounding(tmp_path, monkeypatch):
    """The GPU configs train in bfloat16: the whole model on SDPA against the local kernel, both
    in bfloat16 (scores, softmax and sums rounded in other places: within bfloat16's rounding),
    and each against float32 as close as bfloat16 allows."""
    import moe_rl.trainer.sdpa_attention as sdpa
    path = write_family("qwen3_moe", tmp_path)
    built = {}
    for name, dtype, forced in (("sdpa", torch.bfloat16, False), ("local", torch.bfloat16, True),
                                ("fp32", torch.float32, False)):
        if forced:
            monkeypatch.setattr(sdpa, "attention_unsupported", lambda config: "forced")
        model, spec = build_model(path, dtype=dtype)
        load_hf_into_megatron(model, spec, path)
        monkeypatch.undo()
        built[name] = (model, spec)
    assert built["sdpa"][0].attention_path[0] == "sdpa"
    assert built["local"][0].attention_path[0] == "local"
    mb = three_samples(built["fp32"][1])
    lp = {name: logprobs_and_grads(m, s, mb)[0].float() for name, (m, s) in built.items()}
    # measured: 1.0e-3 between the kernels, 1.4e-3 from float32 (either kernel)
    assert (lp["sdpa"] - lp["local"]).abs().max() < 0.01
    assert (lp["sdpa"] - lp["fp32"]).abs().max() < 0.02
    assert (lp["local"] - lp["fp32"]).abs().max() < 0.02


@pytest.mark.parametrize("kind", FAMILIES)
def test_every_family_model_on_sdpa_equals_the_local_kernel(tmp_path, monkeypatch, kind):
    """The whole model's log-probs and every gradient, packed rows included: SDPA where it fits,
    the local kernel for gpt-oss."""
    import moe_rl.trainer.sdpa_attention as sdpa
    path = write_family(kind, tmp_path)
    model, spec = build_model(path)
    load_hf_into_megatron(model, spec, path)
    want_path = "local" if kind == "gpt_oss" else "sdpa"
    assert model.attention_path[0] == want_path, model.attention_path
    assert any(isinstance(m, SDPAttention) for m in model.modules()) == (want_path == "sdpa")
    monkeypatch.setattr(sdpa, "attention_unsupported", lambda config: "forced for the test")
    local, _ = build_model(path)
    load_hf_into_megatron(local, spec, path)
    assert local.attention_path[0] == "local"
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in local.named_parameters()]
    for packed in (False, True):
        mb = three_samples(spec, packed=packed)
        got_lp, got = logprobs_and_grads(model, spec, mb)
        want_lp, want = logprobs_and_grads(local, spec, mb)
        torch.testing.assert_close(got_lp, want_lp, **TOL)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_a_packed_rows_slots_are_read_on_the_host_once():
    """Every layer attends the same slots: the forwarder puts their bounds, read where the row
    was packed, on the row's parameters, and a row without them is read once (reading a GPU
    tensor per layer made every layer wait for the device)."""
    from moe_rl.rollout_record import Sample
    from moe_rl.trainer.forward import packed_seq_params
    from moe_rl.trainer.local_attention import slot_bounds
    from moe_rl.trainer.packing import pack_one
    samples = [Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], rollout_logprobs=-torch.ones(2)),
               Sample(prompt_ids=[6, 7], response_ids=[8, 9, 10], rollout_logprobs=-torch.ones(3))]
    mb = pack_one(samples, [0, 1], pad_token_id=0, packed=True)
    params = packed_seq_params(mb, "cpu")
    cu = mb.cu_seqlens().tolist()
    assert params.moe_rl_slot_bounds == list(zip(cu[:-1], cu[1:]))
    assert slot_bounds(params) is params.moe_rl_slot_bounds
    bare = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens(),
                           cu_seqlens_kv=mb.cu_seqlens())
    first = slot_bounds(bare)
    assert first == params.moe_rl_slot_bounds and slot_bounds(bare) is first
