"""Policy losses (per token, minimised): PPO-clip / GRPO and GSPO, plus Clip-Cov and KL-Cov."""
from __future__ import annotations

import torch

from moe_rl.algo.common import broadcast_to_tokens, check_same_shape, masked_mean, masked_seq_mean


def ppo_clip_loss(lp: torch.Tensor, lp_old: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_low: float, clip_high: float,
                  dual_clip_c: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip: ``-min(r A, clip(r, 1-clip_low, 1+clip_high) A)``.

    clip-higher is ``clip_high > clip_low``; dual-clip caps the loss of negative-advantage
    tokens at ``c |A|``. Returns the per-token loss [B, T] and metrics (clip_frac,
    dual_clip_frac) over the masked tokens.
    """
    check_same_shape(lp=lp, lp_old=lp_old, mask=mask)
    adv = broadcast_to_tokens(advantages.to(lp.dtype), lp)
    ratio = torch.exp(lp - lp_old)
    loss_unclipped = -ratio * adv
    loss_clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).to(lp.dtype)
    dual = torch.zeros_like(loss)
    if dual_clip_c is not None:
        if dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c: expected > 1, got {dual_clip_c}")
        cap = -dual_clip_c * adv  # = c|A| where A < 0
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        dual = capped.to(lp.dtype)
    with torch.no_grad():
        metrics = {"clip_frac": float(masked_mean(clipped, mask)),
                   "dual_clip_frac": float(masked_mean(dual, mask))}
    return loss, metrics


def gspo_loss(lp: torch.Tensor, lp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO in token form: ``s_it = sg[s_i] * exp(lp - sg[lp])`` with ``s_i`` the length-normalised
    sequence ratio ``exp(mean_t (lp - lp_old))``; loss ``-min(s_it A_i, clip(s_it) A_i)``.

    Aggregated seq-mean-token-mean its gradient equals that of the sequence-level objective.
    Returns the per-token loss [B, T] and metrics (clip_frac = fraction of sequences clipped,
    gspo/seq_ratio_mean).
    """
    check_same_shape(lp=lp, lp_old=lp_old, mask=mask)
    if advantages.dim() != 1:
        raise ValueError(f"advantages: GSPO needs one advantage per sequence [B], got "
                         f"{list(advantages.shape)}")
    log_s = masked_seq_mean(lp - lp_old, mask).clamp(-20.0, 20.0)
    s_tok = torch.exp(log_s.detach()[:, None] + lp - lp.detach())
    adv = broadcast_to_tokens(advantages.to(lp.dtype), lp)
    loss_unclipped = -s_tok * adv
    loss_clipped = -s_tok.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = torch.maximum(loss_unclipped, loss_clipped)
    with torch.no_grad():
        has_tok = mask.to(torch.bool).any(-1)
        clipped_seq = (loss_clipped > loss_unclipped).any(-1) & has_tok
        n = has_tok.sum().clamp_min(1)
        metrics = {"clip_frac": float(clipped_seq.sum() / n),
                   "gspo/seq_ratio_mean": float(torch.exp(log_s)[has_tok].mean())
                   if has_tok.any() else 1.0}
    return loss, metrics


def _token_covariance(lp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
                      ) -> torch.Tensor:
    """``c_t = (lp - mean lp)(A - mean A)`` over the masked tokens of the batch (detached)."""
    with torch.no_grad():
        adv = broadcast_to_tokens(advantages.to(lp.dtype), lp)
        lp_c = lp - masked_mean(lp, mask)
        adv_c = adv - masked_mean(adv, mask)
        return lp_c * adv_c


def clip_cov(lp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, ratio: float,
             cov_low: float, cov_high: float, generator: torch.Generator | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov: detach ``lp`` on ``round(ratio * N)`` tokens drawn uniformly (seeded) among the
    masked tokens whose covariance ``c_t`` lies in ``[cov_low, cov_high]``.

    Returns ``lp`` with those tokens detached (no gradient through them) and the metric
    ``clip_cov/frac`` (fraction of masked tokens detached).
    """
    cov = _token_covariance(lp, advantages, mask)
    valid = mask.to(torch.bool)
    band = valid & (cov >= cov_low) & (cov <= cov_high)
    n_pick = min(int(round(ratio * int(valid.sum()))), int(band.sum()))
    chosen = torch.zeros_like(valid)
    if n_pick > 0:
        idx = band.flatten().nonzero().squeeze(1)
        perm = torch.randperm(idx.numel(), generator=generator)[:n_pick]
        chosen.view(-1)[idx[perm]] = True
    out = torch.where(chosen, lp.detach(), lp)
    return out, {"clip_cov/frac": float(chosen.sum()) / max(int(valid.sum()), 1)}


def kl_cov_penalty(lp: torch.Tensor, lp_old: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, *, ratio: float, coef: float
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov: per-token penalty ``coef * |lp - lp_old|`` on the top ``ratio`` fraction of masked
    tokens by covariance ``c_t``; zero elsewhere. Add it to the per-token policy loss."""
    cov = _token_covariance(lp, advantages, mask)
    valid = mask.to(torch.bool)
    n_valid = int(valid.sum())
    k = min(int(round(ratio * n_valid)), n_valid)
    chosen = torch.zeros_like(valid)
    if k > 0:
        scores = torch.where(valid, cov, torch.full_like(cov, -torch.inf)).flatten()
        chosen.view(-1)[torch.topk(scores, k).indices] = True
    penalty = coef * (lp - lp_old).abs() * chosen.to(lp.dtype)
    return penalty, {"kl_cov/frac": k / max(n_valid, 1)}
