"""Evaluation on held-out sets (``eval.*``): ``eval.n`` samples per prompt with the evaluation's
sampling, scored by the run's reward (or ``eval.reward``), summarised per set as reward mean,
pass@1, unbiased pass@k, response length and the truncated fraction. It runs on the engines with
the weights they serve; it never trains and never draws from the training data sampler."""
from __future__ import annotations

import math

from moe_rl.config import Config, EvalConfig, RolloutConfig
from moe_rl.engines.base import SamplingConfig
from moe_rl.rewards.functions import reward_items

METRICS = ("reward_mean", "pass@1", "response_len_mean", "truncated_frac")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` succeeded (Chen et al.
    2021): 1 - C(n - c, k) / C(n, k), computed as a product (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def eval_ks(e: EvalConfig) -> list[int]:
    """The k of the pass@k estimates besides pass@1: ``eval.pass_k``, else ``eval.n`` when n > 1."""
    ks = e.pass_k or ([e.n] if e.n > 1 else [])
    return sorted({k for k in ks if k != 1})


def eval_sampling(e: EvalConfig, r: RolloutConfig) -> SamplingConfig:
    """The evaluation's sampling: ``eval.*`` where set, else the rollout's (temperature 0:
    greedy)."""
    s = r.sampling
    return SamplingConfig(s.temperature if e.temperature is None else e.temperature,
                          s.top_p if e.top_p is None else e.top_p, s.top_k, s.min_p,
                          r.max_new_tokens if e.max_new_tokens is None else e.max_new_tokens)


def set_metrics(name: str, rewards: list[list[float]], lengths: list[int],
                truncated: list[bool], threshold: float, ks: list[int]) -> dict[str, float]:
    """``eval/{name}/*`` of one set: ``rewards[p]`` the rewards of prompt p's samples (a reward
    that failed counts as 0), ``lengths`` / ``truncated`` of every sample."""
    flat = [r for group in rewards for r in group]
    n = len(rewards[0])
    out = {f"eval/{name}/reward_mean": sum(flat) / len(flat),
           f"eval/{name}/pass@1": sum(r >= threshold for r in flat) / len(flat),
           f"eval/{name}/response_len_mean": sum(lengths) / len(lengths),
           f"eval/{name}/truncated_frac": sum(truncated) / len(truncated)}
    for k in ks:
        out[f"eval/{name}/pass@{k}"] = sum(
            pass_at_k(n, sum(r >= threshold for r in group), k) for group in rewards) / len(rewards)
    return out


def evaluate(cfg: Config, engine, tokenizer, eval_sets: list, scorer, seed: int) -> dict:
    """Every set of ``eval_sets`` ((name, prompts) each) on ``engine``: ``eval.n`` samples per
    prompt, sample k of a set seeded ``seed + k`` (the same samples' randomness at every
    evaluation), rewards from ``scorer`` requested as each prompt's samples finish. Returns
    the ``eval/*`` metrics."""
    from moe_rl.rollout.trajectories import generate_samples
    sampling, ks, n = eval_sampling(cfg.eval, cfg.rollout), eval_ks(cfg.eval), cfg.eval.n
    out: dict[str, float] = {}
    for name, prompts in eval_sets:
        rewards: dict[int, list[float]] = {}

        async def scored(group, prompts=prompts, rewards=rewards):
            for s in group:
                s.metadata["prompt_index"] = s.group_id
            values = await scorer.score(reward_items(group, tokenizer, prompts))
            rewards[group[0].group_id] = [0.0 if v is None else v for v in values]
            return group

        samples = generate_samples(engine, [p.ids for p in prompts], n, sampling, seed=seed,
                                   on_group=scored)
        out.update(set_metrics(
            name, [rewards[g] for g in range(len(prompts))],
            [len(s.response_ids) for s in samples],
            [s.metadata.get("finish_reason") == "length" for s in samples],
            cfg.eval.success_threshold, ks))
    return out


def eval_due(e: EvalConfig, steps: int, done: int) -> bool:
    """Whether the policy after ``done`` of ``steps`` updates is evaluated: before the first
    one with ``eval.at_start``, every ``eval.interval`` updates, and after the last one."""
    if not e.sets:
        return False
    if done == 0:
        return e.at_start
    return done == steps or bool(e.interval and done % e.interval == 0)
