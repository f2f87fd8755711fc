"""The algorithm library (pure torch): advantages, policy losses, aggregation, corrections, KL,
keep-sampling-mask scoring, n-pass pi_old averaging, metrics and the collapse guard.

Per-token quantities are padded [B, T] tensors with a response mask; see ALGORITHMS.md.
"""
from moe_rl.algo.advantages import ADVANTAGES, compute_advantages, zero_advantage_frac
from moe_rl.algo.aggregation import AGGREGATIONS, Normalisers, aggregate, count_normalisers
from moe_rl.algo.corrections import (CORRECTIONS, CorrectionInputs, CorrectionResult,
                                     apply_corrections, importance_metrics)
from moe_rl.algo.kl import KL_ESTIMATORS, kl_estimate, kl_reward_penalty
from moe_rl.algo.losses import (POLICY_LOSSES, binary_kl, cispo_loss, clip_cov, clip_cov_select,
                               dppo_loss, gmpo_loss, gspo_loss, kl_cov_loss, kl_cov_select,
                               ppo_clip_loss, rollout_penalty, sapo_loss)
from moe_rl.algo.metrics import batch_metrics, collapse_guard, mismatch_metrics, routing_agreement
from moe_rl.algo.pi_old import average_pass_logprobs
from moe_rl.algo.router_shift import (router_log_scores, router_shift_metrics,
                                      router_shift_weight)
from moe_rl.algo.sampling_mask import kept_set_sizes

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "CORRECTIONS", "KL_ESTIMATORS", "POLICY_LOSSES",
    "CorrectionInputs", "CorrectionResult", "Normalisers", "aggregate", "apply_corrections",
    "average_pass_logprobs", "batch_metrics", "cispo_loss", "clip_cov", "clip_cov_select",
    "collapse_guard", "compute_advantages", "count_normalisers", "binary_kl", "dppo_loss",
    "gmpo_loss", "gspo_loss", "importance_metrics", "kept_set_sizes", "kl_cov_loss",
    "kl_cov_select", "kl_estimate", "kl_reward_penalty", "mismatch_metrics", "ppo_clip_loss",
    "rollout_penalty", "sapo_loss", "router_log_scores", "router_shift_metrics",
    "router_shift_weight", "routing_agreement", "zero_advantage_frac",
]
