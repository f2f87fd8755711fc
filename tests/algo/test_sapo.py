"""SAPO (Gao et al., 2025, arXiv 2511.20347): the temperature-controlled soft gate against a
float64 reference written here (value and gradient), hand-worked tokens (the policy gradient on
policy, a fading gradient off it, faster for negative advantages) and the refusals."""
from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import sapo_loss
from moe_rl.config import ConfigError, load_config
from tests.helpers import token_draw


def reference(lp, lp_old, adv, tau_pos, tau_neg):
    """Per token, in plain float64 Python: (loss value, d loss / d lp, gate weight)."""
    out = []
    for x, x_old, a in zip(lp, lp_old, adv):
        r = math.exp(max(-20.0, min(20.0, x - x_old)))
        tau = tau_pos if a > 0 else tau_neg
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        out.append((-a * 4 / tau * s, -a * 4 * s * (1 - s) * r, 4 * s * (1 - s)))
    return out


def test_sapo_matches_the_float64_reference_value_and_gradient():
    lp, lp_old, adv = token_draw(7, 0.7)
    loss, m = sapo_loss(lp[None], lp_old[None], adv[None], torch.ones(1, 64, dtype=torch.bool),
                        0.5, 2.0)
    loss.sum().backward()
    ref = reference(lp.tolist(), lp_old.tolist(), adv.tolist(), 0.5, 2.0)
    assert loss[0].tolist() == pytest.approx([v for v, _, _ in ref], rel=1e-12, abs=1e-12)
    assert lp.grad.tolist() == pytest.approx([d for _, d, _ in ref], rel=1e-12, abs=1e-12)
    assert m["sapo/gate_mean"] == pytest.approx(sum(w for _, _, w in ref) / 64, rel=1e-12)


def test_sapo_hand_worked_on_and_off_policy():
    """On policy (r = 1) the gate's weight is 4 s (1 - s) = 1 at s = 1/2: the gradient is the
    policy gradient -A, whatever tau, and the value -A 2 / tau. At r = 3 with tau = 1: s =
    sigmoid(2), weight 4 s (1 - s) = 0.41997..., gradient -A 3 times that; with tau 1.05 for
    A < 0 the same ratio's weight is lower (negative updates fade faster)."""
    lp_old = torch.full((4,), math.log(0.1), dtype=torch.float64)
    r = torch.tensor([1.0, 1.0, 3.0, 3.0], dtype=torch.float64)
    lp = (lp_old + r.log()).requires_grad_()
    adv = torch.tensor([2.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    loss, _ = sapo_loss(lp[None], lp_old[None], adv[None], torch.ones(1, 4, dtype=torch.bool),
                        1.0, 1.05)
    loss.sum().backward()
    assert loss[0, :2].tolist() == pytest.approx([-4.0, 2 / 1.05], rel=1e-12)
    assert lp.grad[:2].tolist() == pytest.approx([-2.0, 1.0], rel=1e-12)
    s1 = 1 / (1 + math.exp(-2.0))
    s2 = 1 / (1 + math.exp(-2.1))
    assert lp.grad[2].item() == pytest.approx(-3 * 4 * s1 * (1 - s1), rel=1e-12)
    assert lp.grad[3].item() == pytest.approx(3 * 4 * s2 * (1 - s2), rel=1e-12)
    assert abs(lp.grad[3].item()) < abs(lp.grad[2].item())


def test_sapo_configuration_and_refusals():
    a = load_config(None, ["algorithm.loss=sapo"]).algorithm
    assert (a.sapo.tau_pos, a.sapo.tau_neg) == (1.0, 1.05)
    with pytest.raises(ConfigError, match="algorithm.sapo.tau_neg"):
        load_config(None, ["algorithm.loss=sapo", "algorithm.sapo.tau_neg=0"])
    with pytest.raises(ConfigError, match="algorithm.router_shift.enabled"):
        load_config(None, ["algorithm.loss=sapo", "algorithm.router_shift.enabled=true"])
