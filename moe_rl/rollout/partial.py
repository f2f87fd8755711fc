"""Partial rollouts (``rollout.partial``): a step stops generating once ``prompts_per_step``
groups are complete; the responses still in flight are aborted on the engines (SGLang's
``/abort_request``, ``abort_all``: each answers with what it generated so far) and kept, token by
token, with the weight version that sampled each token; the next step continues each one from
its prefix under whatever weights the engines then serve. So a long response never holds a step:
it spans several weight versions instead.

The record of a response that spans versions (see :class:`moe_rl.rollout_record.Sample`):

- every token's log-prob, kept set and version as sampled;
- the routing of every position as the engine routed it when it sampled there (a continuation's
  prefill under the new weights never overwrites the rows of tokens already sampled): the
  update under R3 replays this record;
- for each later version, the routing its prefill gave the positions before its segment (the
  KV that segment's tokens attended to), so the trainer reproduces each segment exactly at its
  own version.

Staleness: a token is trained at most ``rollout.max_staleness`` versions after the one that
sampled it. At the start of each step's collection a response holding an older token is
restarted from its prompt (``partial_stale: drop``) or keeps going with those tokens out of the
loss (``partial_stale: mask``); both are counted. ``partial_mask_offpolicy`` keeps only the
tokens of each response's newest version in the loss (slime's
``--mask-offpolicy-in-partial-rollout``). Each step starts ``prompts_per_step`` new groups; the
first also ``rollout.partial.extra_groups`` more, so the engines always hold more work than one step
needs.

Multi-turn trajectories (``data.environment``) are continued the same way, in the middle of a
model turn: the turn's tokens so far are kept, the continuation asks for the rest of the turn,
and the environment is given the whole turn once (:class:`moe_rl.rollout.trajectories.Episode`
holds the environment and where the turn began between steps).

A checkpoint saves no partial response: a resumed run starts without them (the groups in flight
are dropped, their prompts not drawn again this epoch), counted in ``rollout/partial_in_flight``
of the last step before the save. Dynamic sampling is not combined with partial rollouts (the
configuration refuses it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from dataclasses import dataclass, field

import torch

from moe_rl.config.schema import RolloutConfig
from moe_rl.engines.base import Engine, EngineSession, SamplingConfig
from moe_rl.envs import EnvError
from moe_rl.rewards.functions import score_samples
from moe_rl.rollout.groups import StepGroups
from moe_rl.rollout.trajectories import (Episode, TrajectoryLimits, TrajectoryStats, env_call,
                                         Trajectory, keep_turn)
from moe_rl.rollout_record import Sample

ABORT_REPEAT_S = 0.2   # how often the abort is sent again while requests are still answering
CONTINUATION_SEED = 1_000_003   # a continuation's sampling seed moves by this per request


@dataclass(eq=False)
class _Response:
    """One response of a group, generated over one or more requests (a multi-turn trajectory:
    its :class:`Episode`, made at its first request)."""
    traj: Trajectory
    seed: int
    server: int
    requests: int = 0
    finish: dict | None = None   # the engine's finish_reason once it finished
    episode: Episode | None = None
    failed: bool = False         # its environment failed: dropped from its group

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass(eq=False)
class _Group:
    """The responses to one prompt; scored once all have finished."""
    prompt_index: int
    order: int   # creation order: the oldest complete groups are trained first
    responses: list[_Response]
    samples: list[Sample] | None = None   # scored (those whose reward timed out left out)

    @property
    def done(self) -> bool:
        return all(r.done for r in self.responses)


@dataclass
class PartialCounts:
    """One step's partial-rollout figures (``rollout/partial_*``)."""
    aborted: int = 0         # responses stopped in flight (or before their next request)
    dropped: int = 0         # responses restarted: they held a token past the staleness bound
    masked_tokens: int = 0   # tokens kept out of the loss (staleness mask, off-policy mask)
    in_flight: int = 0       # groups left for the next steps
    tokens: int = 0          # generated this step
    discarded_tokens: int = 0   # answered by an abort without routing / kept sets (retracted)
    score_s: float = 0.0     # seconds spent scoring rewards

    def metrics(self) -> dict[str, float]:
        return {f"rollout/partial_{k}": float(getattr(self, k))
                for k in ("aborted", "dropped", "masked_tokens", "in_flight",
                          "discarded_tokens")}


@dataclass
class PartialRollout:
    """The rollout worker's responses in flight between steps, and one step's collection."""
    max_new_tokens: int
    max_staleness: int
    stale: str                 # "drop" | "mask"
    mask_offpolicy: bool
    need_routing: bool
    need_mask: bool
    environment: object = None   # data.environment's factory (multi-turn), if any
    limits: TrajectoryLimits | None = None
    vocab_size: int = 0
    groups: list[_Group] = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)

    def collect(self, engine: Engine, prompts, indices: list[int], per: int,
                sampling: SamplingConfig, step: int, seed: int, wanted: int,
                score) -> StepGroups:
        """Step ``step``'s groups: ``wanted`` complete groups, oldest first, after the groups
        in flight continue and ``per`` responses to each prompt of ``indices`` (records of
        ``prompts``) start, seeded from ``seed``; the rest stay in flight. ``score(samples)``
        is the reward (an async function returning the samples it scored)."""
        counts, stats = PartialCounts(), TrajectoryStats()
        self._expire(step, counts)
        for g, i in enumerate(indices):
            order = next(self._order)
            self.groups.append(_Group(i, order, [
                _Response(Trajectory(prompts[i].ids), seed + (g * per + j) * 7919,
                          order * per + j) for j in range(per)]))
        engine.run(lambda session: self._generate(session, engine, prompts, sampling, wanted,
                                                  score, counts, stats))
        self.groups = [g for g in self.groups if g.samples != []]   # every response failed
        complete = sorted((g for g in self.groups if g.samples is not None),
                          key=lambda g: g.order)[:wanted]
        self.groups = [g for g in self.groups if g not in complete]
        counts.in_flight = len(self.groups)
        samples = []
        for gid, g in enumerate(complete):
            for s in g.samples:
                if self.environment is not None:
                    stats.count(s)
                counts.masked_tokens += self._mask(s, step)
                s.group_id, s.sample_id = gid, len(samples)
                samples.append(s)
        step_counts = {"rollout/generated_groups": float(len(indices)),
                       "rollout/dropped_groups": 0.0, "rollout/filled_groups": 0.0,
                       "rollout/generated_tokens": float(counts.tokens), **counts.metrics()}
        if self.environment is not None:
            step_counts.update(stats.metrics())
        return StepGroups(samples, step_counts, counts.score_s, stats.first_error)

    def _expire(self, step: int, counts: PartialCounts) -> None:
        """``partial_stale: drop``: restart every response holding a token older than the
        bound (its group is scored again when it completes)."""
        if self.stale != "drop":
            return
        oldest = step - self.max_staleness
        for g in self.groups:
            for r in g.responses:
                if r.traj.token_versions and r.traj.token_versions[0] < oldest:
                    r.traj, r.finish, r.requests = Trajectory(r.traj.prompt), None, 0
                    r.episode = None
                    g.samples = None
                    counts.dropped += 1

    def _mask(self, s: Sample, step: int) -> int:
        """Take out of ``s``'s loss the tokens past the staleness bound (``mask``) and, with
        ``partial_mask_offpolicy``, those older than its newest version; how many were in."""
        versions = s.versions()
        keep = torch.ones_like(s.loss_mask)
        if self.stale == "mask":
            keep &= versions >= step - self.max_staleness
        if self.mask_offpolicy:
            keep &= versions == versions.max()
        removed = int((s.loss_mask & ~keep).sum())
        s.loss_mask = s.loss_mask & keep
        return removed

    async def _generate(self, session: EngineSession, engine: Engine, prompts,
                        sampling: SamplingConfig, wanted: int, score, counts: PartialCounts,
                        stats: TrajectoryStats) -> None:
        """Continue every unfinished response; once ``wanted`` groups are complete (scored),
        abort what is still generating (again every ``ABORT_REPEAT_S`` until all answered) and
        send no new request (a multi-turn trajectory between two turns waits there).
        When ``wanted`` groups already finished in earlier steps (more groups finished than
        a step takes), they train and no request is sent."""
        enough = asyncio.Event()

        def check() -> None:
            if sum(bool(g.samples) for g in self.groups) >= wanted:
                enough.set()

        async def respond(r: _Response) -> None:
            while not r.done:
                if enough.is_set():   # the step has its groups: no new request
                    counts.aborted += 1
                    return
                left = self.max_new_tokens - len(r.traj.ids)
                if left <= 0:
                    r.finish = {"type": "length", "length": self.max_new_tokens}
                    break
                ids = r.traj.prompt + r.traj.ids
                turn = await session.generate_turn(
                    ids, dataclasses.replace(sampling, max_new_tokens=left),
                    seed=r.seed + CONTINUATION_SEED * r.requests, server=r.server)
                r.requests += 1
                counts.tokens += len(turn.output_ids)
                counts.discarded_tokens += turn.discarded
                await keep_turn(session, r.server, r.traj, ids, turn, 0, self.need_routing)
                if turn.aborted:
                    counts.aborted += 1
                    return
                r.finish = turn.finish_reason

        async def run_episode(g: _Group, r: _Response) -> None:
            before = len(r.traj.ids)
            discarded = r.episode.discarded if r.episode is not None else 0
            try:
                if r.episode is None:
                    env = await env_call("environment", self.environment,
                                         timeout_s=self.limits.env_timeout_s)
                    r.episode = Episode(engine, env, prompts[g.prompt_index], sampling,
                                        self.limits, r.seed, self.vocab_size, r.server)
                    r.traj = r.episode.traj
                finished = await r.episode.advance(session, fresh=r.requests > 0,
                                                   stop=enough)
            except EnvError as exc:
                stats.dropped(exc)
                r.failed, r.finish = True, {"type": "env_error"}
                return
            finally:
                r.requests += 1
                counts.tokens += len(r.traj.ids) - before
                if r.episode is not None:
                    counts.discarded_tokens += r.episode.discarded - discarded
            if finished:
                r.finish = {"type": "done"}
            else:
                counts.aborted += 1

        async def group(g: _Group) -> None:
            pending = [r for r in g.responses if not r.done]
            if self.environment is None:
                await asyncio.gather(*(respond(r) for r in pending))
            else:
                await asyncio.gather(*(run_episode(g, r) for r in pending))
            if g.done and g.samples is None:
                t0 = time.perf_counter()
                made = [self._sample(g, r) for r in g.responses if not r.failed]
                g.samples = list(await score(made)) if made else []
                counts.score_s += time.perf_counter() - t0
                check()

        check()
        if enough.is_set():   # enough groups finished before: they train, nothing starts
            return
        work = asyncio.ensure_future(asyncio.gather(*(group(g) for g in self.groups
                                                      if g.samples is None)))
        stop = asyncio.ensure_future(enough.wait())
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        while not work.done():
            await session.abort_all()
            await asyncio.wait({work}, timeout=ABORT_REPEAT_S)
        stop.cancel()
        work.result()

    def _sample(self, g: _Group, r: _Response) -> Sample:
        meta = {"prompt_index": g.prompt_index, "requests": r.requests}
        if r.episode is not None:
            s = r.episode.sample(group_id=g.order, sample_id=g.responses.index(r),
                                 metadata=meta)
        else:
            s = r.traj.sample(self.need_mask, group_id=g.order, sample_id=g.responses.index(r),
                              metadata={"finish_reason": r.finish.get("type", ""), **meta})
        s.validate()
        return s


def partial_rollout(r: RolloutConfig, cap: int, environment_timeout_s: float, engine: Engine,
                    inputs) -> PartialRollout:
    """The :class:`PartialRollout` of ``rollout`` over ``engine``, responses capped at ``cap``
    tokens (``inputs``: the run's tokenizer and environment, whose calls may each take
    ``environment_timeout_s``)."""
    environment = limits = None
    if inputs.environment is not None:
        environment = lambda: inputs.environment(inputs.tokenizer)   # noqa: E731
        limits = TrajectoryLimits(r.max_turns, cap, environment_timeout_s)
    return PartialRollout(cap, r.max_staleness, r.partial.stale,
                          r.partial.mask_offpolicy, engine.need_routing, engine.need_mask,
                          environment, limits, engine.moe_shape.vocab_size)


def score_with(inputs):
    """The reward of a group's samples, for :meth:`PartialRollout.collect` (a multi-turn
    trajectory's comes from its environment)."""
    async def score(samples: list[Sample]) -> list[Sample]:
        if inputs.environment is not None:
            return samples
        return await score_samples(samples, inputs.tokenizer, inputs.prompts, inputs.reward)
    return score
