"""QAE, quantile advantage estimation (Wu et al., arXiv 2509.22611): the group's k-quantile in
place of GRPO's mean, against a float64 reference written here (order statistics interpolated by
hand), the two-regime gate on 0/1 rewards worked by hand, the share of zero advantages, and the
configuration's refusals."""
from __future__ import annotations

import math
import random

import pytest
import torch

from moe_rl.algo import compute_advantages, zero_advantage_frac
from moe_rl.config import ConfigError, load_config


def reference(rewards: list[float], groups: list[int], k: float, eps: float) -> list[float]:
    """Per sample, in plain Python: (R_i - Q_k) / (std + eps), Q_k linear between the group's
    sorted rewards at position k (n - 1), std with Bessel's correction; 0 in a group of one."""
    out = []
    for r, g in zip(rewards, groups):
        vals = sorted(v for v, h in zip(rewards, groups) if h == g)
        n = len(vals)
        if n == 1:
            out.append(0.0)
            continue
        pos = k * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        q = vals[lo] + (pos - lo) * (vals[hi] - vals[lo])
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
        out.append((r - q) / (std + eps))
    return out


@pytest.mark.parametrize("k", [0.1, 0.4, 0.5, 0.83])
def test_qae_matches_the_float64_reference(k):
    rng = random.Random(int(k * 100))
    groups = [g for g in range(9) for _ in range(rng.choice([1, 2, 3, 5, 8]))]
    rng.shuffle(groups)   # the groups interleaved, as a batch arrives
    rewards = [rng.choice([0.0, 1.0, rng.gauss(0, 2)]) for _ in groups]
    got = compute_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups),
                             "qae", eps=1e-6, qae_k=k)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(reference(rewards, groups, k, 1e-6), rel=1e-12,
                                         abs=1e-12)


def test_qae_hand_worked_gate_on_binary_rewards():
    """Groups of 8 at k = 0.4 (position 2.8 among the sorted rewards). Hard (2 of 8 right):
    Q = 0, the failures get 0 and each success (1 - 0)/std. Easy (6 of 8): Q = 1, the successes
    get 0 and each failure -1/std. std = sqrt(1.5/7) in both. GRPO's mean would have given
    every one of the 16 a non-zero advantage."""
    hard = [1.0, 0, 0, 0, 0, 0, 0, 1.0]
    easy = [1.0, 1, 0, 1, 1, 1, 0, 1]
    std = math.sqrt(1.5 / 7)
    adv = compute_advantages(torch.tensor(hard + easy), torch.tensor([3] * 8 + [4] * 8), "qae",
                             qae_k=0.4)
    want = [1 / (std + 1e-6) if r else 0.0 for r in hard] + \
        [0.0 if r else -1 / (std + 1e-6) for r in easy]
    assert adv.tolist() == pytest.approx(want, rel=1e-6)
    assert zero_advantage_frac(adv) == 12 / 16
    grpo = compute_advantages(torch.tensor(hard + easy), torch.tensor([3] * 8 + [4] * 8))
    assert zero_advantage_frac(grpo) == 0.0


def test_qae_between_two_order_statistics_interpolates():
    """3 of 8 wrong at k = 0.4: position 2.8 lies between the last 0 and the first 1, so
    Q = 0.8 (torch.quantile's and the authors' linear rule); both kinds keep a gradient."""
    rewards = torch.tensor([0.0, 1, 1, 0, 1, 1, 0, 1])
    adv = compute_advantages(rewards, torch.zeros(8, dtype=torch.long), "qae", qae_k=0.4)
    assert float(torch.quantile(rewards, 0.4)) == pytest.approx(0.8)
    std = float(rewards.std())
    assert adv.tolist() == pytest.approx([(float(r) - 0.8) / (std + 1e-6) for r in rewards],
                                         rel=1e-6)


def test_qae_refusals():
    with pytest.raises(ValueError, match="qae_k"):
        compute_advantages(torch.zeros(2), torch.zeros(2), "qae", qae_k=1.0)
    assert load_config(None, ["algorithm.advantage=qae"]).algorithm.qae.k == 0.4
    for bad in ("0", "1", "1.5"):
        with pytest.raises(ConfigError, match="algorithm.qae.k"):
            load_config(None, ["algorithm.advantage=qae", f"algorithm.qae.k={bad}"])
    with pytest.raises(ConfigError, match="rollout.n_samples_per_prompt: 'qae'"):
        load_config(None, ["algorithm.advantage=qae", "rollout.n_samples_per_prompt=1"])
