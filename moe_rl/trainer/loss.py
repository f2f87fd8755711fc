"""The policy loss of one micro-step, built once from ``cfg.algorithm``: live corrections on the
current pi_theta, Clip-Cov / KL-Cov, the PPO-clip, GSPO, GMPO or DPPO surrogate (the ratio ones
scaled by RSPO's router-shift weight when it is on), per-token weights, the KL
penalty, the entropy bonus and the aggregation. Pure torch (no megatron): the trainer's micro-step
is forward -> :meth:`PolicyLoss.__call__` -> backward."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_rl.algo import (POLICY_LOSSES, CorrectionInputs, Normalisers, aggregate,
                         apply_corrections, clip_cov, clip_cov_select, kl_cov_loss, kl_cov_select,
                         kl_estimate, rollout_penalty, router_shift_metrics)
from moe_rl.config import AlgorithmConfig

GROUP_CORRECTIONS = ("metropolis", "snis")


def live_corrections(a: AlgorithmConfig) -> list[str]:
    """Corrections evaluated in each micro-step on the current pi_theta (detached): the
    DeepSeek-V3.2 off-policy mask always (its statistic is pi_behaviour vs pi_theta); in bypass
    mode (pi_old = rollout, where pi_old/pi_roll = 1) every per-token and per-sequence
    correction, on pi_theta/pi_roll as verl and slime do."""
    if a.pi_old == "rollout":
        return [c for c in a.corrections if c not in GROUP_CORRECTIONS]
    return [c for c in a.corrections if c == "opsm"]


@dataclass
class LossInputs:
    """Response-aligned [B, R] tensors of the micro-batch's samples (B = its samples)."""
    lp_old: torch.Tensor
    lp_roll: torch.Tensor
    lp_ref: torch.Tensor | None
    advantages: torch.Tensor         # [B]
    mask: torch.Tensor               # response tokens
    keep: torch.Tensor               # ... that no correction removed (subset of mask)
    weights: torch.Tensor            # per-token correction weights
    chosen: torch.Tensor | None      # Clip-Cov / KL-Cov tokens chosen over the mini-batch
    log_ratio_scale: torch.Tensor | None = None   # log of RSPO's router-shift weight (detached)


class PolicyLoss:
    """The configured policy loss. ``__call__`` returns the micro-batch's loss (normalised by
    the step's global counts) and its metric sums (token-weighted; keys starting with ``_`` are
    the normalisers and live-correction bookkeeping the trainer reduces)."""

    def __init__(self, a: AlgorithmConfig, generator: torch.Generator | None = None):
        self.a = a
        self.live = live_corrections(a)
        self.generator = generator

    def select(self, lp_now: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor
               ) -> torch.Tensor | None:
        """Clip-Cov / KL-Cov token choice over a whole mini-batch (None for the others)."""
        e = self.a.entropy_control
        if e.method == "clip_cov":
            return clip_cov_select(lp_now, advantages, keep, ratio=e.clip_cov_ratio,
                                   cov_low=e.clip_cov_low, cov_high=e.clip_cov_high,
                                   generator=self.generator)
        if e.method == "kl_cov":
            return kl_cov_select(lp_now, advantages, keep, ratio=e.kl_cov_ratio)
        return None

    def __call__(self, lp: torch.Tensor, entropy: torch.Tensor, x: LossInputs,
                 norm: Normalisers, first: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
        a, e = self.a, self.a.entropy_control
        sums: dict[str, float] = {}
        keep, weights = x.keep, x.weights
        lp_old = x.lp_old.float()   # the losses compute in float32 or better
        adv = x.advantages.float()
        if self.live:
            live = apply_corrections(self.live, a.correction, CorrectionInputs(
                lp_old=(lp.detach() if a.pi_old == "rollout" else lp_old).double(),
                lp_roll=x.lp_roll.double(), mask=keep, advantages=adv.double(),
                lp=lp.detach().double()))
            n_live = float(keep.sum())
            sums["_live_tokens"] = n_live
            for k, v in live.metrics.items():
                if k.startswith("correction/"):
                    sums["_live/" + k] = v * n_live
            keep = keep & live.keep
            weights = weights * live.weights.to(weights.dtype)
        if first and bool(keep.any()):   # before any update pi_theta must equal pi_old
            sums["_first_dev"] = float(
                ((lp.detach().double() - lp_old.double()).exp() - 1).abs()[keep].max())
        extra: dict[str, float] = {}
        if e.method == "clip_cov":
            lp, extra = clip_cov(lp, adv, keep, ratio=e.clip_cov_ratio, cov_low=e.clip_cov_low,
                                 cov_high=e.clip_cov_high, chosen=x.chosen)
        if e.method == "kl_cov":   # replaces the clipped surrogate
            loss_tok, lm = kl_cov_loss(lp, lp_old, adv, keep, ratio=e.kl_cov_ratio,
                                       coef=e.kl_cov_coef, chosen=x.chosen)
        else:
            loss_tok, lm = POLICY_LOSSES[a.loss](lp, lp_old, adv, keep, a, x.log_ratio_scale)
        if x.log_ratio_scale is not None:
            lm.update(router_shift_metrics(x.log_ratio_scale.exp(), keep, a.router_shift.floor))
        loss_tok = loss_tok * weights.to(loss_tok.dtype)
        kl_tok = None
        if x.lp_ref is not None and not a.kl.in_reward:
            kl_tok = kl_estimate(lp, x.lp_ref, a.kl.estimator, lp_old=lp_old,
                                 off_policy_corrected=a.kl.off_policy_corrected)
            loss_tok = loss_tok + a.kl.coef * kl_tok
        if a.rollout_penalty.coef:   # unweighted, as the KL term: a pull toward the sampler
            loss_tok = loss_tok + rollout_penalty(lp, x.lp_roll, a.rollout_penalty.coef)
            gap = (lp.detach().double() - x.lp_roll.double()).square()
            sums["rollout_penalty/sq_gap_mean"] = float(gap[keep].sum())
        if a.entropy_coef:
            loss_tok = loss_tok - a.entropy_coef * entropy
        loss = aggregate(loss_tok, keep, a.aggregation, norm,
                         count_mask=x.mask if a.loss_denominator == "original" else None)
        n_tok = float(keep.sum())
        sums["_tokens"] = n_tok
        sums["loss"] = float(loss.detach())
        for k, v in {**lm, **extra}.items():
            sums[k] = v * n_tok
        if kl_tok is not None:
            sums["kl/ref"] = float((kl_tok.detach() * keep).sum())
        return loss, sums
