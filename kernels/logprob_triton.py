"""Triton kernels for the per-row softmax statistics and the logit gradient of one chunk.

The GEMMs stay in torch (cuBLAS); Triton fuses the passes over the vocabulary: one online pass
for (max, sum exp, sum p*z, target logit) and one pass writing the logit gradient. Rows with a
kept-id set are handled by the torch backend (the dispatcher routes such calls there).
On CPU the kernels run under ``TRITON_INTERPRET=1`` for tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024


@triton.jit
def _row_stats_kernel(logits_ptr, targets_ptr, m_ptr, s_ptr, sz_ptr, tz_ptr, n_cols, stride,
                      inv_temp, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row * stride
    target = tl.load(targets_ptr + row)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    sz = tl.zeros([], dtype=tl.float32)
    tz = tl.zeros([], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < n_cols
        z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        new_m = tl.maximum(m, tl.max(z, 0))
        scale = tl.exp(m - new_m)
        e = tl.where(valid, tl.exp(z - new_m), 0.0)
        s = s * scale + tl.sum(e, 0)
        sz = sz * scale + tl.sum(tl.where(valid & (e > 0.0), e * z, 0.0), 0)   # -inf: 0
        tz += tl.sum(tl.where(cols == target, z, 0.0), 0)
        m = new_m
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(sz_ptr + row, sz)
    tl.store(tz_ptr + row, tz)


@triton.jit
def _logit_grad_kernel(logits_ptr, out_ptr, targets_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr,
                       n_cols, stride, inv_temp, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row * stride
    out = out_ptr + row * stride
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    ent = tl.load(ent_ptr + row)
    g_lp = tl.load(glp_ptr + row)
    g_ent = tl.load(gent_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < n_cols
        z = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
        logp = z - lse
        p = tl.exp(logp)
        g = tl.where(p > 0.0, -p * (g_lp + g_ent * (logp + ent)), 0.0)   # -inf logit: 0
        g = tl.where(cols == target, g + g_lp, g) * inv_temp
        tl.store(out + cols, g.to(out_ptr.dtype.element_ty), mask=valid)


def triton_statistics(logits, temperature, targets_local, kept_row, kept_col, restricted):
    """Per-row statistics of a [C, V_local] logits chunk (no kept sets)."""
    if kept_row is not None and bool(restricted.any()):
        raise ValueError("kept_ids: the Triton backend handles unrestricted rows only")
    logits = logits.contiguous()
    C, V = logits.shape
    outs = [torch.empty(C, dtype=torch.float32, device=logits.device) for _ in range(4)]
    _row_stats_kernel[(C,)](logits, targets_local.contiguous(), *outs, V, logits.stride(0),
                            1.0 / temperature, BLOCK=min(BLOCK_V, triton.next_power_of_2(V)))
    return tuple(outs)


def triton_logit_grad(logits, temperature, lse, entropy, g_lp, g_ent, t_local, kept,
                      restricted_all, a, b, vocab_start):
    """Logit gradient of one chunk, written over the recomputed logits buffer."""
    if kept is not None and bool(restricted_all[a:b].any()):
        raise ValueError("kept_ids: the Triton backend handles unrestricted rows only")
    logits = logits.contiguous()
    C, V = logits.shape
    _logit_grad_kernel[(C,)](logits, logits, t_local.contiguous(), lse.contiguous(),
                             entropy.contiguous(), g_lp.contiguous(), g_ent.contiguous(), V,
                             logits.stride(0), 1.0 / temperature,
                             BLOCK=min(BLOCK_V, triton.next_power_of_2(V)))
    return logits


class TritonBackend:
    """Chunk statistics and logit gradients in Triton (GPU, or CPU under TRITON_INTERPRET=1)."""
    statistics = staticmethod(triton_statistics)
    logit_grad = staticmethod(triton_logit_grad)
