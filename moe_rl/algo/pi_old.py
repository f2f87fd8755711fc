"""pi_old as the mean of n inference-engine scoring passes, averaged in probability space."""
from __future__ import annotations

import math

import torch

from moe_rl.algo.common import masked_mean


def average_pass_logprobs(pass_lp: torch.Tensor, mask: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``lp_old = logsumexp_j(lp_j) - log n`` from per-pass log-probs [n, B, T].

    Returns lp_old [B, T], the per-token standard deviation of the log-prob across passes
    (population std, in nats; 0 when n = 1) and the metric ``pi_old/pass_std`` (its mean over
    masked tokens). A pass std of exactly 0 means the passes were bit-identical and averaging
    gained nothing.
    """
    if pass_lp.dim() != 3:
        raise ValueError(f"pass_lp: expected [n_passes, B, T], got {list(pass_lp.shape)}")
    if pass_lp.shape[1:] != mask.shape:
        raise ValueError(f"mask: expected shape {list(pass_lp.shape[1:])}, got "
                         f"{list(mask.shape)}")
    n = pass_lp.shape[0]
    if n < 1:
        raise ValueError("pass_lp: needs at least one pass")
    valid = mask.to(torch.bool)
    if not torch.isfinite(pass_lp[:, valid]).all():
        raise ValueError("pass_lp: non-finite log-prob on a response token")
    lp_old = torch.logsumexp(pass_lp, dim=0) - math.log(n)
    std = pass_lp.std(dim=0, unbiased=False) if n > 1 else torch.zeros_like(lp_old)
    return lp_old, std, {"pi_old/pass_std": float(masked_mean(std, mask))}
