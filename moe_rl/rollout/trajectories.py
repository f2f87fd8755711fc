"""Trajectories from prompt to :class:`Sample`, written against the engine contract
(:class:`moe_rl.engines.base.Engine`): a single-turn sample is a one-turn trajectory
(:func:`generate_samples`); multi-turn trajectories run against an environment, token ids end to
end (:func:`rollout_trajectories`).

Each turn of a multi-turn trajectory sends the whole trajectory so far as ``input_ids`` to the same
server (its prefix cache serves the earlier turns), with routing and sampling masks requested; the
model's ids are kept exactly as generated and the environment's observation ids are appended as
given (nothing is decoded and re-encoded). Observation tokens get loss mask 0, rollout log-prob 0
and a one-token kept set (the trainer scores them nowhere that counts).

Routing across turns: the routing replayed for a position is the one recorded when the KV that
later tokens attended to was computed. A turn asks for ``routed_experts_start_len`` = the
positions already received, so only new positions travel. When the engine served the earlier
positions from its prefix cache (``cached_tokens`` >= received) they are the routing already held
(SGLang returns, for a cached prefix, the routing recorded with that KV). When it recomputed some
of them (cache flushed or evicted between turns), the later tokens attended to the recomputed KV:
a follow-up request (no new tokens, ``routed_experts_start_len = cached_tokens``), which the
prefix cache serves from the turn just computed, fetches their routing, which replaces the rows
held; the positions it returns a second time must agree with the turn's (else the trajectory is
dropped).

Limits: at most ``max_turns`` model turns and ``max_response_tokens`` response tokens (model +
observation). A trajectory ends on a model turn: an observation is never appended when no model
turn may follow it. Truncated trajectories (a limit reached before the environment said done, or
the environment's own ``truncated``) keep their tokens, are marked ``metadata["truncated"]``, and
get the environment's reward if it gave one, else 0.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

import torch

from moe_rl.envs import EnvError, check_step
from moe_rl.plugins import PluginTimeout, call_bounded_async
from moe_rl.engines.base import Engine, EngineSession, ResponseError, SamplingConfig, Turn
from moe_rl.rollout_record import Sample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrajectoryLimits:
    max_turns: int
    max_response_tokens: int
    env_timeout_s: float = 60.0   # one environment call (constructor, reset, step), at most


class EnvTimeout(EnvError):
    """An environment call did not return within ``env_timeout_s``."""


async def env_call(what: str, fn, *args, timeout_s: float):
    """``fn(*args)`` of the environment on a thread of its own, bounded; EnvError (EnvTimeout
    past the bound) names the call."""
    try:
        return await call_bounded_async(fn, *args, timeout_s=timeout_s)
    except PluginTimeout as exc:
        raise EnvTimeout(f"{what}: {exc} (data.environment_timeout_s)") from None
    except Exception as exc:   # the user's code must never stop the run
        raise EnvError(f"{what}: {type(exc).__name__}: {exc}") from None


@dataclass
class TrajectoryStats:
    """What a batch of trajectories looked like (the rollout/* multi-turn metrics)."""
    turns: int = 0
    trajectories: int = 0
    observation_tokens: int = 0
    response_tokens: int = 0
    truncated: int = 0
    env_errors: int = 0
    env_timeouts: int = 0
    routing_refetches: int = 0
    first_error: str | None = None

    def count(self, s: Sample) -> None:
        """Add the finished trajectory ``s`` (its loss mask as the rollout made it)."""
        self.trajectories += 1
        self.turns += s.metadata["turns"]
        self.truncated += s.metadata["truncated"]
        self.routing_refetches += s.metadata["routing_refetches"]
        self.observation_tokens += int((~s.loss_mask).sum())
        self.response_tokens += s.response_len

    def dropped(self, exc: EnvError) -> None:
        """Count a trajectory dropped on ``exc``; the first reason is kept and logged."""
        if isinstance(exc, EnvTimeout):
            self.env_timeouts += 1
        else:
            self.env_errors += 1
        if self.first_error is None:
            self.first_error = str(exc)
            log.warning("environment failed, trajectory dropped: %s", exc)

    def metrics(self) -> dict[str, float]:
        n = max(self.trajectories, 1)
        return {"rollout/turns_mean": self.turns / n,
                "rollout/observation_token_frac":
                    self.observation_tokens / max(self.response_tokens, 1),
                "rollout/env_errors": float(self.env_errors),
                "rollout/env_timeouts": float(self.env_timeouts),
                "rollout/truncated_frac": self.truncated / n}


class Trajectory:
    """The growing response of one trajectory."""

    def __init__(self, prompt: list[int]):
        self.prompt = list(prompt)
        self.ids: list[int] = []
        self.lp: list[torch.Tensor] = []
        self.loss: list[torch.Tensor] = []
        self.kept_lens: list[torch.Tensor] = []
        self.kept_ids: list[torch.Tensor] = []
        self.logmass: list[torch.Tensor] = []
        self.routing: torch.Tensor | None = None   # rows of positions 0 .. received-1
        self.token_versions: list[int] = []   # per response token (observations: the version
                                              # that prefilled them, the model turn's till then)
        self.segment_routing: list[torch.Tensor] = []   # per later version (partial rollouts)
        self.model_end = 0   # response tokens up to the last model token
        self.retractions = 0   # times the engine retracted one of its requests (KV pressure)

    @property
    def received(self) -> int:
        return 0 if self.routing is None else int(self.routing.shape[0])

    def add_model(self, turn) -> None:
        n = len(turn.output_ids)
        self.ids += turn.output_ids
        self.lp.append(turn.logprobs)
        self.loss.append(torch.ones(n, dtype=torch.bool))
        if turn.kept_offsets is not None:
            self.kept_lens.append(turn.kept_offsets[1:] - turn.kept_offsets[:-1])
            self.kept_ids.append(turn.kept_ids)
            self.logmass.append(turn.kept_logmass)
        self.token_versions += turn.token_versions or [turn.weight_version] * n
        self.model_end = len(self.ids)
        self.retractions += turn.retractions

    def add_observation(self, obs: list[int], need_mask: bool) -> None:
        n = len(obs)
        self.token_versions += [self.token_versions[-1]] * n
        self.ids += obs
        self.lp.append(torch.zeros(n))
        self.loss.append(torch.zeros(n, dtype=torch.bool))
        if need_mask:
            self.kept_lens.append(torch.ones(n, dtype=torch.int64))
            self.kept_ids.append(torch.tensor(obs, dtype=torch.int32))
            self.logmass.append(torch.zeros(n))

    def sample(self, need_mask: bool, **kw) -> Sample:
        offsets = ids = logmass = None
        if need_mask:
            lens = torch.cat(self.kept_lens)
            offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
            offsets[1:] = torch.cumsum(lens, 0)
            ids, logmass = torch.cat(self.kept_ids), torch.cat(self.logmass)
        several = len(set(self.token_versions)) > 1
        if self.retractions:
            kw["metadata"] = {**(kw.get("metadata") or {}), "retractions": self.retractions}
        return Sample(prompt_ids=self.prompt, response_ids=self.ids,
                      rollout_logprobs=torch.cat(self.lp), loss_mask=torch.cat(self.loss),
                      routing=self.routing, sampling_mask_offsets=offsets,
                      sampling_mask_ids=ids, kept_logmass=logmass,
                      weight_version=self.token_versions[0],
                      token_versions=self.token_versions if several else None,
                      segment_routing=(self.segment_routing if several and self.routing
                                       is not None else None), **kw)


def sample_of_turn(prompt_ids: list[int], turn: Turn, *, group_id: int, sample_id: int,
                   metadata: dict | None = None) -> Sample:
    """A single-turn sample: the one-turn trajectory of ``turn`` after ``prompt_ids``."""
    traj = Trajectory(prompt_ids)
    traj.routing = turn.routing
    traj.add_model(turn)
    return traj.sample(turn.kept_offsets is not None, group_id=group_id, sample_id=sample_id,
                       metadata={**(metadata or {}),
                                 "finish_reason": turn.finish_reason.get("type", "")})


def generate_samples(engine: Engine, prompts: list[list[int]], n: int,
                     sampling: SamplingConfig, *, group_ids: list[int] | None = None,
                     seed: int | None = None, metadata: list[dict] | None = None,
                     progress=None, on_group=None) -> list[Sample]:
    """``n`` single-turn samples per prompt, in prompt-major order; sample_id = position in
    that order, sample k seeded ``seed + k``; ``progress(1)`` after each. ``on_group``: an async
    function given each prompt's samples as soon as they are all generated (while the other
    groups are still generating), returning the samples to keep (e.g. scoring their rewards)."""
    group_ids = group_ids if group_ids is not None else list(range(len(prompts)))

    async def one(session: EngineSession, k: int, i: int) -> Sample:
        turn = await session.generate_turn(prompts[i], sampling,
                                           seed=None if seed is None else seed + k)
        if progress is not None:
            progress(1)
        s = sample_of_turn(prompts[i], turn, group_id=group_ids[i], sample_id=k,
                           metadata=metadata[i] if metadata else None)
        s.validate()
        return s

    async def group(session: EngineSession, i: int) -> list[Sample]:
        samples = list(await asyncio.gather(*(one(session, i * n + j, i) for j in range(n))))
        return samples if on_group is None else list(await on_group(samples))

    async def all_jobs(session: EngineSession):
        return await asyncio.gather(*(group(session, i) for i in range(len(prompts))))

    return [s for samples in engine.run(all_jobs) for s in samples]


async def _refetch_routing(session: EngineSession, server: int, ids: list[int], turn: Turn,
                           traj: Trajectory, new_rows: torch.Tensor) -> torch.Tensor:
    """The routing of positions ``turn.cached_tokens ..`` of ``ids`` as the engine holds it after
    a turn that recomputed already received positions; checked against ``new_rows`` (the turn's
    rows of the positions from ``traj.received``), which it returns a second time."""
    start = turn.cached_tokens
    rows = await session.routing(ids, start, server=server)
    twice = rows[traj.received - start:]
    if not torch.equal(twice, new_rows):
        raise ResponseError(f"routed_experts: positions {traj.received}..{len(ids) - 2} received "
                            f"twice disagree (the engine recomputed them again between the turn "
                            f"and its follow-up)")
    return rows


class Episode:
    """One multi-turn trajectory as it runs: its environment, the response so far and where the
    turn in progress began, so a turn an abort stopped (partial rollouts) continues later from
    its prefix, possibly under newer weights."""

    def __init__(self, engine: Engine, env, record, sampling: SamplingConfig,
                 limits: TrajectoryLimits, seed: int | None, vocab_size: int, server: int):
        self.engine, self.env, self.record = engine, env, record
        self.sampling, self.limits, self.seed = sampling, limits, seed
        self.vocab_size, self.server = vocab_size, server
        self.traj = Trajectory(record.ids)
        self.stop = tuple(getattr(env, "stop_token_ids", ()) or ())
        self.turns = self.requests = self.refetches = 0
        self.discarded = 0   # tokens aborts answered without routing / kept sets (retracted)
        self.reward, self.truncated = None, False
        self.turn_start: int | None = None   # response index where the turn in progress began
        self.started = False

    async def advance(self, session: EngineSession, fresh: bool = False,
                      stop: asyncio.Event | None = None) -> bool:
        """Run turns on ``session`` until the trajectory ends (True) or a turn is aborted, or
        ``stop`` is set before a request (False: what it generated is kept; the next call
        continues that turn). ``fresh``: the engines may serve newer weights since the last
        request, so the first asks for every position's routing (:func:`keep_turn`)."""
        traj, limits = self.traj, self.limits
        if not self.started:
            await env_call("reset", self.env.reset, self.record, timeout_s=limits.env_timeout_s)
            self.started = True
        while True:
            if self.turn_start is None:
                self.turn_start = len(traj.ids)
            if stop is not None and stop.is_set():
                return False
            ids = traj.prompt + traj.ids
            cap = min(self.sampling.max_new_tokens - (len(traj.ids) - self.turn_start),
                      limits.max_response_tokens - len(traj.ids))
            finish = {"type": "length", "length": self.sampling.max_new_tokens}
            if cap > 0:   # else an abort answered just as the turn reached its cap
                params = dataclasses.replace(self.sampling, max_new_tokens=cap,
                                             stop_token_ids=self.stop)
                start = 0 if fresh else traj.received
                fresh = False
                turn = await session.generate_turn(
                    ids, params, seed=None if self.seed is None else self.seed + self.requests,
                    routing_from=start, server=self.server)
                self.requests += 1
                self.discarded += turn.discarded
                self.refetches += await keep_turn(session, self.server, traj, ids, turn, start,
                                                  self.engine.need_routing)
                if turn.aborted:
                    return False
                finish = turn.finish_reason
            self.turns += 1
            output = traj.ids[self.turn_start:]
            self.turn_start = None
            result = await env_call("step", self.env.step, output, dict(finish),
                                    timeout_s=limits.env_timeout_s)
            result = check_step(result, self.vocab_size)
            if result.done or result.truncated:
                self.reward, self.truncated = result.reward, result.truncated and not result.done
                return True
            obs = result.observation_ids
            if (self.turns >= limits.max_turns
                    or len(traj.ids) + len(obs) >= limits.max_response_tokens):
                self.truncated = True
                return True
            traj.add_observation(obs, self.engine.need_mask)

    def sample(self, **sample_kw) -> Sample:
        """The finished trajectory as a sample (its turns, truncation and routing follow-ups
        in its metadata: :meth:`TrajectoryStats.count`)."""
        s = self.traj.sample(self.engine.need_mask,
                             reward=0.0 if self.reward is None else self.reward, **sample_kw)
        s.metadata.update(turns=self.turns, truncated=self.truncated,
                          routing_refetches=self.refetches)
        return s


async def keep_turn(session: EngineSession, server: int | None, traj: Trajectory,
                    ids: list[int], turn: Turn, start: int, need_routing: bool) -> int:
    """Append ``turn`` (generated after ``ids`` = ``traj``'s prompt and tokens, routed from
    position ``start``) to ``traj``; returns the routing follow-ups it took (0 or 1).

    Routing: the rows already held stay (each token's routing as sampled). Asked from position
    0 (``start`` 0, a continuation that may run under new weights), the turn's rows of the held
    positions are, under a new version, that version's prefix routing (kept apart, for its
    segment, which opens with the observation tokens the request prefilled first, if any);
    under the same version, the positions the engine recomputed take the recomputed rows (the
    KV later tokens attend to). Asked from the held positions on, a turn that
    recomputed some of them is followed by a routing request (:func:`_refetch_routing`)."""
    if not turn.output_ids:   # aborted before it ran
        return 0
    refetched = 0
    if need_routing:
        rows, held = turn.routing, traj.received
        if start == 0 and traj.routing is not None:
            if turn.token_versions is not None or turn.weight_version != traj.token_versions[-1]:
                if turn.token_versions is not None:
                    raise ResponseError("weight_versions: a weight update landed while the "
                                        "request ran; moe_rl aborts requests before it updates "
                                        "weights, so their routing cannot be told apart")
                # the observation after the last model turn was first computed now: its
                # tokens open the new version's segment, whose prefix is what the old one held
                traj.token_versions[traj.model_end:] = [turn.weight_version] * (
                    len(traj.ids) - traj.model_end)
                traj.segment_routing.append(rows[:held])
            elif turn.cached_tokens < held:
                traj.routing = torch.cat([traj.routing[:turn.cached_tokens],
                                          rows[turn.cached_tokens:held]])
                refetched = 1
            rows = rows[held:]
        elif turn.cached_tokens < held:   # earlier positions were recomputed
            rows = await _refetch_routing(session, server, ids + turn.output_ids, turn, traj,
                                          rows)
            traj.routing = traj.routing[:turn.cached_tokens]
            refetched = 1
        traj.routing = rows if traj.routing is None else torch.cat([traj.routing, rows])
    traj.add_model(turn)
    return refetched


async def run_trajectory(engine: Engine, session: EngineSession, server: int, env, record,
                         sampling: SamplingConfig, limits: TrajectoryLimits, seed: int | None,
                         vocab_size: int, stats: TrajectoryStats, **sample_kw) -> Sample:
    """One trajectory of ``env`` from prompt ``record``, every turn on ``server``; EnvError
    when the environment fails or answers badly. A turn aborted from outside is continued."""
    episode = Episode(engine, env, record, sampling, limits, seed, vocab_size, server)
    while not await episode.advance(session):
        pass
    s = episode.sample(**sample_kw)
    stats.count(s)
    return s


def rollout_trajectories(engine: Engine, env_factory, records: list, n: int,
                         sampling: SamplingConfig,
                         limits: TrajectoryLimits, vocab_size: int, *,
                         group_ids: list[int], seed: int | None = None,
                         stats: TrajectoryStats | None = None
                         ) -> tuple[list[Sample], TrajectoryStats]:
    """``n`` trajectories per prompt record (environments from ``env_factory()``), in
    prompt-major order. A trajectory whose environment fails is dropped, counted and its first
    reason logged; the others keep their ``sample_id`` (position in that order). Counts are
    added to ``stats`` (a new one when None), which is returned with the samples."""
    stats = stats if stats is not None else TrajectoryStats()
    jobs = [(i, j) for i in range(len(records)) for j in range(n)]

    async def one(session: EngineSession, k: int, i: int):
        server = k % session.num_servers   # every turn on the same server
        try:
            env = await env_call("environment", env_factory, timeout_s=limits.env_timeout_s)
            return await run_trajectory(
                engine, session, server, env, records[i], sampling, limits,
                None if seed is None else seed + k * limits.max_turns, vocab_size, stats,
                group_id=group_ids[i], sample_id=k)
        except EnvError as exc:
            stats.dropped(exc)
            return None

    async def all_jobs(session: EngineSession):
        return await asyncio.gather(*(one(session, k, i) for k, (i, _) in enumerate(jobs)))

    samples = [s for s in engine.run(all_jobs) if s is not None]
    return samples, stats
