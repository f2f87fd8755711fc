"""One step's batch on the rollout side: its policy (the prompts drawn beyond the step's, the
step's seed, one way to make its groups whatever the strategy: synchronous, dynamic sampling or
partial rollouts) and what the driver learns of it (:class:`BatchSummary`). No Ray here: the
rollout worker calls :func:`make_batch`, the driver's pipeline :func:`extra_prompts` and
:func:`step_seed`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from moe_rl.config import Config, RolloutConfig, set_name
from moe_rl.rollout.groups import build_groups, retraction_counts, reward_by_set
from moe_rl.outputs.sample_log import shown_samples
from moe_rl.rollout.partial import score_with


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of step ``step``'s batch in a run of ``trainer.seed`` = ``seed``."""
    return seed * 100_003 + step * 10_007


def extra_prompts(r: RolloutConfig, sampler, first: bool) -> list[int]:
    """The prompts a step's batch may use beyond its ``prompts_per_step``: with dynamic
    sampling up to ``rollout.max_oversample`` (to replace groups whose rewards are all equal);
    with partial rollouts, on the first batch, ``rollout.partial.extra_groups`` (groups started
    ahead); else none. Drawn from ``sampler`` in whole batches (default cap: one batch)."""
    if not (r.dynamic_sampling or (r.partial.enabled and first)):
        return []
    cap = r.max_oversample if r.dynamic_sampling else r.partial.extra_groups
    cap = r.prompts_per_step if cap is None else cap
    return [i for _ in range(-(-cap // r.prompts_per_step)) for i in sampler.next_batch()][:cap]


@dataclass
class BatchSummary:
    """What the driver learns of a step's batch (its samples cross to the trainers apart):
    counts, the reward service's running totals and errors, the rollout metrics, the samples
    shown in samples.jsonl, the phases' seconds."""
    samples: int
    reward_failures: int          # this batch's samples scored 0 on an error, and timeouts
    reward_calls: int             # this batch's reward calls (timed-out samples are gone)
    reward_errors_total: int
    reward_timeouts_total: int
    reward_clipped_total: int
    last_reward_error: str | None
    first_env_error: str | None
    stale_samples: int            # samples generated from weights older than the step
    counts: dict[str, float]      # rollout/* and reward/* figures of the batch
    shown: list = field(default_factory=list)
    timing: dict[str, float] = field(default_factory=dict)

    @property
    def reward_failed_everywhere(self) -> bool:
        return self.reward_failures >= self.reward_calls

    def metrics(self) -> dict[str, float]:
        """The step's rollout figures."""
        return {"reward/errors": float(self.reward_errors_total),
                "reward/timeouts": float(self.reward_timeouts_total),
                "reward/clipped": float(self.reward_clipped_total),
                "rollout/stale_samples": float(self.stale_samples), **self.counts}


def make_batch(engine, cfg: Config, inputs, sampling, partial, indices: list[int],
               extra: list[int], step: int, seed: int) -> tuple[list, BatchSummary]:
    """Step ``step``'s samples and summary: the groups of ``indices`` (and of ``extra`` as the
    strategy uses them; ``partial``: the run's :class:`PartialRollout`, or None) with their
    rewards, then the engine's scoring passes (``pi_old: engine_avg``)."""
    reward = inputs.reward
    t0 = time.perf_counter()
    errors_before, timeouts_before = reward.errors, reward.timeouts
    if partial is not None:   # extra: groups started beyond this step's
        groups = partial.collect(engine, inputs.prompts, list(indices) + list(extra),
                                 cfg.rollout.n_samples_per_prompt, sampling, step, seed,
                                 cfg.rollout.prompts_per_step, score_with(inputs))
    else:
        groups = build_groups(engine, cfg, inputs, sampling, indices, extra, seed)
    samples, counts = groups.samples, groups.counts
    counts.update(retraction_counts(samples, cfg.rollout.retracted == "mask"
                                    and cfg.algorithm.replay == "r3"))
    counts.update(reward_by_set(samples, [set_name(e) for e in cfg.data.sets],
                                inputs.set_sizes))
    errors = reward.errors - errors_before   # scored 0 (timed-out samples are gone)
    timeouts = reward.timeouts - timeouts_before
    summary = BatchSummary(
        samples=len(samples), reward_failures=errors + timeouts,
        reward_calls=len(samples) + timeouts, reward_errors_total=reward.errors,
        reward_timeouts_total=reward.timeouts, reward_clipped_total=reward.clipped,
        last_reward_error=reward.last_error, first_env_error=groups.first_env_error,
        stale_samples=sum(s.weight_version < step for s in samples), counts=counts,
        shown=shown_samples(samples, inputs.tokenizer, inputs.prompts,
                            cfg.logging.samples_per_step),
        timing={"timing/rollout_s": time.perf_counter() - t0 - groups.reward_s,
                "timing/reward_s": groups.reward_s})
    if samples and errors < len(samples) and cfg.algorithm.pi_old == "engine_avg":
        t2 = time.perf_counter()
        engine.score(samples, cfg.algorithm.pi_old_passes,
                     temperature=cfg.rollout.sampling.temperature,
                     window=cfg.rollout.scoring.window_tokens)
        summary.timing["timing/engine_scoring_s"] = time.perf_counter() - t2
    summary.timing["timing/collect_s"] = time.perf_counter() - t0
    return samples, summary
