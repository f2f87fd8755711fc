"""Building a step's groups (moe_rl/rollout/groups.py) over an engine, without Ray: a hand-made
engine answers each prompt with a fixed token and a hand-made scorer rewards per prompt, so the
dynamic-sampling rule can be checked case by case."""
from __future__ import annotations

import asyncio
import types

import torch

from moe_rl.config import config_from_dict
from moe_rl.data.prompts import PromptRecord
from moe_rl.engines.base import SamplingConfig, Turn
from moe_rl.rollout.groups import build_groups


class OneTokenEngine:
    """Every generation is one token: the prompt's first id (so the reward can tell the prompt)."""

    def run(self, job):
        return asyncio.run(job(self))

    async def generate_turn(self, prompt_ids, sampling, seed=None):
        return Turn(output_ids=[prompt_ids[0]], logprobs=torch.tensor([-0.5]), routing=None,
                    kept_offsets=None, kept_ids=None, kept_logmass=None, weight_version=0,
                    finish_reason={"type": "length"}, cached_tokens=0)


class Tokenizer:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return str(ids[0])


class PerPromptReward:
    """Prompt p's samples get ``rewards[p][j]`` (sample j of its group)."""

    def __init__(self, rewards):
        self.rewards, self.seen = rewards, {}
        self.errors = self.timeouts = 0

    async def score(self, items):
        out = []
        for it in items:
            p = int(it["response"])
            j = self.seen.get(p, 0)
            self.seen[p] = j + 1
            out.append(self.rewards[p][j])
        return out


def run(rewards, indices, extra, dynamic=True, oversample=None):
    prompts = [PromptRecord(text=str(p), ids=[p, 99], answer=None) for p in range(len(rewards))]
    cfg = config_from_dict({"rollout": {"n_samples_per_prompt": 2, "prompts_per_step": 2,
                                        "dynamic_sampling": dynamic,
                                        "max_oversample": oversample}})
    inputs = types.SimpleNamespace(tokenizer=Tokenizer(), prompts=prompts,
                                   reward=PerPromptReward(rewards), environment=None)
    return build_groups(OneTokenEngine(), cfg, inputs, SamplingConfig(1.0, 1.0, -1, 0.0, 1),
                        indices, extra, seed=5)


def prompts_of(groups):
    return [int(s.response_ids[0]) for s in groups.samples][::2]


def test_uniform_groups_are_replaced_from_the_reserve_in_order():
    """Prompts 0 and 1 drawn; 0's rewards are all equal (dropped), 1's differ (kept); from the
    reserve [2, 3, 4], 2 is uniform too, 3 informative: the batch is [1, 3], renumbered."""
    rewards = {0: [1.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 0.0], 3: [1.0, 0.0], 4: [0.0, 1.0]}
    g = run(rewards, [0, 1], [2, 3, 4])
    assert prompts_of(g) == [1, 3]
    assert [s.group_id for s in g.samples] == [0, 0, 1, 1]
    assert [s.sample_id for s in g.samples] == [0, 1, 2, 3]
    assert g.counts == {"rollout/generated_groups": 4.0, "rollout/dropped_groups": 2.0,
                        "rollout/filled_groups": 0.0, "rollout/generated_tokens": 8.0}


def test_a_reserve_that_runs_out_fills_up_with_dropped_groups():
    rewards = {0: [1.0, 1.0], 1: [0.0, 0.0], 2: [1.0, 1.0]}
    g = run(rewards, [0, 1], [2], oversample=1)
    assert prompts_of(g) == [0, 1]   # no informative group: the first uniform ones fill it
    assert g.counts["rollout/filled_groups"] == 2.0
    assert g.counts["rollout/generated_groups"] == 3.0


def test_without_dynamic_sampling_the_drawn_groups_are_the_batch():
    rewards = {0: [1.0, 1.0], 1: [0.0, 1.0]}
    g = run(rewards, [0, 1], [], dynamic=False)
    assert prompts_of(g) == [0, 1] and g.counts["rollout/dropped_groups"] == 0.0
    assert [s.reward for s in g.samples] == [1.0, 1.0, 0.0, 1.0]
    assert all(s.metadata["prompt_index"] in (0, 1) for s in g.samples)


def test_each_training_set_gets_the_mean_reward_of_its_samples():
    """Sets a (prompts 0-1), b (2-4), c (5): the step drew prompts 1, 2 and 4, so a's mean is
    prompt 1's, b's that of prompts 2 and 4 together, c is left out; one set: nothing."""
    from moe_rl.rollout.groups import reward_by_set
    rewards = {1: [0.0, 1.0], 2: [1.0, 1.0], 4: [0.0, 0.5], 0: [0, 0], 3: [0, 0], 5: [0, 0]}
    g = run(rewards, [1, 2, 4], [], dynamic=False)
    assert reward_by_set(g.samples, ["a", "b", "c"], [2, 3, 1]) == {
        "reward/a/mean": 0.5, "reward/b/mean": 2.5 / 4}
    assert reward_by_set(g.samples, ["a"], [6]) == {}


def test_throughput_is_the_generated_tokens_over_the_step_and_over_their_generation():
    from moe_rl.orchestration.loop import throughput
    m = {"rollout/generated_tokens": 120.0, "timing/step_s": 4.0, "timing/rollout_s": 1.5}
    assert throughput(m) == {"throughput/tokens_per_s": 30.0,
                             "throughput/rollout_tokens_per_s": 80.0}
    assert throughput({"rollout/generated_tokens": 8.0, "timing/step_s": 2.0}) == {
        "throughput/tokens_per_s": 4.0}
    assert throughput({"timing/step_s": 2.0}) == {}   # a step without a batch summary
