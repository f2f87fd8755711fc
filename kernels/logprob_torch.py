"""Memory-bounded log-prob + entropy of target tokens from hidden states and the output weight.

The [T, V] logits are never held at once: rows are processed in chunks, per-row statistics
(max, sum of exponentials, sum of p*z, target logit) are kept, and the backward pass recomputes
each chunk's logits. Rows may be restricted to a kept-id set (keep sampling mask). The
vocabulary may be split across tensor-parallel ranks: the statistics are combined with
all_reduce, and the hidden-state gradient is summed across ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_CHUNK = 1024


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs (gradient checks), float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@dataclass
class KeptSets:
    """Ragged kept-id sets: row t keeps ids[offsets[t]:offsets[t+1]]; an empty row = all."""
    offsets: torch.Tensor   # [T+1] long
    ids: torch.Tensor       # [N] long (global vocabulary ids)

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index relative to ``start``, global id) of every kept entry of rows [start, stop)."""
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        lengths = self.offsets[start + 1:stop + 1] - self.offsets[start:stop]
        row = torch.repeat_interleave(torch.arange(stop - start, device=self.ids.device),
                                      lengths.to(self.ids.device))
        return row, self.ids[lo:hi]

    def subset(self, rows: torch.Tensor) -> "KeptSets":
        """The sets of ``rows`` (LongTensor of row indices), in that order."""
        lengths = (self.offsets[1:] - self.offsets[:-1])[rows]
        offsets = torch.zeros(rows.numel() + 1, dtype=self.offsets.dtype,
                              device=self.offsets.device)
        offsets[1:] = lengths.cumsum(0)
        starts = self.offsets[:-1][rows]
        within = torch.arange(int(offsets[-1]), device=self.ids.device) - \
            torch.repeat_interleave(offsets[:-1], lengths)
        return KeptSets(offsets, self.ids[torch.repeat_interleave(starts, lengths) + within])

    def restricted(self) -> torch.Tensor:
        """[T] bool: rows that have a kept set."""
        return (self.offsets[1:] - self.offsets[:-1]) > 0


def _local_entries(row: torch.Tensor, ids: torch.Tensor, vocab_start: int, v_local: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept entries that fall in this rank's vocabulary slice, as (row, local column)."""
    local = ids - vocab_start
    keep = (local >= 0) & (local < v_local)
    return row[keep], local[keep]


def chunk_statistics(logits: torch.Tensor, temperature: float, targets_local: torch.Tensor,
                     kept_row: torch.Tensor | None, kept_col: torch.Tensor | None,
                     restricted: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (max, sum exp(z - max), sum exp(z - max) * z, target logit) of this rank's slice,
    with z = logits / temperature in float32.

    logits: [C, V_local]. targets_local: [C] local column or -1 when the target is owned by
    another rank. Restricted rows reduce over their kept columns only.
    """
    z = logits.to(acc_dtype(logits))   # the caller's fresh chunk: scaled in place
    if temperature != 1.0:
        z = z.div_(temperature)
    C = z.shape[0]
    m = z.max(dim=-1).values
    e = torch.exp(z - m[:, None])
    s = e.sum(-1)
    # a -inf logit adds nothing (its probability is 0), but 0 * -inf is NaN: counted as 0
    sz = e.mul_(z).nan_to_num_(nan=0.0, posinf=torch.inf, neginf=-torch.inf).sum(-1)
    del e
    if kept_row is not None and restricted.any():
        zk = z[kept_row, kept_col]
        mk = torch.full((C,), -torch.inf, dtype=z.dtype, device=z.device).scatter_reduce(
            0, kept_row, zk, reduce="amax", include_self=True)
        mk_safe = torch.where(torch.isfinite(mk), mk, torch.zeros_like(mk))
        ek = torch.exp(zk - mk_safe[kept_row])
        sk = torch.zeros(C, dtype=z.dtype, device=z.device).index_add(0, kept_row, ek)
        szk = torch.zeros(C, dtype=z.dtype, device=z.device).index_add(
            0, kept_row, (ek * zk).nan_to_num_(nan=0.0, posinf=torch.inf, neginf=-torch.inf))
        m = torch.where(restricted, mk, m)
        s = torch.where(restricted, sk, s)
        sz = torch.where(restricted, szk, sz)
    has_t = targets_local >= 0
    tz = z.gather(1, targets_local.clamp_min(0)[:, None]).squeeze(1)
    tz = torch.where(has_t, tz, torch.zeros_like(tz))
    return m, s, sz, tz


def combine_statistics(m: torch.Tensor, s: torch.Tensor, sz: torch.Tensor, tz: torch.Tensor,
                       group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logsumexp, entropy, target logit) per row from the per-rank statistics (all_reduce over ``group``)."""
    if group is not None:
        m_glob = m.clone()
        dist.all_reduce(m_glob, op=dist.ReduceOp.MAX, group=group)
    else:
        m_glob = m
    m_safe = torch.where(torch.isfinite(m_glob), m_glob, torch.zeros_like(m_glob))
    scale = torch.where(torch.isfinite(m), torch.exp(m - m_safe), torch.zeros_like(m))
    s_g, sz_g = s * scale, sz * scale
    if group is not None:
        packed = torch.stack([s_g, sz_g, tz])
        dist.all_reduce(packed, group=group)
        s_g, sz_g, tz = packed[0], packed[1], packed[2]
    lse = m_safe + torch.log(s_g)
    entropy = lse - sz_g / s_g
    return lse, entropy, tz


def _targets_local(targets: torch.Tensor, vocab_start: int, v_local: int) -> torch.Tensor:
    local = targets - vocab_start
    return torch.where((local >= 0) & (local < v_local), local, torch.full_like(local, -1))


class ChunkedLogprobEntropy(torch.autograd.Function):
    """Autograd function; use :func:`moe_rl_kernels.logprob_entropy`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, kept, chunk, group, vocab_start,
                backend):
        T = hidden.shape[0]
        v_local = weight.shape[0]
        restricted_all = kept.restricted() if kept is not None else None
        t_local = _targets_local(targets, vocab_start, v_local)
        stats = [torch.empty(T, dtype=acc_dtype(hidden), device=hidden.device) for _ in range(4)]
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            logits = hidden[a:b] @ weight.t()
            kr = kc = None
            restricted = torch.zeros(b - a, dtype=torch.bool, device=hidden.device)
            if kept is not None:
                row, ids = kept.rows(a, b)
                kr, kc = _local_entries(row, ids, vocab_start, v_local)
                restricted = restricted_all[a:b]
            for out, val in zip(stats, backend.statistics(logits, temperature, t_local[a:b], kr, kc,
                                                          restricted)):
                out[a:b] = val
            del logits
        lse, entropy, tz = combine_statistics(*stats, group)
        logprob = tz - lse
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.extra = (temperature, kept, chunk, group, vocab_start, backend)
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, kept, chunk, group, vocab_start, backend = ctx.extra
        T, v_local = hidden.shape[0], weight.shape[0]
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.to(lse.dtype)
        t_local = _targets_local(targets, vocab_start, v_local)
        restricted_all = kept.restricted() if kept is not None else None
        acc = acc_dtype(hidden)
        grad_h = torch.zeros_like(hidden, dtype=acc) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            logits = hidden[a:b] @ weight.t()
            gz = backend.logit_grad(logits, temperature, lse[a:b], entropy[a:b], g_lp[a:b],
                                    g_ent[a:b], t_local[a:b], kept, restricted_all, a, b,
                                    vocab_start).to(hidden.dtype)
            if grad_h is not None:
                grad_h[a:b] = (gz @ weight).to(acc)
            if grad_w is not None:
                if gz.dtype == acc:
                    grad_w.addmm_(gz.t(), hidden[a:b])
                else:
                    grad_w += (gz.t() @ hidden[a:b]).to(acc)
            del logits, gz
        if grad_h is not None and group is not None:
            dist.all_reduce(grad_h, group=group)
        return (None if grad_h is None else grad_h.to(hidden.dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None, None, None, None, None, None, None)


def chunk_logit_grad(logits, temperature, lse, entropy, g_lp, g_ent, t_local, kept,
                     restricted_all, a, b, vocab_start):
    """d(loss)/d(logits) for one chunk: [g_lp (onehot - p) - g_ent p (log p + H)] / temperature,
    p over the row's support (full vocabulary or its kept set)."""
    # in place on the freshly recomputed chunk: two [C, V] buffers (log p -> gradient, and p)
    logp = logits.to(lse.dtype)
    if temperature != 1.0:
        logp = logp.div_(temperature)
    logp = logp.sub_(lse[:, None])
    p = torch.exp(logp)
    gz = logp.add_(entropy[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
    gz.nan_to_num_(nan=0.0, posinf=torch.inf, neginf=-torch.inf)   # p = 0 at a -inf logit
    del p
    if kept is not None:
        restricted = restricted_all[a:b]
        if restricted.any():
            row, ids = kept.rows(a, b)
            kr, kc = _local_entries(row, ids, vocab_start, gz.shape[1])
            kept_vals = gz[kr, kc]
            gz[restricted] = 0.0
            gz[kr, kc] = kept_vals
    has_t = t_local >= 0
    rows = torch.nonzero(has_t).squeeze(1)
    gz[rows, t_local[rows]] += g_lp[rows]
    return gz.div_(temperature) if temperature != 1.0 else gz


class TorchBackend:
    """Chunk statistics and logit gradients in plain torch (CPU and GPU)."""
    statistics = staticmethod(chunk_statistics)
    logit_grad = staticmethod(chunk_logit_grad)
