"""Group-relative advantages: GRPO, Dr.GRPO, RLOO and QAE (one value per sequence)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Groups:
    """Rewards ``r`` [N], each one's group ``inv`` [N], and per group its size and sum."""
    r: torch.Tensor
    inv: torch.Tensor
    count: torch.Tensor
    total: torch.Tensor

    def mean(self) -> torch.Tensor:
        return (self.total / self.count)[self.inv]

    def std(self) -> torch.Tensor:
        """The group's standard deviation with Bessel's correction (as torch.std), per sample."""
        dev = self.r - self.mean()
        sq = torch.zeros_like(self.total).index_add_(0, self.inv, dev * dev)
        return (sq / (self.count - 1).clamp_min(1)).sqrt()[self.inv]

    def quantile(self, k: float) -> torch.Tensor:
        """The group's k-quantile, linear between order statistics (torch.quantile's and
        numpy's default), per sample."""
        by_reward = torch.argsort(self.r, stable=True)
        order = by_reward[torch.argsort(self.inv[by_reward], stable=True)]
        ranked = self.r[order]   # grouped, each group ascending
        start = torch.cumsum(self.count, 0) - self.count
        pos = k * (self.count - 1)
        lo = pos.floor()
        hi = pos.ceil()
        low = ranked[(start + lo).long()]
        value = low + (pos - lo) * (ranked[(start + hi).long()] - low)
        return value[self.inv]


def _grpo(g: _Groups, eps: float, k: float) -> torch.Tensor:
    """(R_i - mean_g R) / (std_g R + eps)."""
    return (g.r - g.mean()) / (g.std() + eps)


def _drgrpo(g: _Groups, eps: float, k: float) -> torch.Tensor:
    """R_i - mean_g R."""
    return g.r - g.mean()


def _rloo(g: _Groups, eps: float, k: float) -> torch.Tensor:
    """R_i - mean_{j != i} R_j."""
    return g.r - (g.total[g.inv] - g.r) / (g.count[g.inv] - 1).clamp_min(1)


def _qae(g: _Groups, eps: float, k: float) -> torch.Tensor:
    """(R_i - Q_k(R_g)) / (std_g R + eps): GRPO with the group's k-quantile as baseline."""
    return (g.r - g.quantile(k)) / (g.std() + eps)


# algorithm.advantage's choices: (groups, eps, QAE's k) -> [N]
ADVANTAGES = {"grpo": _grpo, "drgrpo": _drgrpo, "rloo": _rloo, "qae": _qae}


def compute_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, method: str = "grpo",
                       eps: float = 1e-6, qae_k: float = 0.4) -> torch.Tensor:
    """Per-sequence advantages [N] from rewards [N] and prompt-group ids [N].

    grpo:   (R_i - mean_g R) / (std_g R + eps), std with Bessel's correction (as torch.std);
    drgrpo: R_i - mean_g R;
    rloo:   R_i - mean_{j != i} R_j;
    qae:    (R_i - Q_k(R_g)) / (std_g R + eps), Q_k the group's ``qae_k``-quantile, linear
            between order statistics (Wu et al., arXiv 2509.22611, as the authors' code).
    A group of one sample has no baseline and gets advantage 0 under every method.
    """
    if method not in ADVANTAGES:
        raise ValueError(f"advantage method: expected one of {tuple(ADVANTAGES)}, got "
                         f"{method!r}")
    if not 0.0 < qae_k < 1.0:
        raise ValueError(f"qae_k: expected a quantile in (0, 1), got {qae_k!r}")
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
    adv = ADVANTAGES[method](_Groups(r, inv, count, total), eps, qae_k)
    return torch.where(count[inv] < 2, torch.zeros_like(adv), adv)


def zero_advantage_frac(advantages: torch.Tensor) -> float:
    """Share of the sequences whose advantage is exactly 0 (they give no gradient)."""
    return float((advantages == 0).double().mean()) if advantages.numel() else 0.0
