"""Mismatch, routing and batch metrics, with the names of ALGORITHMS.md; plus the collapse guard."""
from __future__ import annotations

import math

import torch

from moe_rl.algo.common import EXP_CLAMP


def mismatch_metrics(lp_old: torch.Tensor, lp_roll: torch.Tensor, mask: torch.Tensor
                     ) -> dict[str, float]:
    """Training-inference mismatch between ``lt = lp_old`` (trainer, before the update) and
    ``lr = lp_roll`` (engine) over the response tokens: mismatch/k1, mismatch/k3,
    mismatch/abs_diff_mean, mismatch/abs_diff_max, mismatch/extreme_frac,
    mismatch/prob_pearson, ppl/token_pooled_train, ppl/token_pooled_rollout (exp of minus the
    mean log-prob pooled over every token of the batch, not verl's per-sequence mean),
    chi2/token, chi2/seq."""
    valid = mask.to(torch.bool)
    lt = lp_old.detach().to(torch.float64)
    lr = lp_roll.detach().to(torch.float64)
    if not valid.any():
        return {}
    d = (lt - lr)[valid]
    ltv, lrv = lt[valid], lr[valid]
    ratio = torch.exp(d.clamp(-EXP_CLAMP, EXP_CLAMP))
    pt, pr = torch.exp(ltv), torch.exp(lrv)
    if d.numel() > 1 and pt.std() > 0 and pr.std() > 0:
        pearson = float(torch.corrcoef(torch.stack([pt, pr]))[0, 1])
    else:
        pearson = 1.0 if torch.equal(pt, pr) else 0.0
    seq_has = valid.any(-1)
    dseq = torch.where(valid, lt - lr, torch.zeros_like(lt)).sum(-1)[seq_has]
    rho_seq = torch.exp(dseq.clamp(-EXP_CLAMP, EXP_CLAMP))
    return {
        "mismatch/k1": float((lrv - ltv).mean()),
        "mismatch/k3": float((ratio - d - 1.0).mean()),
        "mismatch/abs_diff_mean": float(d.abs().mean()),
        "mismatch/abs_diff_max": float(d.abs().max()),
        "mismatch/extreme_frac": float(((ratio < 0.5) | (ratio > 2.0)).double().mean()),
        "mismatch/prob_pearson": pearson,
        "ppl/token_pooled_train": float(torch.exp(-ltv.mean())),
        "ppl/token_pooled_rollout": float(torch.exp(-lrv.mean())),
        "chi2/token": float((ratio * ratio).mean() - 1.0),
        "chi2/seq": float((rho_seq * rho_seq).mean() - 1.0),
    }


def routing_agreement(trainer_topk: torch.Tensor, engine_topk: torch.Tensor,
                      valid: torch.Tensor | None = None, layer_names: list[int] | None = None
                      ) -> dict[str, float]:
    """Fraction of (position, layer) pairs whose top-k expert SETS agree (order ignored).

    trainer_topk, engine_topk: [N, L, K] expert ids; valid: [N] bool (positions to count).
    Returns ``routing/agreement``, ``routing/agreement_layer_{i}`` (i = ``layer_names[l]``,
    default the MoE-layer index l) and ``routing/token_differs_frac``: the share of positions
    whose top-k set differs in at least one of the layers.
    """
    if trainer_topk.shape != engine_topk.shape or trainer_topk.dim() != 3:
        raise ValueError(f"routing: expected two [N, L, K] tensors of equal shape, got "
                         f"{list(trainer_topk.shape)} and {list(engine_topk.shape)}")
    a = trainer_topk.long().sort(-1).values
    b = engine_topk.long().sort(-1).values
    same = (a == b).all(-1)  # [N, L]
    if valid is not None:
        same = same[valid.to(torch.bool)]
    if same.numel() == 0:
        return {}
    names = layer_names if layer_names is not None else list(range(same.shape[1]))
    out = {"routing/agreement": float(same.double().mean()),
           "routing/token_differs_frac": float((~same.all(-1)).double().mean())}
    per_layer = same.double().mean(0)
    for name, value in zip(names, per_layer.tolist()):
        out[f"routing/agreement_layer_{name}"] = value
    return out


def batch_metrics(rewards: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor | None = None,
                  kept_sizes: torch.Tensor | None = None) -> dict[str, float]:
    """reward/mean, reward/std, response_len/mean, entropy (mean over response tokens) and
    sampling_mask/kept_mean (mean kept-set size over the response tokens that have one)."""
    valid = mask.to(torch.bool)
    out = {"reward/mean": float(rewards.double().mean()),
           "reward/std": float(rewards.double().std(unbiased=False)),
           "response_len/mean": float(valid.sum(-1).double().mean())}
    if entropy is not None and valid.any():
        out["entropy"] = float(entropy.detach().double()[valid].mean())
    if kept_sizes is not None and (kept_sizes > 0).any():
        out["sampling_mask/kept_mean"] = float(kept_sizes[kept_sizes > 0].double().mean())
    return out


def collapse_guard(metrics: dict[str, float], threshold: float | None) -> bool:
    """True when the batch must be skipped: a non-finite ``mismatch/k3`` (always, guard on or
    off: such a batch cannot be trusted), or one above ``threshold`` (None = off)."""
    k3 = metrics.get("mismatch/k3")
    if k3 is not None and not math.isfinite(k3):
        return True
    return threshold is not None and k3 is not None and k3 > threshold
