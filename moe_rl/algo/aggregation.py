"""Loss aggregation with global normalisers, so the loss does not depend on how the batch is split
into micro-batches or data-parallel ranks: each part returns its share, and the shares add up to
the full-batch loss."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algo.common import zero_masked

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Normalisers:
    """Global counts over the whole batch (all micro-batches, all data-parallel ranks)."""
    num_tokens: float
    num_seqs: float
    max_len: float | None = None


def count_normalisers(mask: torch.Tensor, max_len: int | None = None) -> Normalisers:
    """Counts of one batch part: masked tokens and sequences with at least one masked token.

    Sum the parts' counts (e.g. all_reduce) before building the :class:`Normalisers` to use.
    """
    m = mask.to(torch.bool)
    return Normalisers(float(m.sum()), float(m.any(-1).sum()),
                       None if max_len is None else float(max_len))


def aggregate(loss_tok: torch.Tensor, mask: torch.Tensor, mode: str, norm: Normalisers,
              count_mask: torch.Tensor | None = None) -> torch.Tensor:
    """This part's share of the batch loss, summing ``loss_tok`` over ``mask`` (by selection: a
    NaN at a masked position never reaches the sum). ``count_mask`` (default ``mask``) gives
    each sequence's token count n_i: pass the response mask to keep tokens that a correction
    removed in the denominator (``algorithm.loss_denominator: original``).

    token-mean:              sum_(i,t) l / N_tokens
    seq-mean-token-mean:     sum_i (sum_t l / n_i) / N_seqs
    seq-mean-token-sum:      sum_i (sum_t l) / N_seqs
    seq-mean-token-sum-norm: sum_i (sum_t l / L) / N_seqs, L a constant (Dr.GRPO)
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {mode!r}")
    if loss_tok.shape != mask.shape:
        raise ValueError(f"mask: expected shape {list(loss_tok.shape)}, got {list(mask.shape)}")
    m = (mask if count_mask is None else count_mask).to(loss_tok.dtype)
    tok_sum = zero_masked(loss_tok, mask).sum(-1)
    if mode == "token-mean":
        return tok_sum.sum() / max(norm.num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = tok_sum / m.sum(-1).clamp_min(1)
    elif mode == "seq-mean-token-sum":
        per_seq = tok_sum
    else:
        if not norm.max_len:
            raise ValueError("max_len: seq-mean-token-sum-norm needs a constant max length")
        per_seq = tok_sum / norm.max_len
    return per_seq.sum() / max(norm.num_seqs, 1.0)
