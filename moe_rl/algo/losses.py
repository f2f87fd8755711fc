"""Policy losses (per token, minimised): PPO-clip / GRPO, GSPO, GMPO, DPPO, CISPO and SAPO, plus
Clip-Cov and KL-Cov. The ratio losses (PPO-clip, GSPO, GMPO) take an optional ``log_scale``
[B, T], a detached per-token log factor on the ratio applied before clipping and aggregation
(RSPO's router-shift weight, :mod:`moe_rl.algo.router_shift`)."""
from __future__ import annotations

import torch

from moe_rl.algo.common import (EXP_CLAMP, broadcast_to_tokens, check_same_shape, compute_dtype,
                               masked_mean, masked_seq_mean)

GSPO_LOG_CAP = 10.0   # GSPO: the sequence and token log-ratios are capped at 10 (as verl)


def _log_ratio(lp: torch.Tensor, lp_old: torch.Tensor, log_scale: torch.Tensor | None
               ) -> torch.Tensor:
    """``lp - lp_old`` plus the detached ``log_scale`` (when given)."""
    if log_scale is None:
        return lp - lp_old
    check_same_shape(lp=lp, log_scale=log_scale)
    return lp - lp_old + log_scale.detach().to(lp.dtype)


def _sequence_inputs(loss: str, lp: torch.Tensor, lp_old: torch.Tensor,
                     advantages: torch.Tensor, mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """A sequence-level loss's checked inputs: shapes, one advantage per sequence, and the
    log-probs in the compute dtype."""
    check_same_shape(lp=lp, lp_old=lp_old, mask=mask)
    if advantages.dim() != 1:
        raise ValueError(f"advantages: {loss} needs one advantage per sequence [B], got "
                         f"{list(advantages.shape)}")
    dtype = compute_dtype(lp, lp_old, advantages)
    return lp.to(dtype), lp_old.to(dtype), dtype


def ppo_clip_loss(lp: torch.Tensor, lp_old: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_low: float, clip_high: float,
                  dual_clip_c: float | None = None, log_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip: ``-min(r A, clip(r, 1-clip_low, 1+clip_high) A)``, in float32
    (float64 for float64 inputs), with ``log r`` clamped to +-20 before the exp.

    clip-higher is ``clip_high > clip_low``; dual-clip caps the loss of negative-advantage
    tokens at ``c |A|``. Returns the per-token loss [B, T] and metrics (clip_frac,
    dual_clip_frac) over the masked tokens.
    """
    check_same_shape(lp=lp, lp_old=lp_old, mask=mask)
    dtype = compute_dtype(lp, lp_old, advantages)
    lp, lp_old = lp.to(dtype), lp_old.to(dtype)
    adv = broadcast_to_tokens(advantages.to(dtype), lp)
    ratio = torch.exp(_log_ratio(lp, lp_old, log_scale).clamp(-EXP_CLAMP, EXP_CLAMP))
    loss_unclipped = -ratio * adv
    loss_clipped = -ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).to(dtype)
    dual = torch.zeros_like(loss)
    if dual_clip_c is not None:
        if dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c: expected > 1, got {dual_clip_c}")
        cap = -dual_clip_c * adv  # = c|A| where A < 0
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        dual = capped.to(dtype)
    with torch.no_grad():
        metrics = {"clip_frac": float(masked_mean(clipped, mask)),
                   "dual_clip_frac": float(masked_mean(dual, mask))}
    return loss, metrics


def gspo_loss(lp: torch.Tensor, lp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float, clip_high: float, log_scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO in token form: ``s_it = sg[s_i] * exp(lp - sg[lp])`` with ``s_i`` the length-normalised
    sequence ratio ``exp(mean_t (lp - lp_old))``; loss ``-min(s_it A_i, clip(s_it) A_i)``, in
    float32 (float64 for float64 inputs). ``log s_i`` and ``log s_it`` are capped at 10 (verl's
    bound; no gradient beyond).

    Aggregated seq-mean-token-mean its gradient equals that of the sequence-level objective.
    Returns the per-token loss [B, T] and metrics (clip_frac = fraction of sequences clipped,
    gspo/seq_ratio_mean).
    """
    lp, lp_old, dtype = _sequence_inputs("GSPO", lp, lp_old, advantages, mask)
    log_s = masked_seq_mean(_log_ratio(lp, lp_old, log_scale), mask).clamp(max=GSPO_LOG_CAP)
    log_tok = log_s.detach()[:, None] + lp - lp.detach()
    beyond = (log_s.detach() >= GSPO_LOG_CAP)[:, None]   # capped sequences carry no gradient
    s_tok = torch.exp(torch.where(beyond, log_tok.detach(), log_tok))
    adv = broadcast_to_tokens(advantages.to(dtype), lp)
    loss_unclipped = -s_tok * adv
    loss_clipped = -s_tok.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = torch.maximum(loss_unclipped, loss_clipped)
    with torch.no_grad():
        has_tok = mask.to(torch.bool).any(-1)
        clipped_seq = ((loss_clipped > loss_unclipped) & mask.to(torch.bool)).any(-1) & has_tok
        n = has_tok.sum().clamp_min(1)
        metrics = {"clip_frac": float(clipped_seq.sum() / n),
                   "gspo/seq_ratio_mean": float(torch.exp(log_s)[has_tok].mean())
                   if has_tok.any() else 1.0}
    return loss, metrics


def gmpo_loss(lp: torch.Tensor, lp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float, clip_high: float, log_scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (Zhao et al., 2025, arXiv 2507.20673): the sequence objective ``A_i exp(mean_t c_t)``,
    the geometric mean of the token ratios, each clipped in log space on the pessimistic side:
    ``c_t = sgn(A) min(sgn(A) log r_t, sgn(A) clamp(log r_t, -clip_low, clip_high))`` (no
    gradient through a clipped token). In token form ``-A_i sg[g_i] (1 + c_t - sg[c_t])`` with
    ``g_i = exp(mean_t c_t)``: under seq-mean-token-mean its value is ``-A_i g_i`` and its
    gradient the sequence objective's. ``log r`` clamped to +-20, in float32 (float64 for
    float64 inputs). Returns the per-token loss [B, T] and metrics (clip_frac = masked tokens
    clipped, gmpo/seq_ratio_mean)."""
    lp, lp_old, dtype = _sequence_inputs("GMPO", lp, lp_old, advantages, mask)
    log_r = _log_ratio(lp, lp_old, log_scale).clamp(-EXP_CLAMP, EXP_CLAMP)
    sign = torch.sign(broadcast_to_tokens(advantages.to(dtype), lp))
    bounded = log_r.clamp(-clip_low, clip_high)
    c = sign * torch.minimum(sign * log_r, sign * bounded)
    g = torch.exp(masked_seq_mean(c, mask)).detach()
    adv = broadcast_to_tokens(advantages.to(dtype), lp)
    loss = -adv * g[:, None] * (1 + c - c.detach())
    with torch.no_grad():
        has_tok = mask.to(torch.bool).any(-1)
        metrics = {"clip_frac": float(masked_mean((c != log_r).to(dtype), mask)),
                   "gmpo/seq_ratio_mean": float(g[has_tok].mean()) if has_tok.any() else 1.0}
    return loss, metrics


DPPO_DIVERGENCES = ("tv", "kl")


def binary_kl(lp: torch.Tensor, lp_old: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(q) || Bernoulli(p)) of the sampled token, ``q = exp(lp_old)``, ``p =
    exp(lp)``: ``q log(q/p) + (1-q) log((1-q)/(1-p))``, with ``log(1-x)`` from ``expm1`` (exact
    near x = 1), ``0 log 0 = 0`` and ``+inf`` when p = 1 > q."""
    one_minus_q = -torch.expm1(lp_old)
    tail = one_minus_q * (torch.log(one_minus_q) - torch.log(-torch.expm1(lp)))
    return lp_old.exp() * (lp_old - lp) + torch.where(one_minus_q > 0, tail,
                                                      torch.zeros_like(tail))


def dppo_loss(lp: torch.Tensor, lp_old: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, divergence: str, delta_low: float, delta_high: float,
              ratio_cap: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO (Qi et al., 2026, arXiv 2602.04879): a trust region on the divergence between the
    policies at the sampled token instead of on the ratio. With ``q = exp(lp_old)``, ``p =
    exp(lp)`` and ``r = p / q`` (``log r`` clamped to +-20), a token leaves the region when it
    moved too far in the direction its advantage pushes:

    - ``tv`` (binary total variation, signed ``p - q``): A > 0 and ``p - q > delta_high``, or
      A <= 0 and ``p - q < -delta_low``;
    - ``kl`` (binary KL, :func:`binary_kl`): A > 0, ``p > q`` and ``KL > delta_high``, or
      A <= 0, ``p < q`` and ``KL > delta_low``.

    Inside, the gradient is the unclipped policy gradient ``-A min(r, ratio_cap) grad lp``;
    outside, none. The per-token loss is ``-A sg(min(r, cap) / r) r`` (its value ``-A r`` below
    the cap, as PPO's surrogate), in float32 (float64 for float64 inputs). Returns the loss
    [B, T] and metrics: clip_frac (masked tokens outside the region), dppo/divergence_mean."""
    if divergence not in DPPO_DIVERGENCES:
        raise ValueError(f"divergence: expected one of {DPPO_DIVERGENCES}, got {divergence!r}")
    check_same_shape(lp=lp, lp_old=lp_old, mask=mask)
    dtype = compute_dtype(lp, lp_old, advantages)
    lp, lp_old = lp.to(dtype), lp_old.to(dtype)
    adv = broadcast_to_tokens(advantages.to(dtype), lp)
    ratio = torch.exp((lp - lp_old).clamp(-EXP_CLAMP, EXP_CLAMP))
    with torch.no_grad():
        now, old = lp.detach(), lp_old.detach()
        if divergence == "tv":
            moved = now.exp() - old.exp()
            outside = torch.where(adv > 0, moved > delta_high, moved < -delta_low)
            div = moved.abs()
        else:
            div = binary_kl(now, old)
            outside = torch.where(adv > 0, (now > old) & (div > delta_high),
                                  (now < old) & (div > delta_low))
        weight = ratio.detach() if ratio_cap is None else ratio.detach().clamp(max=ratio_cap)
        scale = torch.where(outside, torch.zeros_like(weight), weight / ratio.detach())
        valid = mask.to(torch.bool)
        finite = valid & torch.isfinite(div)
        metrics = {"clip_frac": float(masked_mean(outside.to(dtype), mask)),
                   "dppo/divergence_mean": float(div[finite].mean()) if finite.any() else 0.0}
    return -adv * scale * ratio, metrics


def cispo_loss(lp: torch.Tensor, lp_old: torch.Tensor, advantages: torch.Tensor,
               mask: torch.Tensor, eps_low: float | None, eps_high: float
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is clipped and detached, the
    update never is: the gradient is ``-A sg(clip(r, 1 - eps_low, 1 + eps_high)) grad lp`` on
    every token (``eps_low`` None: no lower bound, as the paper). The per-token loss is
    ``-A sg(w) (1 + lp - sg(lp))`` with ``w`` the clipped weight (its value ``-A w``), ``log r``
    clamped to +-20, in float32 (float64 for float64 inputs). Returns the loss [B, T] and
    metrics: clip_frac (masked tokens whose weight was clipped), cispo/weight_mean."""
    check_same_shape(lp=lp, lp_old=lp_old, mask=mask)
    dtype = compute_dtype(lp, lp_old, advantages)
    lp, lp_old = lp.to(dtype), lp_old.to(dtype)
    adv = broadcast_to_tokens(advantages.to(dtype), lp)
    with torch.no_grad():
        ratio = torch.exp((lp - lp_old).clamp(-EXP_CLAMP, EXP_CLAMP))
        weight = ratio.clamp(min=None if eps_low is None else 1.0 - eps_low, max=1.0 + eps_high)
        metrics = {"clip_frac": float(masked_mean((weight != ratio).to(dtype), mask)),
                   "cispo/weight_mean": float(masked_mean(weight, mask))}
    return -adv * weight * (1 + lp - lp.detach()), metrics


def sapo_loss(lp: torch.Tensor, lp_old: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, tau_pos: float, tau_neg: float
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (Gao et al., 2025, arXiv 2511.20347): a soft gate in place of the clip, ``-A f(r)``
    with ``f(r) = (4 / tau) sigmoid(tau (r - 1))``, ``tau = tau_pos`` where A > 0 and
    ``tau_neg`` elsewhere. Its gradient ``-A 4 s (1 - s) r grad lp`` (``s`` the sigmoid) is
    the policy gradient at ``r = 1`` and fades smoothly as the ratio leaves 1, faster for the
    larger temperature. ``log r`` clamped to +-20, in float32 (float64 for float64 inputs).
    Returns the loss [B, T] and metrics: sapo/gate_mean (the gradient's weight ``4 s (1 - s)``
    over the masked tokens, 1 on policy)."""
    check_same_shape(lp=lp, lp_old=lp_old, mask=mask)
    dtype = compute_dtype(lp, lp_old, advantages)
    lp, lp_old = lp.to(dtype), lp_old.to(dtype)
    adv = broadcast_to_tokens(advantages.to(dtype), lp)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    ratio = torch.exp((lp - lp_old).clamp(-EXP_CLAMP, EXP_CLAMP))
    gate = torch.sigmoid(tau * (ratio - 1))
    with torch.no_grad():
        metrics = {"sapo/gate_mean": float(masked_mean(4 * gate * (1 - gate), mask))}
    return -adv * (4 / tau) * gate, metrics


def rollout_penalty(lp: torch.Tensor, lp_roll: torch.Tensor, coef: float) -> torch.Tensor:
    """The penalty on the gap to the engine's policy (Prime-RL's loss): per token
    ``coef (lp - lp_roll)^2``, in float32 (float64 for float64 inputs); its gradient
    ``2 coef (lp - lp_roll) grad lp`` pulls the trainer's log-prob toward the sampler's."""
    check_same_shape(lp=lp, lp_roll=lp_roll)
    dtype = compute_dtype(lp, lp_roll)
    return coef * (lp.to(dtype) - lp_roll.to(dtype)).square()


def _ppo(lp, lp_old, adv, keep, a, log_scale):
    return ppo_clip_loss(lp, lp_old, adv, keep, a.clip_low, a.clip_high, a.dual_clip_c,
                         log_scale=log_scale)


def _gspo(lp, lp_old, adv, keep, a, log_scale):
    return gspo_loss(lp, lp_old, adv, keep, a.clip_low, a.clip_high, log_scale=log_scale)


def _gmpo(lp, lp_old, adv, keep, a, log_scale):
    return gmpo_loss(lp, lp_old, adv, keep, a.clip_low, a.clip_high, log_scale=log_scale)


# DPPO's trust region by divergence where algorithm.dppo leaves it null (the authors' recipe)
DPPO_DEFAULT_DELTA = {"dppo_tv": 0.15, "dppo_kl": 0.05}


def _dppo(divergence: str):
    """DPPO with ``divergence``; its trust region (``algorithm.dppo``) defaults per divergence.
    It takes no router-shift scale (the configuration refuses the pair)."""
    def loss(lp, lp_old, adv, keep, a, log_scale):
        d, default = a.dppo, DPPO_DEFAULT_DELTA[f"dppo_{divergence}"]
        return dppo_loss(lp, lp_old, adv, keep, divergence,
                         default if d.delta_low is None else d.delta_low,
                         default if d.delta_high is None else d.delta_high, d.ratio_cap)
    return loss


def _cispo(lp, lp_old, adv, keep, a, log_scale):
    return cispo_loss(lp, lp_old, adv, keep, a.cispo.eps_low, a.cispo.eps_high)


def _sapo(lp, lp_old, adv, keep, a, log_scale):
    return sapo_loss(lp, lp_old, adv, keep, a.sapo.tau_pos, a.sapo.tau_neg)


# algorithm.loss's choices: (lp, lp_old, advantages, keep, AlgorithmConfig, log-ratio scale or
# None) -> (per-token loss, metrics); the router-shift scale only for ppo, gspo and gmpo (the
# configuration refuses the others)
POLICY_LOSSES = {"ppo": _ppo, "gspo": _gspo, "gmpo": _gmpo, "dppo_tv": _dppo("tv"),
                 "dppo_kl": _dppo("kl"), "cispo": _cispo, "sapo": _sapo}


def _token_covariance(lp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
                      ) -> torch.Tensor:
    """``c_t = (lp - mean lp)(A - mean A)`` over the masked tokens of the batch (detached)."""
    with torch.no_grad():
        adv = broadcast_to_tokens(advantages.to(lp.dtype), lp)
        lp_c = lp - masked_mean(lp, mask)
        adv_c = adv - masked_mean(adv, mask)
        return lp_c * adv_c


def clip_cov_select(lp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                    ratio: float, cov_low: float, cov_high: float,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Clip-Cov's tokens [B, T] bool: ``max(1, round(ratio * N))`` drawn uniformly (seeded)
    among the masked tokens whose covariance ``c_t`` lies in ``[cov_low, cov_high]`` (none when
    that band is empty). Call it on the whole (mini-)batch, not per micro-batch."""
    cov = _token_covariance(lp, advantages, mask)
    valid = mask.to(torch.bool)
    band = valid & (cov >= cov_low) & (cov <= cov_high)
    n_pick = min(max(int(round(ratio * int(valid.sum()))), 1), int(band.sum()))
    chosen = torch.zeros_like(valid)
    if n_pick > 0:
        idx = band.flatten().nonzero().squeeze(1)
        perm = torch.randperm(idx.numel(), generator=generator)[:n_pick]
        chosen.view(-1)[idx[perm]] = True
    return chosen


def clip_cov(lp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, ratio: float,
             cov_low: float, cov_high: float, generator: torch.Generator | None = None,
             chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov: ``lp`` with the selected tokens detached (no gradient through them) and the
    metric ``clip_cov/frac`` (fraction of masked tokens detached). ``chosen``: a selection made
    on the whole batch by :func:`clip_cov_select` (default: select here)."""
    valid = mask.to(torch.bool)
    if chosen is None:
        chosen = clip_cov_select(lp, advantages, mask, ratio=ratio, cov_low=cov_low,
                                 cov_high=cov_high, generator=generator)
    chosen = chosen & valid
    out = torch.where(chosen, lp.detach(), lp)
    return out, {"clip_cov/frac": float(chosen.sum()) / max(int(valid.sum()), 1)}


def kl_cov_select(lp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                  ratio: float) -> torch.Tensor:
    """KL-Cov's tokens [B, T] bool: the top ``max(1, round(ratio * N))`` masked tokens by
    covariance ``c_t`` (none without masked tokens). Call it on the whole (mini-)batch."""
    cov = _token_covariance(lp, advantages, mask)
    valid = mask.to(torch.bool)
    n_valid = int(valid.sum())
    k = min(max(int(round(ratio * n_valid)), 1), n_valid)
    chosen = torch.zeros_like(valid)
    if k > 0:
        scores = torch.where(valid, cov, torch.full_like(cov, -torch.inf)).flatten()
        chosen.view(-1)[torch.topk(scores, k).indices] = True
    return chosen


def kl_cov_loss(lp: torch.Tensor, lp_old: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, ratio: float, coef: float,
                chosen: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al., 2025): the UNCLIPPED surrogate ``-A r`` on every token, plus
    ``coef * |lp - lp_old|`` on the selected tokens (``chosen`` from :func:`kl_cov_select` on
    the whole batch; default: select here). Replaces the PPO-clip loss; float32 or better,
    ``log r`` clamped to +-20 before the exp."""
    dtype = compute_dtype(lp, lp_old, advantages)
    lp, lp_old = lp.to(dtype), lp_old.to(dtype)
    valid = mask.to(torch.bool)
    if chosen is None:
        chosen = kl_cov_select(lp, advantages, mask, ratio=ratio)
    chosen = chosen & valid
    adv = broadcast_to_tokens(advantages.to(dtype), lp)
    surrogate = -torch.exp((lp - lp_old).clamp(-EXP_CLAMP, EXP_CLAMP)) * adv
    penalty = torch.where(chosen, coef * (lp - lp_old).abs(), torch.zeros_like(lp))
    return surrogate + penalty, {"kl_cov/frac": float(chosen.sum()) / max(int(valid.sum()), 1)}
