"""A step's batch policy (the prompts drawn beyond the step's, the step's seed) and the summary
the driver reads of it."""
import pathlib

import pytest

from moe_rl.config import load_config
from moe_rl.data.prompts import PromptSampler
from moe_rl.rollout.batch import BatchSummary, extra_prompts, step_seed

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")


@pytest.mark.parametrize("overrides,first,expected", [
    ([], True, 0),                                                  # synchronous: none
    (["rollout.dynamic_sampling=true", "rollout.max_oversample=5"], False, 5),
    (["rollout.dynamic_sampling=true"], False, 4),                  # default: one batch
    (["rollout.partial.enabled=true", "rollout.max_staleness=1", "rollout.partial.extra_groups=3"],
     True, 3),
    (["rollout.partial.enabled=true", "rollout.max_staleness=1", "rollout.partial.extra_groups=3"],
     False, 0),   # the first batch only
])
def test_the_extra_prompts_follow_the_strategy(overrides, first, expected):
    cfg = load_config(CONFIG, ["rollout.prompts_per_step=4", *overrides])
    sampler = PromptSampler(40, 4, seed=1)
    reference = PromptSampler(40, 4, seed=1)
    drawn = [i for _ in range(-(-expected // 4)) for i in reference.next_batch()][:expected]
    assert extra_prompts(cfg.rollout, sampler, first) == drawn
    assert sampler.state_dict() == reference.state_dict()   # whole batches drawn


def test_every_step_has_its_own_seed():
    cfg = load_config(CONFIG, [])
    assert len({step_seed(cfg.trainer.seed, t) for t in range(1000)}) == 1000
    assert step_seed(load_config(CONFIG, ["trainer.seed=2"]).trainer.seed, 0) != step_seed(cfg.trainer.seed, 0)


def test_the_summary_gives_the_rollout_metrics_and_whether_the_reward_failed_everywhere():
    summary = BatchSummary(samples=3, reward_failures=1, reward_calls=4, reward_errors_total=5,
                           reward_timeouts_total=2, reward_clipped_total=0,
                           last_reward_error="boom", first_env_error=None, stale_samples=3,
                           counts={"rollout/generated_tokens": 12.0})
    assert summary.metrics() == {"reward/errors": 5.0, "reward/timeouts": 2.0,
                                 "reward/clipped": 0.0, "rollout/stale_samples": 3.0,
                                 "rollout/generated_tokens": 12.0}
    assert not summary.reward_failed_everywhere
    summary.reward_failures = 4
    assert summary.reward_failed_everywhere
