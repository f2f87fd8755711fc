"""Advantages, policy losses, aggregation and KL against float64 references written here."""
import math

import pytest
import torch

from moe_rl.algo import (Normalisers, aggregate, clip_cov, compute_advantages, count_normalisers,
                         gspo_loss, kl_cov_loss, kl_estimate, kl_reward_penalty, ppo_clip_loss)

torch.manual_seed(0)


def _batch(B=4, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp_old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    for i in range(B):
        mask[i, T - i:] = False  # ragged lengths T, T-1, ...
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return lp, lp_old, mask, adv


# ---------------------------------------------------------------- advantages

def test_advantages_against_reference():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 1.0, 7.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 5, 5, 5, 9])
    got = {m: compute_advantages(rewards, groups, m, eps=1e-6) for m in ("grpo", "drgrpo", "rloo")}
    for i in range(len(rewards)):
        same = [j for j in range(len(rewards)) if groups[j] == groups[i]]
        vals = [float(rewards[j]) for j in same]
        if len(same) == 1:
            for m in got:
                assert got[m][i] == 0
            continue
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        assert got["grpo"][i] == pytest.approx((float(rewards[i]) - mean) / (std + 1e-6), rel=1e-12)
        assert got["drgrpo"][i] == pytest.approx(float(rewards[i]) - mean, rel=1e-12)
        others = [float(rewards[j]) for j in same if j != i]
        assert got["rloo"][i] == pytest.approx(float(rewards[i]) - sum(others) / len(others))


def test_advantages_errors():
    with pytest.raises(ValueError, match="advantage method"):
        compute_advantages(torch.zeros(2), torch.zeros(2), "ppo")
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(torch.tensor([0.0, float("nan")]), torch.zeros(2))


# ---------------------------------------------------------------- PPO clip

def _ppo_reference(lp, lp_old, adv, eps_lo, eps_hi, c):
    out = torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            r = math.exp(float(lp[i, t] - lp_old[i, t]))
            a = float(adv[i])
            l = -min(r * a, min(max(r, 1 - eps_lo), 1 + eps_hi) * a)
            if c is not None and a < 0:
                l = min(l, c * abs(a))
            out[i, t] = l
    return out


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_clip_matches_reference(dual):
    lp, lp_old, mask, adv = _batch()
    lp_old = lp_old.clone()
    lp_old[0, 0] = lp[0, 0] - 2.0   # ratio e^2: clipped for A>0, dual-clipped for A<0
    loss, metrics = ppo_clip_loss(lp, lp_old, adv, mask, 0.2, 0.28, dual)
    ref = _ppo_reference(lp, lp_old, adv, 0.2, 0.28, dual)
    assert torch.allclose(loss, ref, atol=1e-12)
    assert 0 <= metrics["clip_frac"] <= 1


def test_ppo_hand_worked_clip_higher_and_dual_clip():
    lp = torch.log(torch.tensor([[1.5, 0.5, 5.0]], dtype=torch.float64))
    lp_old = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    pos, _ = ppo_clip_loss(lp, lp_old, torch.tensor([1.0], dtype=torch.float64), mask, 0.2, 0.28)
    assert pos.tolist()[0] == pytest.approx([-1.28, -0.5, -1.28])
    neg, m = ppo_clip_loss(lp, lp_old, torch.tensor([-1.0], dtype=torch.float64), mask, 0.2, 0.28,
                           3.0)
    # r=1.5: max(1.5, 1.28)=1.5; r=0.5: max(0.5, 0.8)=0.8; r=5: capped at c|A| = 3
    assert neg.tolist()[0] == pytest.approx([1.5, 0.8, 3.0])
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)


def test_ppo_gradient_is_zero_where_clipped():
    lp = torch.log(torch.tensor([[2.0, 1.1]], dtype=torch.float64)).requires_grad_()
    loss, _ = ppo_clip_loss(lp, torch.zeros(1, 2, dtype=torch.float64),
                            torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), 0.2, 0.28)
    loss.sum().backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == pytest.approx(-1.1)


# ---------------------------------------------------------------- GSPO

def test_gspo_value_matches_sequence_objective():
    lp, lp_old, mask, adv = _batch()
    loss, _ = gspo_loss(lp, lp_old, adv, mask, 3e-4, 4e-4)
    for i in range(lp.shape[0]):
        n = int(mask[i].sum())
        s = math.exp(sum(float(lp[i, t] - lp_old[i, t]) for t in range(n)) / n)
        ref = -min(s * float(adv[i]), min(max(s, 1 - 3e-4), 1 + 4e-4) * float(adv[i]))
        for t in range(n):
            assert float(loss[i, t]) == pytest.approx(ref, rel=1e-12)


def test_gspo_token_form_gradient_equals_sequence_gradient():
    lp0, lp_old, mask, adv = _batch(seed=3)
    lp_old = lp0 + 1e-5 * torch.randn_like(lp0)   # inside the clip range: a non-zero gradient
    eps_lo, eps_hi = 0.2, 0.3

    def token_form(lp):
        loss, _ = gspo_loss(lp, lp_old, adv, mask, eps_lo, eps_hi)
        return aggregate(loss, mask, "seq-mean-token-mean", count_normalisers(mask))

    def sequence_form(lp):
        m = mask.double()
        s = torch.exp(((lp - lp_old) * m).sum(-1) / m.sum(-1))
        obj = torch.minimum(s * adv, s.clamp(1 - eps_lo, 1 + eps_hi) * adv)
        return -obj.mean()

    a = lp0.clone().requires_grad_()
    b = lp0.clone().requires_grad_()
    token_form(a).backward()
    sequence_form(b).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-12)
    assert a.grad.abs().sum() > 0
    # and float64 gradcheck of the token form itself
    assert torch.autograd.gradcheck(token_form, (lp0.clone().requires_grad_(),))


def test_gspo_rejects_token_advantages():
    lp, lp_old, mask, adv = _batch()
    with pytest.raises(ValueError, match="advantages"):
        gspo_loss(lp, lp_old, adv[:, None].expand_as(lp), mask, 0.1, 0.1)


# ---------------------------------------------------------------- aggregation

@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_aggregation_reference(mode):
    lp, _, mask, _ = _batch(B=5, T=7)
    loss = lp ** 2
    got = aggregate(loss, mask, mode, count_normalisers(mask, max_len=10))
    seqs = []
    for i in range(5):
        vals = [float(loss[i, t]) for t in range(7) if mask[i, t]]
        seqs.append(vals)
    if mode == "token-mean":
        ref = sum(sum(v) for v in seqs) / sum(len(v) for v in seqs)
    elif mode == "seq-mean-token-mean":
        ref = sum(sum(v) / len(v) for v in seqs) / 5
    elif mode == "seq-mean-token-sum":
        ref = sum(sum(v) for v in seqs) / 5
    else:
        ref = sum(sum(v) / 10 for v in seqs) / 5
    assert float(got) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("splits", [[8], [2, 2, 2, 2], [1, 4, 3]])
def test_aggregation_invariant_to_micro_batch_split(mode, splits):
    lp, lp_old, mask, adv = _batch(B=8, T=6, seed=7)
    mask[3] = False  # a sequence with no response token
    full_norm = count_normalisers(mask, max_len=6)
    param = lp.clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    start = 0
    for n in splits:
        sl = slice(start, start + n)
        loss, _ = ppo_clip_loss(param[sl], lp_old[sl], adv[sl], mask[sl], 0.2, 0.28)
        part = aggregate(loss, mask[sl], mode, full_norm)
        part.backward()
        total = total + part.detach()
        start += n
    ref_param = lp.clone().requires_grad_()
    loss, _ = ppo_clip_loss(ref_param, lp_old, adv, mask, 0.2, 0.28)
    ref = aggregate(loss, mask, mode, full_norm)
    ref.backward()
    assert float(total) == pytest.approx(float(ref), rel=1e-12)
    assert torch.allclose(param.grad, ref_param.grad, atol=1e-14)


def test_normalisers_add_up_across_parts():
    _, _, mask, _ = _batch(B=6, T=5)
    a, b = count_normalisers(mask[:2]), count_normalisers(mask[2:])
    full = count_normalisers(mask)
    assert a.num_tokens + b.num_tokens == full.num_tokens
    assert a.num_seqs + b.num_seqs == full.num_seqs


def test_aggregation_errors():
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "mean", Normalisers(1, 1))
    with pytest.raises(ValueError, match="max_len"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "seq-mean-token-sum-norm", Normalisers(1, 1))


# ---------------------------------------------------------------- Clip-Cov / KL-Cov

def test_clip_cov_detaches_only_band_tokens_seeded():
    lp, _, mask, adv = _batch(B=6, T=8, seed=11)
    lp = lp.clone().requires_grad_()
    out, m = clip_cov(lp, adv, mask, ratio=0.25, cov_low=-1e9, cov_high=1e9,
                      generator=torch.Generator().manual_seed(0))
    out.sum().backward()
    detached = (lp.grad == 0) & mask
    n_valid = int(mask.sum())
    assert int(detached.sum()) == round(0.25 * n_valid)
    assert m["clip_cov/frac"] == pytest.approx(round(0.25 * n_valid) / n_valid)
    # an empty band detaches nothing
    lp2 = lp.detach().clone().requires_grad_()
    out2, m2 = clip_cov(lp2, adv, mask, ratio=0.5, cov_low=1e8, cov_high=1e9)
    out2.sum().backward()
    assert m2["clip_cov/frac"] == 0 and (lp2.grad[mask] == 1).all()


def test_clip_cov_band_membership_reference():
    lp, _, mask, adv = _batch(B=3, T=4, seed=2)
    vals = [(i, t) for i in range(3) for t in range(4) if mask[i, t]]
    mlp = sum(float(lp[i, t]) for i, t in vals) / len(vals)
    madv = sum(float(adv[i]) for i, t in vals) / len(vals)
    cov = {(i, t): (float(lp[i, t]) - mlp) * (float(adv[i]) - madv) for i, t in vals}
    lo, hi = sorted(cov.values())[2], sorted(cov.values())[5]
    band = {k for k, c in cov.items() if lo <= c <= hi}
    p = lp.clone().requires_grad_()
    out, _ = clip_cov(p, adv, mask, ratio=1.0, cov_low=lo, cov_high=hi)
    out.sum().backward()
    got = {(i, t) for i, t in vals if p.grad[i, t] == 0}
    assert got == band


def test_kl_cov_penalises_top_covariance_tokens():
    lp, lp_old, mask, adv = _batch(B=3, T=4, seed=4)
    loss, m = kl_cov_loss(lp, lp_old, adv, mask, ratio=0.2, coef=2.0)
    surrogate = -torch.exp(lp - lp_old) * adv.to(lp.dtype)[:, None]   # unclipped
    pen = loss - surrogate
    vals = [(i, t) for i in range(3) for t in range(4) if mask[i, t]]
    mlp = sum(float(lp[i, t]) for i, t in vals) / len(vals)
    madv = sum(float(adv[i]) for i, t in vals) / len(vals)
    cov = sorted(vals, key=lambda k: -(float(lp[k]) - mlp) * (float(adv[k[0]]) - madv))
    k = round(0.2 * len(vals))
    for i, t in vals:
        expect = 2.0 * abs(float(lp[i, t] - lp_old[i, t])) if (i, t) in cov[:k] else 0.0
        assert float(pen[i, t]) == pytest.approx(expect)
    assert m["kl_cov/frac"] == pytest.approx(k / len(vals))


# ---------------------------------------------------------------- KL

def test_kl_estimators_reference():
    lp, lp_ref, mask, _ = _batch()
    for est in ("k1", "k2", "k3"):
        got = kl_estimate(lp, lp_ref, est)
        for i in range(lp.shape[0]):
            for t in range(lp.shape[1]):
                d = float(lp_ref[i, t] - lp[i, t])
                ref = {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1}[est]
                assert float(got[i, t]) == pytest.approx(ref, rel=1e-12, abs=1e-15)
    assert (kl_estimate(lp, lp_ref, "k3") >= 0).all()


def test_off_policy_corrected_k3_and_reward_penalty():
    lp, lp_ref, mask, _ = _batch(seed=5)
    lp_old = lp + 0.1
    p = lp.clone().requires_grad_()
    got = kl_estimate(p, lp_ref, "k3", lp_old=lp_old, off_policy_corrected=True)
    d = lp_ref - lp
    ref = torch.exp(lp - lp_old) * (torch.exp(d) - d - 1)
    assert torch.allclose(got, ref, atol=1e-12)
    got.sum().backward()   # the weight carries gradient: d(w k3)/dlp = w (k3 + 1 - e^d) = -w d
    assert torch.allclose(p.grad, -torch.exp(lp - lp_old) * d, atol=1e-12)
    pen = kl_reward_penalty(lp_old, lp_ref, mask, "k1", 0.5)
    for i in range(lp.shape[0]):
        ref_i = 0.5 * sum(float(lp_old[i, t] - lp_ref[i, t]) for t in range(lp.shape[1])
                          if mask[i, t])
        assert float(pen[i]) == pytest.approx(ref_i, rel=1e-12)
    with pytest.raises(ValueError, match="lp_old"):
        kl_estimate(lp, lp_ref, "k3", off_policy_corrected=True)
