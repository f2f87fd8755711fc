"""RSPO's router-shift weight (Zhang et al., "Towards Stable and Effective Reinforcement Learning
for Mixture-of-Experts", arXiv 2510.23027): how far each token's routing moved between pi_old and
pi_theta, measured on the experts pi_old activated, as a detached factor in (floor, 1] on the
token's importance ratio (:mod:`moe_rl.algo.losses`, ``log_scale``).

For token t, MoE layer l and the K experts ``E_old(t, l)`` pi_old routed it to, with ``s(e)`` the
router's log-score of expert e (:func:`router_log_scores`)::

    d_t     = mean over l of  mean over e in E_old(t, l) of |s_theta(e) - s_old(e)|
    gamma_t = max(exp(-d_t), floor)
"""
from __future__ import annotations

import torch

from moe_rl.algo.common import masked_mean

SCORE_FUNCTIONS = ("softmax", "sigmoid")


def router_log_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The router's log-score of every expert, [tokens, E] float32 (float64 for float64 input),
    from its logits: ``log_softmax`` over all experts for softmax routers (with or without
    megatron's pre-softmax: the full distribution), ``log sigmoid`` for sigmoid routers
    (DeepSeek-V3; the expert bias only steers the choice and is left out)."""
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"score_function: expected one of {SCORE_FUNCTIONS}, got "
                         f"{score_function!r}")
    x = logits.double() if logits.dtype == torch.float64 else logits.float()
    if score_function == "softmax":
        return torch.log_softmax(x, -1)
    return torch.nn.functional.logsigmoid(x)


def router_shift_weight(old: torch.Tensor, new: torch.Tensor, floor: float) -> torch.Tensor:
    """gamma [..., T] from the log-scores at pi_old's experts, ``old`` and ``new`` [..., T, L, K]
    (pi_old's and pi_theta's), detached."""
    if old.shape != new.shape:
        raise ValueError(f"router scores: expected the same shape at pi_old and pi_theta, got "
                         f"{list(old.shape)} and {list(new.shape)}")
    if not 0 <= floor <= 1:
        raise ValueError(f"floor: expected a value in [0, 1], got {floor}")
    shift = (new.detach().double() - old.detach().double()).abs().mean(dim=(-1, -2))
    return torch.exp(-shift).clamp(min=floor)


def router_shift_metrics(gamma: torch.Tensor, mask: torch.Tensor, floor: float
                         ) -> dict[str, float]:
    """``router_shift/gamma_mean``, ``router_shift/floor_frac`` (tokens held at the floor) and
    ``router_shift/shifted_frac`` (tokens with gamma < 1) over the masked tokens."""
    g = gamma.double()
    return {"router_shift/gamma_mean": float(masked_mean(g, mask)),
            "router_shift/floor_frac": float(masked_mean((g <= floor).double(), mask)),
            "router_shift/shifted_frac": float(masked_mean((g < 1).double(), mask))}
