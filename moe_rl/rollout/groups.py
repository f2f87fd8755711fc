"""A step's prompt groups, built over an engine (the contract of :mod:`moe_rl.engines.base`) and
the run's inputs: ``n_samples_per_prompt`` responses per prompt with their rewards scored as
each group completes, or, with ``data.environment``, multi-turn trajectories whose rewards the
environment gives; with ``rollout.dynamic_sampling`` groups whose rewards are all equal are
replaced by groups of further prompts. No Ray here: the rollout worker calls
:func:`build_groups`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from moe_rl.config import Config, response_cap
from moe_rl.rewards.functions import score_samples
from moe_rl.rollout.trajectories import (TrajectoryLimits, TrajectoryStats, generate_samples,
                                         rollout_trajectories)


@dataclass
class StepGroups:
    """The step's groups: samples renumbered group-major, the rollout counts, the seconds of
    reward scoring not hidden behind generation, the first environment error (or None)."""
    samples: list
    counts: dict[str, float]
    reward_s: float = 0.0
    first_env_error: str | None = None


@dataclass
class _Selection:
    """Groups sorted as they come: informative ones, and (dynamic sampling) uniform ones."""
    dynamic: bool
    informative: list = field(default_factory=list)
    uniform: list = field(default_factory=list)

    def add(self, samples: list, gids: list[int]) -> None:
        by_group: dict[int, list] = {g: [] for g in gids}
        for s in samples:
            by_group[s.group_id].append(s)
        for group in by_group.values():
            if not group:   # every trajectory of the prompt was dropped
                continue
            equal = len({s.reward for s in group}) == 1
            (self.uniform if self.dynamic and equal else self.informative).append(group)

    def chosen(self, wanted: int) -> tuple[list, int]:
        """``wanted`` groups, informative first, filled up with uniform ones; and how many
        were filled."""
        filled = max(wanted - len(self.informative), 0)
        return self.informative[:wanted] + self.uniform[:filled], filled


def build_groups(engine, cfg: Config, inputs, sampling, indices: list[int], extra: list[int],
                 seed: int) -> StepGroups:
    """The groups of the prompts ``indices`` (``inputs``: the run's tokenizer, prompts, reward
    and environment). With dynamic sampling, groups whose rewards are all equal are dropped and
    as many more prompts as are missing are taken from ``extra`` (in order; at most
    ``rollout.max_oversample``) until ``len(indices)`` informative groups are there; when
    ``extra`` runs out first, the batch is filled up with dropped groups (their advantages are
    zero). A dropped trajectory leaves its group smaller."""
    r = cfg.rollout
    per = r.n_samples_per_prompt
    cap = r.prompts_per_step if r.max_oversample is None else r.max_oversample
    extra = list(extra)[:cap] if r.dynamic_sampling else []
    selection = _Selection(r.dynamic_sampling)
    queue, generated, tokens, reward_s = list(indices), 0, 0, 0.0
    stats = TrajectoryStats()
    while queue:
        gids = list(range(generated, generated + len(queue)))
        round_seed = seed + generated * per
        if inputs.environment is None:
            samples, hidden = _scored_responses(engine, inputs, sampling, queue, per,
                                                round_seed, gids)
            reward_s += hidden
        else:
            samples = _trajectories(engine, cfg, inputs, sampling, queue, per, round_seed,
                                    gids, stats)
        generated += len(queue)
        tokens += sum(int(s.loss_mask.sum()) for s in samples)   # model tokens
        selection.add(samples, gids)
        missing = max(len(indices) - len(selection.informative), 0)
        queue, extra = extra[:missing], extra[missing:]
    chosen, filled = selection.chosen(len(indices))
    out = []
    for g, group in enumerate(chosen):
        for s in group:
            s.group_id, s.sample_id = g, len(out)
            out.append(s)
    counts = {"rollout/generated_groups": float(generated),
              "rollout/dropped_groups": float(generated - len(chosen)),
              "rollout/filled_groups": float(filled if r.dynamic_sampling else 0),
              "rollout/generated_tokens": float(tokens)}
    if inputs.environment is not None:
        counts.update(stats.metrics())
    return StepGroups(out, counts, reward_s, stats.first_error)


def _scored_responses(engine, inputs, sampling, queue: list[int], per: int, seed: int,
                      gids: list[int]) -> tuple[list, float]:
    """``per`` responses to each prompt of ``queue``, each group's rewards scored while the
    others generate; and the seconds of scoring left after the last group was generated."""
    generated_at = [time.perf_counter()]

    async def scored(group):
        for s in group:
            s.metadata["prompt_index"] = queue[s.sample_id // per]
        return await score_samples(group, inputs.tokenizer, inputs.prompts, inputs.reward)

    samples = generate_samples(
        engine, [inputs.prompts[i].ids for i in queue], per, sampling, seed=seed,
        group_ids=gids, on_group=scored,
        progress=lambda _: generated_at.__setitem__(0, time.perf_counter()))
    return samples, time.perf_counter() - generated_at[0]


def _trajectories(engine, cfg: Config, inputs, sampling, queue: list[int], per: int, seed: int,
                  gids: list[int], stats: TrajectoryStats) -> list:
    """``per`` multi-turn trajectories of each prompt of ``queue`` with the environment
    (their counts added to ``stats``)."""
    r = cfg.rollout
    limits = TrajectoryLimits(r.max_turns, response_cap(cfg), cfg.data.environment_timeout_s)
    samples, _ = rollout_trajectories(
        engine, lambda: inputs.environment(inputs.tokenizer),
        [inputs.prompts[i] for i in queue], per, sampling, limits, engine.moe_shape.vocab_size,
        group_ids=gids, seed=seed, stats=stats)
    for s in samples:
        s.metadata["prompt_index"] = queue[s.sample_id // per]
    return samples


def retraction_counts(samples: list, mask: bool) -> dict[str, float]:
    """``rollout/retracted``: the samples the engine retracted at least once under KV-pool
    pressure (``Sample.metadata["retractions"]``); with ``mask`` (``rollout.retracted: mask``
    under replay r3) their tokens leave the loss, counted in ``rollout/retracted_masked_tokens``."""
    hit = [s for s in samples if s.metadata.get("retractions", 0) > 0]
    masked = 0
    if mask:
        for s in hit:
            masked += int(s.loss_mask.sum())
            s.loss_mask = s.loss_mask.new_zeros(s.loss_mask.shape)
    return {"rollout/retracted": float(len(hit)),
            "rollout/retracted_masked_tokens": float(masked)}


def reward_by_set(samples: list, names: list[str], sizes: list[int]) -> dict[str, float]:
    """``reward/<set>/mean``: with several training sets (``data.sets``), the mean reward of the
    step's samples drawn from each set (``names``, ``sizes`` prompts each, one after the other);
    a set no sample of the step came from is left out."""
    if len(names) < 2:
        return {}
    sums, counts = [0.0] * len(names), [0] * len(names)
    for s in samples:
        index, i = s.metadata["prompt_index"], 0
        while index >= sizes[i]:
            index -= sizes[i]
            i += 1
        sums[i] += float(s.reward)
        counts[i] += 1
    return {f"reward/{name}/mean": total / n for name, total, n in zip(names, sums, counts) if n}
