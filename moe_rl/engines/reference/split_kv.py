"""Split-KV (flash-decoding) attention for the reference engine: how a GPU serving engine's
attention makes a sequence's numbers depend on the batch it runs in.

The keys of the (left-padded) batch are cut into ``n`` contiguous chunks; each chunk's scores
``q k^T * scale`` and its partial output are accumulated in float32 from inputs in the engine's
dtype (the probabilities are rounded to that dtype before the product with the values, as
flash-attention kernels do); the partials are merged with their running maxima in float32 and
the output is rounded to the engine's dtype. Like a real kernel filling the GPU, the number of
splits is chosen from the batch: ``n = clamp(SPLIT_SLOTS // (rows x kv_heads), 1,
ceil(kv_len / MIN_CHUNK))``, and
the chunk boundaries lie on the padded batch's positions, so the same sequence scored in two
batches of other sizes or lengths is summed in other pieces and can differ in the last bits.

Deterministic inference (SGLang's ``--enable-deterministic-inference``): fixed chunks of
``DETERMINISTIC_CHUNK`` positions from the first position, whatever the batch (and the engine
runs every request alone), so repeated passes are bit-identical.
"""
from __future__ import annotations

import contextlib
import threading

import torch

NAME = "moe_rl_split_kv"
SPLIT_SLOTS = 64            # parallel work slots the emulated kernel fills (SMs, scaled down)
MIN_CHUNK = 1               # fewest key positions per split
DETERMINISTIC_CHUNK = 16    # positions per chunk with deterministic inference

_policy = threading.local()


@contextlib.contextmanager
def split_policy(deterministic: bool):
    """Forwards inside this block split their keys by the batch (or fixed, ``deterministic``)."""
    previous = getattr(_policy, "deterministic", False)
    _policy.deterministic = deterministic
    try:
        yield
    finally:
        _policy.deterministic = previous


def chunk_bounds(rows: int, kv_heads: int, kv_len: int, deterministic: bool) -> list[int]:
    """Chunk boundaries over the key positions ``0 .. kv_len``."""
    if deterministic:
        return list(range(0, kv_len, DETERMINISTIC_CHUNK)) + [kv_len]
    n = max(1, min(SPLIT_SLOTS // max(rows * kv_heads, 1), -(-kv_len // MIN_CHUNK)))
    return [round(i * kv_len / n) for i in range(n + 1)]


def split_kv_attention(module, query, key, value, attention_mask, scaling, dropout=0.0,
                       sliding_window=None, s_aux=None, **kwargs):
    """transformers attention interface: query [B, H, S, D], key/value [B, Hkv, T, D(v)],
    attention_mask additive [B, 1, S, T] (or None: causal, within ``sliding_window`` keys when
    given). ``s_aux`` [H]: gpt-oss's learned sink logits, one more term of each row's softmax
    denominator (no value). Returns ([B, S, H, Dv], None)."""
    B, H, S, _ = query.shape
    Hkv, T = key.shape[1], key.shape[2]
    dtype = query.dtype
    k = key.repeat_interleave(H // Hkv, dim=1).float()
    v = value.repeat_interleave(H // Hkv, dim=1).float()
    q = query.float()
    if attention_mask is None:
        allowed = torch.ones(S, T, dtype=torch.bool).tril(T - S)
        if sliding_window is not None:   # key j seen from query i when i - j < window
            allowed = allowed.triu(T - S - sliding_window + 1)
        allowed = allowed[None, None]
    else:
        allowed = attention_mask[:, :, :, :T] > torch.finfo(attention_mask.dtype).min / 2
    bounds = chunk_bounds(B, Hkv, T, getattr(_policy, "deterministic", False))
    maxima, sums, outs = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        s = torch.matmul(q, k[:, :, a:b].transpose(2, 3)) * scaling
        s = s.masked_fill(~allowed[..., a:b], -torch.inf)
        m = s.amax(-1, keepdim=True)                  # -inf where a row sees no key here
        p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
        maxima.append(m)
        sums.append(p.sum(-1, keepdim=True))
        outs.append(torch.matmul(p.to(dtype).float(), v[:, :, a:b]))
    top = torch.stack(maxima).amax(0)
    sink = None if s_aux is None else s_aux.float().reshape(1, H, 1, 1)
    if sink is not None:
        top = torch.maximum(top, sink)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = [torch.exp(m - top) for m in maxima]   # 0 for chunks a row does not see
    num = sum(w * o for w, o in zip(weights, outs))
    den = sum(w * l for w, l in zip(weights, sums))
    if sink is not None:
        den = den + torch.exp(sink - top)
    out = torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return out.to(dtype).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention (and its additive mask) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(NAME, split_kv_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    return NAME
