"""Group-relative advantages: GRPO, Dr.GRPO and RLOO (one value per sequence)."""
from __future__ import annotations

import torch


def _drgrpo(r: torch.Tensor, inv: torch.Tensor, count: torch.Tensor, total: torch.Tensor,
            eps: float) -> torch.Tensor:
    """R_i - mean_g R."""
    return r - (total / count)[inv]


def _grpo(r, inv, count, total, eps):
    """(R_i - mean_g R) / (std_g R + eps), std with Bessel's correction."""
    adv = _drgrpo(r, inv, count, total, eps)
    sq = torch.zeros_like(total).index_add_(0, inv, adv * adv)
    return adv / ((sq / (count - 1).clamp_min(1)).sqrt()[inv] + eps)


def _rloo(r, inv, count, total, eps):
    """R_i - mean_{j != i} R_j."""
    return r - (total[inv] - r) / (count[inv] - 1).clamp_min(1)


# algorithm.advantage's choices: (rewards, group index, group sizes, group sums, eps) -> [N]
ADVANTAGES = {"grpo": _grpo, "drgrpo": _drgrpo, "rloo": _rloo}


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, method: str = "grpo",
                       eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence advantages [N] from rewards [N] and prompt-group ids [N].

    grpo:   (R_i - mean_g R) / (std_g R + eps), std with Bessel's correction (as torch.std);
    drgrpo: R_i - mean_g R;
    rloo:   R_i - mean_{j != i} R_j.
    A group of one sample has no baseline and gets advantage 0 under every method.
    """
    if method not in ADVANTAGES:
        raise ValueError(f"advantage method: expected one of {tuple(ADVANTAGES)}, got "
                         f"{method!r}")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids: expected two 1-D tensors of equal length, got "
                         f"{list(rewards.shape)} and {list(group_ids.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards: expected finite values")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.to(dtype)
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, dtype=dtype).index_add_(0, inv, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=dtype).index_add_(0, inv, r)
    adv = ADVANTAGES[method](r, inv, count, total, eps)
    return torch.where(count[inv] < 2, torch.zeros_like(adv), adv)
