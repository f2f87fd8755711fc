"""KL to the reference policy: k1, k2, k3 and the off-policy-corrected k3, as loss or reward."""
from __future__ import annotations

import torch

from moe_rl.algo.common import check_same_shape, masked_seq_sum

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(lp: torch.Tensor, lp_ref: torch.Tensor, estimator: str = "k3", *,
                lp_old: torch.Tensor | None = None, off_policy_corrected: bool = False
                ) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate [B, T] with ``D = lp_ref - lp``:
    k1 = -D, k2 = D^2 / 2, k3 = exp(D) - D - 1.

    ``off_policy_corrected`` weights each token by ``exp(lp - lp_old)`` (detached), the
    DeepSeek-V3.2 correction for samples not drawn from pi_theta (needs ``lp_old``).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator: expected one of {KL_ESTIMATORS}, got {estimator!r}")
    check_same_shape(lp=lp, lp_ref=lp_ref)
    d = (lp_ref - lp).clamp(-20.0, 20.0)
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = torch.exp(d) - d - 1.0
    if off_policy_corrected:
        if lp_old is None:
            raise ValueError("lp_old: the off-policy-corrected KL needs pi_old log-probs")
        check_same_shape(lp=lp, lp_old=lp_old)
        kl = kl * torch.exp((lp - lp_old).clamp(-20.0, 20.0)).detach()
    return kl


def kl_reward_penalty(lp_old: torch.Tensor, lp_ref: torch.Tensor, mask: torch.Tensor,
                      estimator: str, coef: float) -> torch.Tensor:
    """Per-sequence penalty ``coef * sum_t KL_t`` [B] to subtract from the rewards before
    advantages (KL folded into the reward, evaluated at pi_old, no gradient)."""
    with torch.no_grad():
        return coef * masked_seq_sum(kl_estimate(lp_old, lp_ref, estimator), mask)
