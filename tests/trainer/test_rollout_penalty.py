"""The penalty on the gap to the engine's policy (algorithm.rollout_penalty.coef, Prime-RL's
loss) in the trainer's policy loss, against an independent float64 formula: value, gradient and
its metric, with any loss; off by default."""
import pytest
import torch

from moe_rl.algo import Normalisers
from moe_rl.config import load_config
from moe_rl.trainer.loss import LossInputs, PolicyLoss


def _call(overrides, lp, lp_old, lp_roll, adv, mask):
    a = load_config(None, overrides).algorithm
    x = LossInputs(lp_old=lp_old, lp_roll=lp_roll, lp_ref=None, advantages=adv, mask=mask,
                   keep=mask.clone(), weights=torch.ones_like(lp_old), chosen=None)
    return PolicyLoss(a)(lp, torch.zeros_like(lp), x, Normalisers(num_tokens=5.0, num_seqs=2.0))


@pytest.mark.parametrize("loss", ["ppo", "cispo", "sapo"])
def test_the_penalty_adds_tau_times_the_squared_gap_and_its_gradient(loss):
    g = torch.Generator().manual_seed(2)
    lp_old = -torch.rand(2, 3, generator=g) - 0.5
    lp_roll = lp_old + 0.2 * torch.randn(2, 3, generator=g)
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    lp = lp_old.clone().requires_grad_(True)
    base, base_sums = _call([f"algorithm.loss={loss}"], lp, lp_old, lp_roll, adv, mask)
    base.backward()
    base_grad = lp.grad.clone()
    lp.grad = None
    with_pen, sums = _call([f"algorithm.loss={loss}", "algorithm.rollout_penalty.coef=0.3"],
                           lp, lp_old, lp_roll, adv, mask)
    with_pen.backward()
    gap = lp.detach().double() - lp_roll.double()
    want = 0.3 * (gap.square() * mask).sum() / 5.0   # token-mean over the step's 5 tokens
    assert float(with_pen.detach() - base.detach()) == pytest.approx(float(want), abs=1e-6)
    want_grad = 0.3 * 2 * gap * mask / 5.0
    assert torch.allclose((lp.grad - base_grad).double(), want_grad, atol=1e-6)
    assert sums["rollout_penalty/sq_gap_mean"] == pytest.approx(
        float((gap.square() * mask).sum()), rel=1e-6)
    assert "rollout_penalty/sq_gap_mean" not in base_sums   # off by default


def test_the_penalty_refuses_a_negative_coefficient():
    from moe_rl.config import ConfigError
    with pytest.raises(ConfigError, match="algorithm.rollout_penalty.coef"):
        load_config(None, ["algorithm.rollout_penalty.coef=-1e-3"])
