"""KL to the reference policy: k1, k2, k3 and the off-policy-corrected k3, as loss or reward."""
from __future__ import annotations

import torch

from moe_rl.algo.common import EXP_CLAMP, check_same_shape, compute_dtype, masked_seq_sum

KL_ESTIMATORS = ("k1", "k2", "k3")


K3_CAP = 10.0        # the k3 value is capped (as verl), no gradient beyond


def kl_estimate(lp: torch.Tensor, lp_ref: torch.Tensor, estimator: str = "k3", *,
                lp_old: torch.Tensor | None = None, off_policy_corrected: bool = False
                ) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate [B, T] with ``D = lp_ref - lp``, computed in
    float32 (float64 for float64 inputs): k1 = -D, k2 = D^2 / 2 (neither clamped),
    k3 = expm1(min(D, 20)) - D, never negative, capped at 10.

    ``off_policy_corrected`` multiplies each token by ``exp(lp - lp_old)`` (log-ratio clamped
    to +-20) WITH its gradient (DeepSeek-V3.2, slime): for tokens drawn from pi_old the
    expectation is then KL(pi_theta || pi_ref) in value and in gradient (a detached ratio would
    give the reverse KL's gradient). Needs ``lp_old``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")
    check_same_shape(lp=lp, lp_ref=lp_ref)
    dtype = compute_dtype(lp, lp_ref)
    d = lp_ref.to(dtype) - lp.to(dtype)
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = (torch.expm1(d.clamp(max=EXP_CLAMP)) - d).clamp(0.0, K3_CAP)
    if off_policy_corrected:
        if lp_old is None:
            raise ValueError("lp_old: the off-policy-corrected KL needs pi_old log-probs")
        check_same_shape(lp=lp, lp_old=lp_old)
        log_ratio = (lp.to(dtype) - lp_old.to(dtype)).clamp(-EXP_CLAMP, EXP_CLAMP)
        kl = kl * torch.exp(log_ratio)
    return kl


def kl_reward_penalty(lp_old: torch.Tensor, lp_ref: torch.Tensor, mask: torch.Tensor,
                      estimator: str, coef: float) -> torch.Tensor:
    """Per-sequence penalty ``coef * sum_t KL_t`` [B] to subtract from the rewards before
    advantages (KL folded into the reward, evaluated at pi_old, no gradient)."""
    with torch.no_grad():
        return coef * masked_seq_sum(kl_estimate(lp_old, lp_ref, estimator), mask)
