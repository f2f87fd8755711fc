"""Algorithm fidelity against float64 references: the off-policy-corrected KL's gradient, dtype
discipline, clamps only before exp, NaN safety, edge rules and the loss denominator."""
import math

import pytest
import torch

from moe_rl.algo import (CorrectionInputs, Normalisers, aggregate, apply_corrections, clip_cov,
                         collapse_guard, gspo_loss, kl_cov_loss, kl_estimate, ppo_clip_loss)
from moe_rl.config import ConfigError, CorrectionParams, load_config
from moe_rl_kernels.logprob import logprob_entropy
from tests.helpers import kernel_on_logits


def _exact_kl_gradients(corrected: bool):
    """Expectation over y ~ pi_old (7-token vocabulary, exact sum) of the per-token k3 estimate;
    returns its gradient and those of KL(pi_theta||pi_ref) and KL(pi_ref||pi_theta)."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(7, generator=g, dtype=torch.float64).requires_grad_()
    lp_old = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    lp_ref = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(theta, -1)
    est = (lp_old.exp() * kl_estimate(lp, lp_ref, "k3", lp_old=lp_old,
                                      off_policy_corrected=corrected)).sum()
    (g_est,) = torch.autograd.grad(est, theta)
    lp = torch.log_softmax(theta, -1)
    forward = (lp.exp() * (lp - lp_ref)).sum()
    (g_fwd,) = torch.autograd.grad(forward, theta)
    reverse = (lp_ref.exp() * (lp_ref - torch.log_softmax(theta, -1))).sum()
    (g_rev,) = torch.autograd.grad(reverse, theta)
    return est, forward, g_est, g_fwd, g_rev


def test_off_policy_corrected_k3_has_the_forward_kl_gradient():
    # without the correction the estimate is biased in gradient too
    _, _, g_detached, _, g_reverse = _exact_kl_gradients(corrected=False)
    est, forward, g_est, g_fwd, g_rev = _exact_kl_gradients(corrected=True)
    assert not torch.allclose(g_detached, g_fwd, atol=1e-3)
    assert float(est) == pytest.approx(float(forward), abs=1e-12)   # unbiased value
    assert torch.allclose(g_est, g_fwd, atol=1e-12)                  # and gradient
    assert (g_fwd - g_rev).abs().max() > 0.05                        # the two KLs differ here


def test_k3_estimators_compute_in_float32_and_never_go_negative():
    lp = torch.zeros(1, 4, dtype=torch.bfloat16)
    lp_ref = torch.full((1, 4), -2.0 ** -9, dtype=torch.bfloat16)
    k3 = kl_estimate(lp, lp_ref, "k3")
    assert k3.dtype == torch.float32
    d = -2.0 ** -9
    assert float(k3[0, 0]) == pytest.approx(math.expm1(d) - d, rel=1e-3)   # bf16 arithmetic: 0
    tiny = torch.tensor([[1e-9, -1e-9, 3e-8]], dtype=torch.float64)
    assert (kl_estimate(torch.zeros_like(tiny), tiny, "k3") >= 0).all()


def test_gspo_clips_a_bf16_sequence_ratio_as_float32_sees_it():
    # ratio exp(2^-9) = 1.001955 > 1 + 4e-4: clipped, so a positive advantage gets no gradient;
    # computed in bfloat16 the ratio rounds to 1.0 and the token would get -A/T each
    lp = torch.zeros(1, 4, dtype=torch.bfloat16, requires_grad=True)
    lp_old = torch.full((1, 4), -2.0 ** -9, dtype=torch.bfloat16)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, m = gspo_loss(lp, lp_old, torch.tensor([1.0]), mask, 3e-4, 4e-4)
    aggregate(loss, mask, "seq-mean-token-mean", Normalisers(4, 1)).backward()
    assert loss.dtype == torch.float32 and m["clip_frac"] == 1.0
    assert float(lp.grad.abs().max()) == 0.0


def test_clamps_only_guard_an_exp():
    lp = torch.zeros(1, 2, dtype=torch.float64)
    lp_ref = torch.tensor([[-30.0, 25.0]], dtype=torch.float64)
    # k1 and k2 are not clamped (the audit found their values cut at 20 nats)
    assert kl_estimate(lp, lp_ref, "k1").tolist() == [[30.0, -25.0]]
    assert kl_estimate(lp, lp_ref, "k2").tolist() == [[450.0, 312.5]]
    # k3's value is capped at 10 (as verl)
    assert kl_estimate(lp, lp_ref, "k3").tolist() == [[10.0, 10.0]]
    # PPO: a log-ratio of 100 in float32 gives a finite gradient (exp overflowed to inf before)
    p = torch.tensor([[100.0, 0.5]], requires_grad=True)
    loss, _ = ppo_clip_loss(p, torch.zeros(1, 2), torch.tensor([-1.0]),
                            torch.ones(1, 2, dtype=torch.bool), 0.2, 0.28, None)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(p.grad).all()


def test_gspo_sequence_log_ratio_is_capped_at_ten():
    lp = torch.full((1, 3), 12.0, dtype=torch.float64, requires_grad=True)
    loss, m = gspo_loss(lp, torch.zeros(1, 3, dtype=torch.float64), torch.tensor([-1.0]),
                        torch.ones(1, 3, dtype=torch.bool), 0.2, 0.2)
    assert m["gspo/seq_ratio_mean"] == pytest.approx(math.exp(10.0))
    loss.sum().backward()
    assert float(lp.grad.abs().max()) == 0.0   # no gradient beyond the cap


def test_nan_at_masked_positions_never_reaches_a_result():
    lp = torch.tensor([[-0.5, float("nan")], [-0.2, -0.1]], dtype=torch.float64)
    lp_old = torch.tensor([[-0.4, float("inf")], [-0.3, -0.2]], dtype=torch.float64)
    mask = torch.tensor([[True, False], [True, True]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = gspo_loss(lp, lp_old, adv, mask, 0.2, 0.2)
    out = aggregate(loss, mask, "seq-mean-token-mean", Normalisers(3, 2))
    assert math.isfinite(float(out))
    loss, _ = ppo_clip_loss(lp, lp_old, adv, mask, 0.2, 0.2, 3.0)
    assert math.isfinite(float(aggregate(loss, mask, "token-mean", Normalisers(3, 2))))
    # a kept token of vanishing probability (logit -1e30): finite entropy, it adds nothing
    logits = torch.tensor([[1.0, -1e30, 0.5, 0.0]], dtype=torch.float64)
    lp_k, ent = kernel_on_logits(logits, torch.tensor([0]), torch.tensor([0, 3]),
                                 torch.tensor([0, 1, 2]))
    p = torch.softmax(torch.tensor([1.0, 0.5], dtype=torch.float64), -1)
    assert float(ent) == pytest.approx(float(-(p * p.log()).sum()))
    assert float(lp_k) == pytest.approx(float(p[0].log()))
    # a non-finite statistic makes the guard skip, even with the guard off
    assert collapse_guard({"mismatch/k3": float("nan")}, None)
    assert collapse_guard({"mismatch/k3": float("inf")}, 0.1)
    assert not collapse_guard({"mismatch/k3": 0.01}, 0.1)
    # non-finite log-probs on valid positions are refused with the field named
    with pytest.raises(ValueError, match="lp_roll: non-finite"):
        CorrectionInputs(lp_old=torch.zeros(1, 2), lp_roll=torch.tensor([[0.0, float("nan")]]),
                         mask=torch.ones(1, 2, dtype=torch.bool))
    ok = CorrectionInputs(lp_old=torch.zeros(1, 2), lp_roll=torch.tensor([[0.0, float("nan")]]),
                          mask=torch.tensor([[True, False]]))
    res = apply_corrections(["token_tis", "seq_mis"], CorrectionParams(), ok)
    assert torch.isfinite(res.weights).all()


def test_kept_ids_out_of_range_or_repeated_are_refused():
    logits = torch.randn(2, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="row 1 lists id 3 twice"):
        kernel_on_logits(logits, torch.tensor([0, 3]), torch.tensor([0, 2, 4]),
                         torch.tensor([0, 1, 3, 3]))
    h, w = torch.randn(2, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"kept_ids: expected ids in \[0, 5\)"):
        logprob_entropy(h, w, torch.tensor([0, 1]), kept_offsets=torch.tensor([0, 2, 4]),
                        kept_ids=torch.tensor([0, 1, 1, 9]))
    with pytest.raises(ValueError, match="twice"):
        logprob_entropy(h, w, torch.tensor([0, 1]), kept_offsets=torch.tensor([0, 2, 4]),
                        kept_ids=torch.tensor([0, 0, 1, 2]))


def test_gspo_needs_seq_mean_token_mean_and_kl_cov_needs_ppo():
    with pytest.raises(ConfigError, match="algorithm.aggregation: GSPO"):
        load_config(None, ["algorithm.loss=gspo", "algorithm.clip_low=3e-4",
                           "algorithm.clip_high=4e-4", "algorithm.aggregation=token-mean"])
    with pytest.raises(ConfigError, match="kl_cov replaces"):
        load_config(None, ["algorithm.loss=gspo", "algorithm.clip_low=3e-4",
                           "algorithm.clip_high=4e-4", "algorithm.aggregation=seq-mean-token-mean",
                           "algorithm.entropy_control.method=kl_cov"])


def test_clip_cov_selects_at_least_one_token_of_a_non_empty_band():
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(4, 5, generator=g, dtype=torch.float64).requires_grad_()
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.bool)
    out, m = clip_cov(lp, adv, mask, ratio=2e-4, cov_low=-100.0, cov_high=100.0, generator=g)
    assert m["clip_cov/frac"] == pytest.approx(1 / 20)   # round(2e-4 * 20) = 0 before


def test_kl_cov_uses_the_unclipped_surrogate():
    lp = torch.tensor([[0.5, -0.1, 0.2]], dtype=torch.float64, requires_grad=True)
    lp_old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([2.0], dtype=torch.float64)
    loss, m = kl_cov_loss(lp, lp_old, adv, torch.ones(1, 3, dtype=torch.bool), ratio=0.34,
                          coef=1.0)
    # top covariance token: lp = 0.5 (adv constant: covariance 0 everywhere -> topk picks one)
    surrogate = [-2.0 * math.exp(v) for v in (0.5, -0.1, 0.2)]
    chosen = [float(loss[0, t]) - surrogate[t] for t in range(3)]
    assert sorted(chosen)[:2] == pytest.approx([0.0, 0.0])
    assert max(chosen) == pytest.approx(abs([0.5, -0.1, 0.2][chosen.index(max(chosen))]))
    # ratio exp(0.5) = 1.65 > 1.28: PPO-clip would be flat here, KL-Cov is not
    assert float(loss[0, 0]) != pytest.approx(-2.0 * 1.28)


def test_loss_denominator_original_keeps_masked_tokens_in_the_count():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    keep = torch.tensor([[True, True, False, False]])
    kept = aggregate(loss, keep, "seq-mean-token-mean", Normalisers(2, 1))
    original = aggregate(loss, keep, "seq-mean-token-mean", Normalisers(4, 1), count_mask=mask)
    assert float(kept) == pytest.approx(1.5) and float(original) == pytest.approx(0.75)
    cfg = load_config(None, [])
    assert cfg.algorithm.loss_denominator == "original"
