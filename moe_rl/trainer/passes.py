"""The no-grad passes of an RL step, each routed as the :class:`ReplayPlan` decided: pi_old
(with the routing agreement and, under R2, the routing the update will replay), the frozen
reference's, and, in the asynchronous pipeline, each stale sample's score at its own weight
version; then the batch-wide inputs of the loss (advantages, corrections) over the data-parallel
group. A new pass (a critic's values, a teacher's log-probs) is added here."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from moe_rl.algo import kept_set_sizes
from moe_rl.config import Config, probe_temperature
from moe_rl.trainer.packing import MicroBatch
from moe_rl.trainer.dp import dp_group, dp_max, every_rank_sum
from moe_rl.trainer.forwarder import Forwarder
from moe_rl.trainer.loss import PolicyLoss
from moe_rl.trainer.replay import ReplayController
from moe_rl.trainer.replay_plan import ReplayPlan, Route
from moe_rl.trainer.router_rows import micro_batch_rows, response_rows
from moe_rl.trainer.step import (StepRows, gather_rows, sample_notes, step_inputs,
                                 version_metrics)
from moe_rl.trainer.versions import WeightVersions
from moe_rl.rollout_record import Sample, compact_routing


def pad_rows(rows: list[torch.Tensor], fill: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into [N, max_len]."""
    width = max((int(r.numel()) for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r.to(dtype)
    return out


@dataclass
class StepBatch:
    """Response-aligned [N, R_max] tensors of this rank's samples (sample order)."""
    samples: list[Sample]
    mask: torch.Tensor
    lp_roll: torch.Tensor
    lp_trainer: torch.Tensor
    entropy: torch.Tensor
    lp_old: torch.Tensor
    lp_ref: torch.Tensor | None
    weights: torch.Tensor
    keep: torch.Tensor
    advantages: torch.Tensor
    replay_samples: list[Sample]   # the samples with the routing the update replays (or,
                                   # routing freely, reads the router-shift weight at)
    router_old: torch.Tensor | None = None   # [N, R_max, L, K] router log-scores at pi_old of
                                             # the experts pi_old activated (router shift)


class PolicyForward:
    """One model's no-grad forwards as the passes use them: the forwarder, the model and its
    replay controller, and what its routers recorded in the last forward (the agreement with
    the engine's routing, the routing per sample)."""

    def __init__(self, fw: Forwarder, model, replay: ReplayController, num_experts: int,
                 sequence_parallel: bool):
        self.fw, self.model, self.replay = fw, model, replay
        self.num_experts, self.sequence_parallel = num_experts, sequence_parallel

    def forward(self, mb: MicroBatch, route, **kwargs):
        return self.fw.forward(self.model, self.replay, mb, route, **kwargs)

    def dummy(self) -> None:
        self.fw.dummy_forward(self.model, self.replay)

    def router_rows(self, mb: MicroBatch) -> torch.Tensor:
        """The router log-scores of the last forward, per response token (router shift)."""
        return response_rows(micro_batch_rows(self.replay.router_scores(), mb, self.fw,
                                              self.sequence_parallel), mb)

    def agreement_rows(self, mb: MicroBatch, route: Route, counted: torch.Tensor
                       ) -> tuple[dict, dict]:
        """The routing agreement of the last forward of ``mb`` (routed as ``route``) with the
        engine's, over the positions of the samples ``counted`` [N] and over the others: two
        position-weighted rows for :meth:`StepPasses._agreement_metrics`."""
        B, S = mb.input_ids.shape
        cp = self.fw.cp_positions(mb)
        valid = self.replay.local_rows(mb.routing_valid_router_order(), S, B, cp)
        mine = self.replay.local_rows(mb.sample_positions(counted).t().reshape(-1), S, B, cp)
        trainer = None if route is Route.REPLAY else self.replay.recorded()
        engine = self.replay.local_indices(mb.replay_indices(), S, B, cp)
        out = []
        for rows in (valid & mine, valid & ~mine):
            out.append({"w": float(rows.sum()),
                        **self.replay.agreement(engine, rows, trainer=trainer)})
        return out[0], out[1]

    def per_sample_routing(self, samples: list[Sample], mb: MicroBatch
                           ) -> dict[int, torch.Tensor]:
        """The routing this rank's routers recorded in the last forward of ``mb``, cut into
        one [routed positions, MoE layers, K] record per sample (as the rollout's), so any later
        micro- or mini-batch plan can replay it (R2)."""
        per = micro_batch_rows(self.replay.recorded(), mb, self.fw, self.sequence_parallel)
        out = {}
        for i, row in enumerate(mb.sample_indices):
            b, o = int(mb.sample_rows[i]), int(mb.sample_starts[i])
            out[row] = compact_routing(per[o:o + samples[row].routed_positions, b].long(),
                                       self.num_experts)
        return out


class PiOldPass:
    """pi_old: the policy's log-probs and entropy, routed as the plan routes pi_old; beside each
    forward, the routing agreement with the engine (samples at the current version, and the
    stale ones' lag), the router log-scores at the experts pi_old activated (router shift) and
    the routing it chose, which the update replays (R2)."""

    def __init__(self, policy: PolicyForward, routes: ReplayPlan, router_scores: bool,
                 asynchronous: bool, samples: list[Sample], step: int, width: int):
        self.policy, self.samples, self.step = policy, samples, step
        self.asynchronous = asynchronous   # stale samples are counted apart
        self.route = routes.pi_old
        self.lp = torch.zeros(len(samples), width)
        self.entropy = torch.zeros_like(self.lp)
        self.router_old: torch.Tensor | None = None   # [N, R_max, L, K] (router shift)
        self.agree_rows: list[dict] = []   # routing agreement at the samples' own versions
        self.lag_rows: list[dict] = []     # stale samples against the current version
        self.scores = router_scores
        # R2 (and the router shift routing freely) keep what pi_old chose, per sample
        self.capture = routes.update_replays_pi_old or (
            self.scores and routes.update is Route.OFF)
        self.chosen: dict[int, torch.Tensor] = {}

    def dummy(self) -> None:
        self.policy.dummy()

    def forward(self, mb: MicroBatch) -> None:
        policy, rows = self.policy, mb.sample_indices
        lp, e = policy.forward(mb, self.route, collect_own=mb.routing is not None,
                               router_scores=self.scores)
        width = int(mb.response_lens.max())
        if self.scores:
            old = policy.router_rows(mb)
            if self.router_old is None:
                self.router_old = old.new_zeros((len(self.samples), self.lp.shape[1],
                                                 *old.shape[2:]))
            self.router_old[rows, :width] = old
        self.lp[rows, :width] = mb.to_response_padded(lp.float())
        self.entropy[rows, :width] = mb.to_response_padded(e.float())
        if mb.routing is not None:   # fresh samples: same version; stale ones: the lag
            fresh = torch.tensor([not self.asynchronous
                                  or self.samples[i].weight_version >= self.step for i in rows])
            same, lag = policy.agreement_rows(mb, self.route, fresh)
            self.agree_rows.append(same)
            self.lag_rows.append(lag)
        if self.capture:
            self.chosen.update(policy.per_sample_routing(self.samples, mb))

    def replay_samples(self) -> list[Sample]:
        """The samples with the routing the update replays (R2) or reads the router shift at
        (replay off): what pi_old chose; else the samples as they came."""
        if not self.capture:
            return self.samples
        return [dataclasses.replace(s, routing=self.chosen[i]) for i, s in enumerate(self.samples)]


class ReferencePass:
    """The frozen reference's log-probs (KL), routed as the plan routes the reference."""

    def __init__(self, reference: PolicyForward, route: Route, n: int, width: int):
        self.reference, self.route = reference, route
        self.lp = torch.zeros(n, width)

    def dummy(self) -> None:
        self.reference.dummy()

    def forward(self, mb: MicroBatch) -> None:
        route = ReplayPlan.for_batch(self.route, mb.routing is not None)
        lp, _ = self.reference.forward(mb, route)
        self.lp[mb.sample_indices, :int(mb.response_lens.max())] = mb.to_response_padded(
            lp.float())


class OwnVersionPass:
    """The asynchronous pipeline's same-version score, token by token: every response token
    sampled by an older weight version is scored again by the trainer with that version's
    weights, so ``mismatch/*`` compares engine and trainer at one version and ``staleness/*``
    shows the policy lag. A response that a weight update interrupted (partial rollouts) is
    scored segment by segment: each version's tokens at that version, routed as that version's
    engine routed them (:meth:`Sample.segment_view`; R3 replays it, as the plan routes
    ``own_version``). Tokens whose version is no longer held (older than
    ``rollout.max_staleness``) are left out. Every rank walks the same versions with aligned
    micro-batches (expert-parallel collectives)."""

    def __init__(self, policy: PolicyForward, versions: WeightVersions, route: Route,
                 max_staleness: int):
        self.policy, self.versions, self.route = policy, versions, route
        self.max_staleness = max_staleness

    def run(self, samples: list[Sample], lp_tr: torch.Tensor, step: int,
            agree_rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-probs at each token's version [N, R], scored [N, R], stale [N, R]); the routing
        agreement of these forwards is appended to ``agree_rows``."""
        policy = self.policy
        lp_same = lp_tr.clone()
        versions = token_versions(samples, lp_tr.shape[1], step)
        held = lambda v: v == step or self.versions.has(v)   # noqa: E731
        scored = torch.zeros_like(versions, dtype=torch.bool)
        for v in versions.unique().tolist():
            scored |= (versions == v) & held(v)
        for v in range(step - self.max_staleness, step + 1):
            # pi_old already scored, exactly, the samples wholly at the current version
            jobs = [(i, k, first, end) for i, s in enumerate(samples)
                    for k, (u, first, end) in enumerate(s.segments())
                    if u == v and (v < step or first > 0 or end < s.response_len)
                    ] if held(v) else []
            if not dp_max(len(jobs)):
                continue
            views = [samples[i].segment_view(k) for i, k, _, _ in jobs]
            with contextlib.ExitStack() as stack:
                if jobs and v < step:
                    stack.enter_context(self.versions.weights_of(v))
                fw = policy.fw
                for mb in fw.aligned(fw.micro_batches(views, list(range(len(views))))):
                    if mb is None:
                        policy.dummy()
                        continue
                    route = ReplayPlan.for_batch(self.route, mb.routing is not None)
                    lp, _ = policy.forward(mb, route, collect_own=mb.routing is not None)
                    if mb.routing is not None:
                        agree_rows.append(policy.agreement_rows(
                            mb, route, torch.ones(len(mb.sample_indices), dtype=torch.bool))[0])
                    padded = mb.to_response_padded(lp.float())
                    for row, j in enumerate(mb.sample_indices):
                        i, _, first, end = jobs[j]
                        lp_same[i, first:end] = padded[row, first:end]
        return lp_same, scored, versions < step


def token_versions(samples: list[Sample], width: int, step: int) -> torch.Tensor:
    """[N, width] the weight version that sampled each response token (padding: ``step``)."""
    out = torch.full((len(samples), width), step, dtype=torch.long)
    for i, s in enumerate(samples):
        out[i, :s.response_len] = s.versions()
    return out


class StepPasses:
    """The step's no-grad passes over the policy (and the reference, when KL is on): one
    object per pass (:class:`PiOldPass`, :class:`ReferencePass`, :class:`OwnVersionPass`),
    then the batch-wide loss inputs."""

    def __init__(self, cfg: Config, fw: Forwarder, model, replay: ReplayController,
                 ref_model, ref_replay: ReplayController | None, routes: ReplayPlan,
                 loss: PolicyLoss, versions: WeightVersions | None, vocab_size: int, moe_shape):
        self.cfg, self.fw, self.routes, self.loss = cfg, fw, routes, loss
        self.model, self.replay = model, replay
        experts = moe_shape.num_experts if moe_shape is not None else 0
        sp = cfg.trainer.parallel.sequence
        self.policy = PolicyForward(fw, model, replay, experts, sp)
        self.reference = (PolicyForward(fw, ref_model, ref_replay, experts, sp)
                          if ref_model is not None else None)
        self.versions = versions
        self.vocab_size, self.moe_shape = vocab_size, moe_shape
        self.notes: list[dict] = []   # the last step's sample notes (for samples.jsonl)

    def _check(self, samples: list[Sample]) -> None:
        for s in samples:
            s.validate(self.vocab_size, self.moe_shape if s.routing is not None else None)
        if self.routes.replays_engine and any(s.routing is None for s in samples):
            raise ValueError("algorithm.replay=r3 but a sample has no routing: start SGLang with "
                             "--enable-return-routed-experts (the reference engine always "
                             "returns it when asked)")

    def run(self, samples: list[Sample], step: int) -> tuple[StepBatch, dict[str, float]]:
        """The passes of step ``step`` on this rank's ``samples``: each micro-batch through
        pi_old's pass and the reference's, stale samples at their own versions, then
        advantages, corrections and the step's metrics."""
        self._check(samples)
        mask = pad_rows([s.loss_mask for s in samples], dtype=torch.bool)
        lp_roll = pad_rows([s.rollout_logprobs for s in samples])
        pi_old = PiOldPass(self.policy, self.routes, self.cfg.algorithm.router_shift.enabled,
                           self.versions is not None, samples, step, lp_roll.shape[1])
        ref = (ReferencePass(self.reference, self.routes.reference, len(samples),
                             lp_roll.shape[1]) if self.reference is not None else None)
        per_batch = [pi_old] + ([ref] if ref is not None else [])
        self.model.eval()
        for mb in self.fw.aligned(self.fw.micro_batches(samples, list(range(len(samples))))):
            for one in per_batch:
                one.dummy() if mb is None else one.forward(mb)
        metrics: dict[str, float] = {}
        lp_same = scored = stale = None
        if self.versions is not None:
            own = OwnVersionPass(self.policy, self.versions, self.routes.own_version,
                                 self.cfg.rollout.max_staleness)
            lp_same, scored, stale = own.run(samples, pi_old.lp, step, pi_old.agree_rows)
            metrics.update({k.replace("routing/", "staleness/routing_"): v for k, v in
                            self._agreement_metrics(pi_old.lag_rows).items()
                            if k in ("routing/agreement", "routing/token_differs_frac")})
        metrics.update(self._agreement_metrics(pi_old.agree_rows))
        local = self._rows(samples, mask, lp_roll, pi_old, ref, lp_same, scored, stale)
        rows_all, mine = gather_rows(local, dp_group())
        inputs = step_inputs(self.cfg.algorithm, rows_all, deferred=self.loss.live,
                             generator=self.loss.generator)
        metrics.update(inputs.metrics)
        self.notes = sample_notes(rows_all, inputs, self.cfg.logging.samples_per_step)
        if self.versions is not None and rows_all.weight_versions.numel():
            metrics.update(version_metrics(rows_all, step))
        own = lambda t: None if t is None else t[mine]   # noqa: E731  (this rank's rows)
        return StepBatch(samples, own(rows_all.mask), own(rows_all.lp_roll),
                         own(rows_all.lp_tr), own(rows_all.entropy), own(inputs.lp_old),
                         own(rows_all.lp_ref), own(inputs.weights), own(inputs.keep),
                         own(inputs.advantages), pi_old.replay_samples(),
                         pi_old.router_old), metrics

    def _rows(self, samples: list[Sample], mask: torch.Tensor, lp_roll: torch.Tensor,
              pi_old: PiOldPass, ref: ReferencePass | None, lp_same, scored, stale) -> StepRows:
        """This rank's rows of the step: the samples' own fields and the passes' results."""
        passes = None
        if samples and all(s.pass_logprobs is not None for s in samples):
            passes = torch.stack([pad_rows([s.pass_logprobs[j] for s in samples])
                                  for j in range(samples[0].pass_logprobs.shape[0])])
        has_mass = bool(samples) and all(s.kept_logmass is not None for s in samples)
        kept = self._kept(samples)
        return StepRows(
            mask=mask, lp_roll=lp_roll, lp_tr=pi_old.lp, entropy=pi_old.entropy,
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            groups=torch.tensor([s.group_id for s in samples], dtype=torch.long),
            weight_versions=torch.tensor([s.weight_version for s in samples], dtype=torch.long),
            sample_ids=torch.tensor([s.sample_id for s in samples], dtype=torch.long),
            lp_ref=ref.lp if ref is not None else None, passes=passes, lp_same=lp_same,
            same_scored=scored, stale=stale,
            token_versions=None if self.versions is None
            else token_versions(samples, mask.shape[1], -1),
            kept_logmass=pad_rows([s.kept_logmass for s in samples]) if has_mass else None,
            kept_sizes=pad_rows(kept, dtype=torch.long) if kept is not None else None)

    def probe(self, samples: list[Sample]) -> list[tuple[list[float], list | None]]:
        """The weight check's trainer side (``rollout.weight_check``): per probe sample, the
        log-probs of its response under the current weights, routed by the trainer's own
        routers (nothing replayed: the engine scores them with its own), as pi_theta is scored,
        and the routing those routers chose ([routed positions, MoE layers, K], as the
        rollout's, as nested lists; None for a model without MoE layers). Every trainer rank
        enters, with or without samples (the forward's collectives)."""
        self.model.eval()
        out: dict[int, tuple] = {}
        moe = self.moe_shape is not None and bool(self.replay.layer_names)
        for mb in self.fw.aligned(self.fw.micro_batches(samples, list(range(len(samples))))):
            if mb is None:
                self.fw.dummy_forward(self.model, self.replay)
                continue
            lp, _ = self.fw.forward(self.model, self.replay, mb,
                                    Route.RECORD if moe else Route.OFF, collect_own=moe,
                                    temperature=probe_temperature(self.cfg))
            padded = mb.to_response_padded(lp.float())
            routing = self.policy.per_sample_routing(samples, mb) if moe else {}
            for row, i in enumerate(mb.sample_indices):
                chosen = routing.get(i)
                out[i] = (padded[row, :samples[i].response_len].tolist(),
                          None if chosen is None else chosen.tolist())
        return [out[i] for i in range(len(samples))]

    def _agreement_metrics(self, agree_rows: list[dict]) -> dict[str, float]:
        """routing/agreement (+ per layer) over the whole batch: position-weighted sums
        all-reduced over every trainer rank (each enters, with or without rows): data-parallel
        ranks hold other samples, sequence-parallel and context-parallel ranks other positions
        of them (a data-parallel reduction counted only rank 0's slice: under sequence
        parallelism the first 1/TP of each micro-batch's positions, mostly prompt)."""
        keys = ["routing/agreement", "routing/token_differs_frac"] + [
            f"routing/agreement_layer_{n}" for n in self.replay.layer_names]
        sums = [sum(r["w"] for r in agree_rows)] + [
            sum(r.get(k, 0.0) * r["w"] for r in agree_rows) for k in keys]
        total, *values = every_rank_sum(sums)
        return {k: v / total for k, v in zip(keys, values)} if total > 0 else {}

    @staticmethod
    def _kept(samples: list[Sample]) -> list[torch.Tensor] | None:
        """Kept-set size of every response token, one row per sample."""
        if not samples or any(s.sampling_mask_offsets is None for s in samples):
            return None
        return [kept_set_sizes(s.sampling_mask_offsets) for s in samples]
