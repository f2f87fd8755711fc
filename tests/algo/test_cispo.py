"""CISPO (MiniMax-M1, arXiv 2506.13585): the clipped, detached importance weight against a float64
reference written here (value and gradient), hand-worked tokens at the bounds (a clipped token
keeps its gradient, unlike PPO's), the paper's missing floor, and the configuration's refusals."""
from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import cispo_loss, ppo_clip_loss
from moe_rl.config import ConfigError, load_config
from tests.helpers import token_draw


def reference(lp, lp_old, adv, eps_low, eps_high):
    """Per token, in plain float64 Python: (loss value, d loss / d lp, clipped)."""
    out = []
    for x, x_old, a in zip(lp, lp_old, adv):
        r = math.exp(max(-20.0, min(20.0, x - x_old)))
        w = min(r, 1 + eps_high)
        if eps_low is not None:
            w = max(w, 1 - eps_low)
        out.append((-a * w, -a * w, w != r))
    return out


@pytest.mark.parametrize("eps_low", [None, 0.2])
def test_cispo_matches_the_float64_reference_value_and_gradient(eps_low):
    lp, lp_old, adv = token_draw(5, 0.5)
    loss, m = cispo_loss(lp[None], lp_old[None], adv[None], torch.ones(1, 64, dtype=torch.bool),
                         eps_low, 0.28)
    loss.sum().backward()
    ref = reference(lp.tolist(), lp_old.tolist(), adv.tolist(), eps_low, 0.28)
    assert loss[0].tolist() == pytest.approx([v for v, _, _ in ref], rel=1e-12, abs=1e-12)
    assert lp.grad.tolist() == pytest.approx([d for _, d, _ in ref], rel=1e-12, abs=1e-12)
    clipped = sum(c for _, _, c in ref)
    assert 0 < clipped < 64
    assert m["clip_frac"] == pytest.approx(clipped / 64)
    assert m["cispo/weight_mean"] == pytest.approx(sum(-v / a for (v, _, _), a in
                                                       zip(ref, adv.tolist())) / 64)


def test_cispo_hand_worked_a_clipped_token_still_learns():
    """q = 0.1, eps_high 0.28, no floor. Ratio 3 (A > 0): weight 1.28, gradient -1.28 (PPO-clip
    gives none there); ratio 0.5 (A < 0): weight 0.5 (no floor), gradient +0.5; ratio 1.1
    (A = -2): weight 1.1, gradient 2.2. A floor of 0.2 lifts the 0.5 to 0.8."""
    lp_old = torch.full((3,), math.log(0.1), dtype=torch.float64)
    lp = (lp_old + torch.tensor([3.0, 0.5, 1.1], dtype=torch.float64).log()).requires_grad_()
    adv = torch.tensor([1.0, -1.0, -2.0], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = cispo_loss(lp[None], lp_old[None], adv[None], mask, None, 0.28)
    loss.sum().backward()
    assert lp.grad.tolist() == pytest.approx([-1.28, 0.5, 2.2], rel=1e-12)
    assert m["clip_frac"] == pytest.approx(1 / 3)
    lp.grad = None
    ppo, _ = ppo_clip_loss(lp[None], lp_old[None], adv[None], mask, 0.2, 0.28)
    ppo.sum().backward()
    assert lp.grad[0].item() == 0.0   # the same token gets nothing from PPO-clip
    floor, m = cispo_loss(lp.detach()[None], lp_old[None], adv[None], mask, 0.2, 0.28)
    assert floor[0].tolist() == pytest.approx([-1.28, 0.8, 2.2], rel=1e-12)
    assert m["clip_frac"] == pytest.approx(2 / 3)


def test_cispo_configuration_and_refusals():
    a = load_config(None, ["algorithm.loss=cispo"]).algorithm
    assert a.cispo.eps_low is None and a.cispo.eps_high == 0.28
    with pytest.raises(ConfigError, match="algorithm.cispo.eps_low"):
        load_config(None, ["algorithm.loss=cispo", "algorithm.cispo.eps_low=1.0"])
    with pytest.raises(ConfigError, match="algorithm.cispo.eps_high"):
        load_config(None, ["algorithm.loss=cispo", "algorithm.cispo.eps_high=0"])
    with pytest.raises(ConfigError, match="algorithm.router_shift.enabled"):
        load_config(None, ["algorithm.loss=cispo", "algorithm.router_shift.enabled=true"])
    with pytest.raises(ConfigError, match="kl_cov"):
        load_config(None, ["algorithm.loss=cispo", "algorithm.entropy_control.method=kl_cov"])
