"""Keep-sampling-mask: log-prob and entropy on the engine's kept set, from logits and ragged ids.

Row t is restricted to ``ids[offsets[t]:offsets[t+1]]``; an empty row means the full vocabulary.
No dense [T, V] mask is built: the kept logits are gathered and reduced per segment.
"""
from __future__ import annotations

import torch

from moe_rl_kernels import check_kept_ids


def check_ragged(offsets: torch.Tensor, ids: torch.Tensor, rows: int, vocab: int) -> None:
    """Validate a ragged kept-id table of ``rows`` rows over a vocabulary of ``vocab``."""
    if offsets.dim() != 1 or offsets.numel() != rows + 1:
        raise ValueError(f"kept_offsets: expected {rows + 1} entries, got {offsets.numel()}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
        raise ValueError(f"kept_offsets: expected to start at 0 and end at len(kept_ids) = "
                         f"{ids.numel()}, got {int(offsets[0])} .. {int(offsets[-1])}")
    if (offsets[1:] < offsets[:-1]).any():
        raise ValueError("kept_offsets: expected non-decreasing offsets")
    row = torch.repeat_interleave(torch.arange(rows), (offsets[1:] - offsets[:-1]).long())
    check_kept_ids(row, ids, vocab)


def masked_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, kept_offsets: torch.Tensor,
                           kept_ids: torch.Tensor, temperature: float = 1.0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``lp[t] = z[y_t]/T - logsumexp_{v in K_t} z[v]/T`` and the entropy over ``K_t``.

    logits [N, V] (any float dtype, computed in float32 or float64), targets [N] long.
    Returns (logprobs [N], entropy [N]); differentiable w.r.t. logits.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [N, V], got {list(logits.shape)}")
    n, vocab = logits.shape
    if targets.shape != (n,):
        raise ValueError(f"targets: expected [{n}], got {list(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    check_ragged(kept_offsets, kept_ids, n, vocab)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(dtype) / temperature
    targets = targets.long()
    lengths = (kept_offsets[1:] - kept_offsets[:-1]).long()
    restricted = lengths > 0
    # full-vocabulary rows
    full_lse = torch.logsumexp(z, dim=-1)
    full_p = torch.softmax(z, dim=-1)
    full_ent = full_lse - torch.where(full_p > 0, full_p * z, torch.zeros_like(z)).sum(-1)
    # kept-set rows: gather the kept logits and reduce per segment
    row = torch.repeat_interleave(torch.arange(n), lengths)
    zk = z[row, kept_ids.long()]
    seg_max = torch.full((n,), -torch.inf, dtype=dtype).scatter_reduce(
        0, row, zk.detach(), reduce="amax", include_self=True)
    seg_max = torch.where(restricted, seg_max, torch.zeros_like(seg_max))
    ek = torch.exp(zk - seg_max[row])
    sum_e = torch.zeros(n, dtype=dtype).index_add(0, row, ek)
    sum_ez = torch.zeros(n, dtype=dtype).index_add(
        0, row, torch.where(ek > 0, ek * zk, torch.zeros_like(zk)))   # -inf logits add nothing
    safe_sum = torch.where(restricted, sum_e, torch.ones_like(sum_e))
    kept_lse = seg_max + torch.log(safe_sum)
    kept_ent = kept_lse - sum_ez / safe_sum
    has_target = torch.zeros(n, dtype=torch.long).index_add(
        0, row, (kept_ids.long() == targets[row]).long())
    missing = restricted & (has_target == 0)
    if missing.any():
        bad = int(missing.nonzero()[0, 0])
        raise ValueError(f"kept_ids: row {bad}: target token {int(targets[bad])} is not in its "
                         f"kept set")
    lse = torch.where(restricted, kept_lse, full_lse)
    ent = torch.where(restricted, kept_ent, full_ent)
    lp = z.gather(1, targets[:, None]).squeeze(1) - lse
    return lp, ent


def kept_set_sizes(kept_offsets: torch.Tensor) -> torch.Tensor:
    """Size of each row's kept set (0 = unrestricted)."""
    return kept_offsets[1:] - kept_offsets[:-1]
