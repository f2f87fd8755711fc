"""DPPO (Qi et al., 2026, arXiv 2602.04879; verl's dppo_tv / dppo_kl): the divergence trust
region against float64 references written here, hand-worked cases at the region's edges, the
gradient (the unclipped policy gradient inside, none outside, the ratio cap), and through
`moe-rl train`."""
from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import binary_kl, dppo_loss
from tests.helpers import token_draw


def reference(lp, lp_old, adv, divergence, lo, hi, cap):
    """Per token, in plain float64 Python: (loss value, d loss / d lp, outside)."""
    out = []
    for x, x_old, a in zip(lp, lp_old, adv):
        p, q = math.exp(x), math.exp(x_old)
        r = math.exp(max(-20.0, min(20.0, x - x_old)))
        if divergence == "tv":
            outside = (p - q > hi) if a > 0 else (p - q < -lo)
        else:
            d = q * math.log(q / p) + ((1 - q) * math.log((1 - q) / (1 - p)) if q < 1 else 0.0)
            outside = (p > q and d > hi) if a > 0 else (p < q and d > lo)
        w = min(r, cap) if cap is not None else r
        out.append((0.0 if outside else -a * w, 0.0 if outside else -a * w, outside))
    return out


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_dppo_matches_the_float64_reference_value_and_gradient(divergence, cap):
    lp, lp_old, adv = token_draw(3, 0.6)
    loss, metrics = dppo_loss(lp[None], lp_old[None], adv[None], torch.ones(1, 64, dtype=torch.bool),
                              divergence, 0.1, 0.12, cap)
    loss.sum().backward()
    ref = reference(lp.tolist(), lp_old.tolist(), adv.tolist(), divergence, 0.1, 0.12, cap)
    assert loss[0].tolist() == pytest.approx([v for v, _, _ in ref], rel=1e-12, abs=1e-12)
    assert lp.grad.tolist() == pytest.approx([dv for _, dv, _ in ref], rel=1e-12, abs=1e-12)
    outside = sum(o for _, _, o in ref)
    assert 0 < outside < 64   # the draw exercises both sides
    assert metrics["clip_frac"] == pytest.approx(outside / 64)


def test_dppo_tv_hand_worked_edges():
    """q = 0.5; delta 0.1 both ways. A > 0: p = 0.55 inside, p = 0.65 outside, p = 0.2 (moved
    against the advantage's push) inside. A < 0: p = 0.45 inside, p = 0.35 outside, p = 0.9
    inside. A rare token raised from 1e-5 to 1e-3 (ratio 100, which PPO's clip removes) stays
    inside: its probability barely moved."""
    q = [0.5] * 6 + [1e-5]
    p = [0.55, 0.65, 0.2, 0.45, 0.35, 0.9, 1e-3]
    a = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0]
    lp = torch.tensor(p, dtype=torch.float64).log().requires_grad_()
    lp_old = torch.tensor(q, dtype=torch.float64).log()
    loss, m = dppo_loss(lp[None], lp_old[None], torch.tensor(a, dtype=torch.float64)[None],
                        torch.ones(1, 7, dtype=torch.bool), "tv", 0.1, 0.1)
    loss.sum().backward()
    inside = [True, False, True, True, False, True, True]
    for i in range(7):
        expect = -a[i] * p[i] / q[i] if inside[i] else 0.0
        assert loss[0, i].item() == pytest.approx(expect, rel=1e-12, abs=1e-15), i
        assert lp.grad[i].item() == pytest.approx(expect, rel=1e-12, abs=1e-15), i
    assert m["clip_frac"] == pytest.approx(2 / 7)


def test_binary_kl_hand_worked_and_at_the_ends():
    """KL(B(0.5) || B(0.25)) = 0.5 log 2 + 0.5 log(2/3); q = 1 (log-prob 0) has no tail term;
    p = 1 > q is an infinite divergence; equal probabilities are 0."""
    lp = torch.tensor([math.log(0.25), math.log(0.5), 0.0, math.log(0.3)], dtype=torch.float64)
    lp_old = torch.tensor([math.log(0.5), 0.0, math.log(0.5), math.log(0.3)],
                          dtype=torch.float64)
    kl = binary_kl(lp, lp_old)
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=1e-14)
    assert kl[1].item() == pytest.approx(math.log(2), rel=1e-14)   # q = 1: log(1 / 0.5)
    assert kl[2].item() == math.inf and kl[3].item() == 0.0


def test_dppo_kl_leaves_the_region_only_in_the_advantages_direction():
    """p falls far below q with A > 0 (the update did not push it there): inside, however large
    the divergence; the same move with A < 0: outside."""
    lp = torch.tensor([[math.log(0.05), math.log(0.05)]], dtype=torch.float64)
    lp_old = torch.tensor([[math.log(0.6), math.log(0.6)]], dtype=torch.float64)
    loss, m = dppo_loss(lp, lp_old, torch.tensor([[1.0, -1.0]], dtype=torch.float64),
                        torch.ones(1, 2, dtype=torch.bool), "kl", 0.05, 0.05)
    assert loss[0, 0].item() == pytest.approx(-0.05 / 0.6) and loss[0, 1].item() == 0.0
    assert m["clip_frac"] == 0.5


def test_on_policy_nothing_is_outside_and_the_gradient_is_the_policy_gradient():
    """At pi_theta = pi_old (the first mini-batch) every token is inside, for every advantage and
    both divergences, and the gradient is -A per token."""
    g = torch.Generator().manual_seed(0)
    lp = torch.log(torch.rand(3, 5, generator=g) * 0.9 + 0.05).requires_grad_()
    adv = torch.randn(3, generator=g)
    for divergence in ("tv", "kl"):
        lp.grad = None
        loss, m = dppo_loss(lp, lp.detach(), adv, torch.ones(3, 5, dtype=torch.bool),
                            divergence, 1e-6, 1e-6)
        loss.sum().backward()
        assert m["clip_frac"] == 0.0
        assert torch.allclose(lp.grad, -adv[:, None].expand(3, 5))


def test_dppo_refuses_an_unknown_divergence():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="divergence: expected one of"):
        dppo_loss(x, x, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), "js", 0.1, 0.1)
