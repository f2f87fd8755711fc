"""Training-inference corrections (behaviour = engine, target = pi_old), composable in order.

Each correction multiplies the detached per-token weights and/or removes tokens from the keep
mask; the fraction of tokens and of sequences each one removes is reported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moe_rl.algo.common import (EXP_CLAMP, broadcast_to_tokens, check_same_shape,
                               masked_seq_mean)



@dataclass
class CorrectionInputs:
    """Everything a correction may read. All [B, T] except advantages / group_ids ([B])."""
    lp_old: torch.Tensor
    lp_roll: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    lp: torch.Tensor | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        check_same_shape(lp_old=self.lp_old, lp_roll=self.lp_roll, mask=self.mask, lp=self.lp)
        self.valid = self.mask.to(torch.bool)
        for name in ("lp_old", "lp_roll", "lp"):
            t = getattr(self, name)
            if t is not None and not bool(torch.isfinite(t[self.valid]).all()):
                raise ValueError(f"{name}: non-finite log-prob on a response token")
        with torch.no_grad():
            d = (self.lp_old - self.lp_roll).detach()
            d = torch.where(self.valid, d, torch.zeros_like(d))
            self.log_rho_tok = d
            self.log_rho_seq = d.sum(-1).clamp(-EXP_CLAMP, EXP_CLAMP)
            self.log_rho_geo = masked_seq_mean(d, self.mask).clamp(-EXP_CLAMP, EXP_CLAMP)


@dataclass
class CorrectionResult:
    """Detached weights [B, T], keep mask [B, T] (bool, within ``mask``) and metrics."""
    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def _param(params: Any, name: str) -> float:
    value = params[name] if isinstance(params, dict) else getattr(params, name)
    if value is None:
        raise ValueError(f"algorithm.correction.{name}: needs a value")
    return value


def _seq(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return broadcast_to_tokens(x, like)


def _token_tis(x: CorrectionInputs, p: Any):
    w = torch.exp(x.log_rho_tok.clamp(-EXP_CLAMP, EXP_CLAMP)).clamp(max=_param(p, "tis_c"))
    return w, None


def _seq_tis(x: CorrectionInputs, p: Any):
    w = torch.exp(x.log_rho_seq).clamp(max=_param(p, "tis_c"))
    return _seq(w, x.lp_old), None


def _seq_mis(x: CorrectionInputs, p: Any):
    rho = torch.exp(x.log_rho_seq)
    keep = rho <= _param(p, "mis_c")
    return _seq(torch.where(keep, rho, torch.zeros_like(rho)), x.lp_old), _seq(keep, x.valid)


def _seq_rs(x: CorrectionInputs, p: Any):
    rho = torch.exp(x.log_rho_seq)
    keep = (rho >= _param(p, "rs_low")) & (rho <= _param(p, "rs_high"))
    return None, _seq(keep, x.valid)


def _geo_rs(x: CorrectionInputs, p: Any):
    rho = torch.exp(x.log_rho_geo)
    keep = (rho >= _param(p, "geo_low")) & (rho <= _param(p, "geo_high"))
    return None, _seq(keep, x.valid)


def _icepop(x: CorrectionInputs, p: Any):
    k = torch.exp(x.log_rho_tok.clamp(-EXP_CLAMP, EXP_CLAMP))
    keep = (k >= _param(p, "icepop_low")) & (k <= _param(p, "icepop_high"))
    return torch.where(keep, k, torch.zeros_like(k)), keep


def _opsm(x: CorrectionInputs, p: Any):
    """DeepSeek-V3.2: mask i iff A_i < 0 and mean_t(lp_behaviour - lp) > delta."""
    if x.advantages is None:
        raise ValueError("advantages: the DeepSeek off-policy mask needs per-sequence advantages")
    ref = _param(p, "opsm_reference")
    if ref not in ("engine", "pi_old"):
        raise ValueError(f"algorithm.correction.opsm_reference: expected 'engine' or 'pi_old', "
                         f"got {ref!r}")
    behaviour = x.lp_roll if ref == "engine" else x.lp_old
    target = x.lp if x.lp is not None else x.lp_old
    kl = masked_seq_mean((behaviour - target).detach(), x.mask)
    adv = x.advantages if x.advantages.dim() == 1 else x.advantages[:, 0]
    masked = (adv < 0) & (kl > _param(p, "opsm_delta"))
    return None, _seq(~masked, x.valid)


def trm_divergence(log_rho: torch.Tensor, measure: str) -> torch.Tensor:
    """Per-token divergence of Trust Region Masking from log ρ_t = lp_old - lp_roll:
    ``log_ratio`` |log ρ|, ``k2`` (log ρ)²/2, ``k3`` ρ - 1 - log ρ (each >= 0, 0 iff
    ρ = 1)."""
    if measure == "log_ratio":
        return log_rho.abs()
    if measure == "k2":
        return 0.5 * log_rho * log_rho
    if measure == "k3":
        return torch.expm1(log_rho.clamp(-EXP_CLAMP, EXP_CLAMP)) - log_rho
    raise ValueError(f"algorithm.correction.trm_measure: expected 'log_ratio', 'k2' or 'k3', "
                     f"got {measure!r}")


def _trm(x: CorrectionInputs, p: Any):
    """Trust Region Masking: a sequence is masked when its largest per-token divergence
    (:func:`trm_divergence`) exceeds ``trm_delta``."""
    d = trm_divergence(x.log_rho_tok, _param(p, "trm_measure"))
    worst = torch.where(x.valid, d, torch.zeros_like(d)).amax(-1)
    return None, _seq(worst <= _param(p, "trm_delta"), x.valid)


def _metropolis(x: CorrectionInputs, p: Any):
    """Metropolis independence sampler: walk each group (or each sequence's tokens) in order,
    accepting candidate c with probability min(1, w_c / w_current).

    ``metropolis_count_repeats`` (default): the walk is a Metropolis-Hastings chain whose states
    are the samples; a rejected candidate repeats the current state, so each sample's weight is
    the number of chain steps it was the state (1 + the candidates rejected while it was
    current) and rejected candidates get 0: the weighted average is the chain average, an
    estimate under the target. Off: accepted samples weigh 1 and rejected ones are masked (the
    literal variant, biased toward low-weight samples)."""
    mode = _param(p, "metropolis_weight")
    repeats = bool(_param(p, "metropolis_count_repeats"))
    gen = x.generator
    counts = torch.zeros(x.valid.shape, dtype=torch.float64)
    if mode == "token":
        for i in range(x.valid.shape[0]):
            idx = x.valid[i].nonzero().squeeze(1).tolist()
            counts[i] = metropolis_chain(x.log_rho_tok[i], idx, gen)
    elif mode in ("seq", "geo"):
        if x.group_ids is None:
            raise ValueError("group_ids: the Metropolis sampler walks each prompt group")
        log_w = x.log_rho_seq if mode == "seq" else x.log_rho_geo
        seq_counts = torch.zeros(x.valid.shape[0], dtype=torch.float64)
        has_tok = x.valid.any(-1)
        for g in torch.unique(x.group_ids).tolist():
            idx = ((x.group_ids == g) & has_tok).nonzero().squeeze(1).tolist()
            seq_counts += metropolis_chain(log_w, idx, gen)
        counts = _seq(seq_counts, x.valid).to(torch.float64)
    else:
        raise ValueError(f"algorithm.correction.metropolis_weight: expected seq, geo or token, "
                         f"got {mode!r}")
    keep = counts > 0
    return (counts if repeats else None), keep


def metropolis_chain(log_w: torch.Tensor, order: list[int], gen: torch.Generator | None
                     ) -> torch.Tensor:
    """Walk ``order`` as an independence Metropolis-Hastings chain on importance weights
    ``exp(log_w)`` (first element = initial state); returns, per index of ``log_w``, the number
    of chain steps it was the state (0 for rejected candidates and indices not in ``order``)."""
    counts = torch.zeros(log_w.shape[0], dtype=torch.float64)
    if not order:
        return counts
    current = order[0]
    counts[current] = 1.0
    for cand in order[1:]:
        log_acc = float(log_w[cand] - log_w[current])
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if log_acc >= 0 or u < math.exp(log_acc):
            current = cand
        counts[current] += 1.0
    return counts


def _snis(x: CorrectionInputs, p: Any, weights: torch.Tensor, keep: torch.Tensor):
    """Self-normalise the weights so their mean per group is 1: w_i / mean_{j in g} w_j, with
    w_i the mean weight of sequence i over its kept tokens (sequences with none excluded)."""
    if x.group_ids is None:
        raise ValueError("group_ids: SNIS normalises within each prompt group")
    has = keep.any(-1)
    w_seq = masked_seq_mean(weights, keep)
    out = weights.clone()
    for g in torch.unique(x.group_ids).tolist():
        sel = (x.group_ids == g) & has
        if sel.any():
            mean = w_seq[sel].mean()
            if mean > 0:
                out[x.group_ids == g] = weights[x.group_ids == g] / mean
    return out


CORRECTION_FUNCTIONS: dict[str, Callable] = {
    "token_tis": _token_tis, "seq_tis": _seq_tis, "seq_mis": _seq_mis, "seq_rs": _seq_rs,
    "geo_rs": _geo_rs, "icepop": _icepop, "opsm": _opsm, "trm": _trm,
    "metropolis": _metropolis,
}
CORRECTIONS = tuple(CORRECTION_FUNCTIONS) + ("snis",)


def apply_corrections(names: list[str], params: Any, inputs: CorrectionInputs
                      ) -> CorrectionResult:
    """Apply the corrections ``names`` in order; ``params`` holds their thresholds (a
    :class:`moe_rl.config.CorrectionParams` or a dict with the same keys).

    Metrics: ``correction/<name>/masked_token_frac`` and ``.../masked_seq_frac`` (share of
    response tokens / sequences that this correction removes on its own) and, over the kept
    tokens of the final weights, ``is/ess``, ``is/mean``, ``is/max``.
    """
    valid = inputs.valid
    dtype = inputs.lp_old.dtype
    weights = torch.ones_like(inputs.lp_old, dtype=dtype).detach()
    keep = valid.clone()
    metrics: dict[str, float] = {}
    n_tok = max(int(valid.sum()), 1)
    has_tok = valid.any(-1)
    n_seq = max(int(has_tok.sum()), 1)
    for name in names:
        if name not in CORRECTIONS:
            raise ValueError(f"algorithm.corrections: unknown correction {name!r}; valid: "
                             f"{', '.join(CORRECTIONS)}")
        if name == "snis":
            weights = _snis(inputs, params, weights, keep)
            continue
        w, k = CORRECTION_FUNCTIONS[name](inputs, params)
        if w is not None:
            weights = weights * w.to(dtype)
        if k is not None:
            removed = valid & ~k
            metrics[f"correction/{name}/masked_token_frac"] = int(removed.sum()) / n_tok
            metrics[f"correction/{name}/masked_seq_frac"] = int(
                (has_tok & ~(k & valid).any(-1)).sum()) / n_seq
            keep = keep & k
    weights = torch.where(keep, weights, torch.zeros_like(weights)).detach()
    metrics.update(importance_metrics(weights, keep))
    return CorrectionResult(weights, keep, metrics)


def importance_metrics(weights: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    """``is/ess = (sum w)^2 / (N sum w^2)``, ``is/mean``, ``is/max`` over the kept tokens."""
    w = weights[keep.to(torch.bool)].to(torch.float64)
    if w.numel() == 0:
        return {"is/ess": 0.0, "is/mean": 0.0, "is/max": 0.0}
    sq = float((w * w).sum())
    ess = float(w.sum()) ** 2 / (w.numel() * sq) if sq > 0 else 0.0
    return {"is/ess": ess, "is/mean": float(w.mean()), "is/max": float(w.max())}
