"""The policy-loss object (trainer/loss.py) against independent float64 formulas, without
megatron: PPO-clip + k3 KL + entropy bonus, token-mean over the step's global count; IcePop in
bypass mode removing the tokens outside its band; its gradient."""
import torch

from moe_rl.algo import Normalisers
from moe_rl.config import load_config
from moe_rl.trainer.loss import LossInputs, PolicyLoss


def _inputs(lp_old, lp_roll, lp_ref, adv, mask):
    return LossInputs(lp_old=lp_old, lp_roll=lp_roll, lp_ref=lp_ref, advantages=adv, mask=mask,
                      keep=mask.clone(), weights=torch.ones_like(lp_old), chosen=None)


def test_ppo_kl_entropy_token_mean_by_hand():
    a = load_config(None, ["algorithm.loss=ppo", "algorithm.clip_low=0.2",
                           "algorithm.clip_high=0.2", "algorithm.dual_clip_c=null",
                           "algorithm.kl.coef=0.1", "algorithm.entropy_coef=0.01"]).algorithm
    g = torch.Generator().manual_seed(0)
    lp_old = -torch.rand(2, 3, generator=g) - 0.5
    lp = (lp_old + 0.3 * torch.randn(2, 3, generator=g)).requires_grad_(True)
    lp_ref = lp_old - 0.1
    ent = torch.rand(2, 3, generator=g)
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, sums = PolicyLoss(a)(lp, ent, _inputs(lp_old, lp_old, lp_ref, adv, mask),
                               Normalisers(num_tokens=10.0, num_seqs=4.0), first=True)
    # independent float64 reference
    x, o, r = lp.detach().double(), lp_old.double(), lp_ref.double()
    ratio = (x - o).exp()
    A = adv.double()[:, None]
    surrogate = -torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A)
    k3 = (r - x).exp() - (r - x) - 1
    want = ((surrogate + 0.1 * k3 - 0.01 * ent.double()) * mask).sum() / 10.0
    assert abs(float(loss.detach()) - float(want)) < 1e-6
    assert sums["_tokens"] == 5.0 and abs(sums["loss"] - float(want)) < 1e-6
    assert abs(sums["kl/ref"] - float((k3 * mask).sum())) < 1e-5
    assert abs(sums["_first_dev"] - float((ratio - 1).abs()[mask].max())) < 1e-6
    # gradient of the same expression
    loss.backward()
    xg = lp.detach().double().requires_grad_(True)
    ratio = (xg - o).exp()
    k3 = (r - xg).exp() - (r - xg) - 1
    ref = ((-torch.minimum(ratio * A, ratio.clamp(0.8, 1.2) * A) + 0.1 * k3) * mask).sum() / 10.0
    ref.backward()
    assert torch.allclose(lp.grad.double(), xg.grad, atol=1e-6)


def test_icepop_in_bypass_mode_removes_tokens_outside_its_band():
    a = load_config(None, ["algorithm.pi_old=rollout", "algorithm.corrections=[icepop]",
                           "algorithm.correction.icepop_low=0.5",
                           "algorithm.correction.icepop_high=2.0"]).algorithm
    lp_roll = torch.full((1, 4), -1.0)
    lp = torch.tensor([[-1.0, -1.0 + 1.0, -1.0 - 1.0, -1.0 + 0.2]])   # ratios 1, e, 1/e, e^0.2
    mask = torch.ones(1, 4, dtype=torch.bool)
    policy = PolicyLoss(a)
    assert policy.live == ["icepop"]
    _, sums = policy(lp, torch.zeros(1, 4), _inputs(lp_roll, lp_roll, None, torch.ones(1), mask),
                     Normalisers(num_tokens=4.0, num_seqs=1.0))
    assert sums["_tokens"] == 2.0 and sums["_live_tokens"] == 4.0
