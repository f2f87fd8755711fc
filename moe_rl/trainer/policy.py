"""The training step: pi_old, corrections, KL reference, mini-batch updates with routing replay,
megatron-core's optimizer and LR schedule, EMA, checkpoints and HF export.

One :class:`PolicyTrainer` per trainer rank. ``train_step`` receives this rank's share of the
batch (whole prompt groups), computes advantages, and returns the step's metrics.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.algo import (Normalisers, aggregate, collapse_guard, count_normalisers,
                         kept_set_sizes)
from moe_rl.config import Config, response_cap
from moe_rl.packing import MicroBatch, pack_one, plan_micro_batches
from moe_rl.trainer.cpu_compat import cuda_factories_on_cpu, cuda_absent
from moe_rl.trainer.forward import forward_logprobs, unwrap
from moe_rl.trainer.loss import LossInputs, PolicyLoss
from moe_rl.weights.hf import (exporting_rank, iter_hf_buckets,
                                       load_hf_into_megatron, save_hf_checkpoint)
from moe_rl.trainer.model_builder import build_model
from moe_rl.trainer.parallel import ParallelSizes
from moe_rl.trainer.replay import ReplayController
from moe_rl.trainer.replay_plan import ReplayPlan, Route
from moe_rl.trainer.sharded_state import load_sharded, optimizer_step_count, save_sharded
from moe_rl.trainer.step import StepRows, gather_rows, reduce_sums, step_inputs
from moe_rl.trainer.versions import WeightVersions
from moe_rl.types import MODEL_DTYPES, Sample, compact_routing



def _pad_rows(rows: list[torch.Tensor], fill: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into [N, max_len]."""
    width = max((int(r.numel()) for r in rows), default=0)
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :r.numel()] = r.to(dtype)
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _numpy_rng_state() -> dict:
    """numpy's global RNG state as tensors and numbers (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached": float(cached)}


def _numpy_rng_tuple(state: dict) -> tuple:
    """Inverse of :func:`_numpy_rng_state`."""
    return (state["name"], state["keys"].numpy().astype(np.uint32), state["pos"],
            state["has_gauss"], state["cached"])


def _dp_group():
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group() if ps.get_data_parallel_world_size() > 1 else None


def _dp_max(value: int) -> int:
    """The largest ``value`` of any data-parallel rank."""
    t = torch.tensor([value], dtype=torch.long)
    group = _dp_group()
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def _dp_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    group = _dp_group()
    if group is not None:
        dist.all_reduce(t, group=group)
    return t.tolist()


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
    replay_samples: list[Sample]   # the samples with the routing the update replays


def finalize_grads(model) -> None:
    """megatron-core's ``finalize_model_grads`` after the backward passes of an optimizer step:
    the data-parallel reduction, plus the all-reduce of gradients that tensor-parallel ranks hold
    as replicas (layer norms, q/k norms and, under sequence parallelism, the router), which
    ``finish_grad_sync`` alone leaves per-rank. The loss is already normalised by global counts,
    so no token count is passed. With DeepSeek-V3 routers it also applies megatron's expert-bias
    update (``trainer.expert_bias_update_rate``; 0 leaves the bias as it is) from the tokens
    per expert counted in this step's training forwards, then clears the counts, so each update
    sees one optimizer step's tokens."""
    from megatron.core.distributed import finalize_model_grads
    finalize_model_grads([model])
    for name, counts in model.named_buffers():
        if name.endswith("router.local_tokens_per_expert"):
            counts.zero_()


class PolicyTrainer:
    """The policy (and optional frozen reference) on this rank, built from ``hf_path``."""

    def __init__(self, cfg: Config, hf_path: str):
        from megatron.core.distributed import DistributedDataParallel, \
            DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        self.cfg = cfg
        self.hf_path = hf_path
        t = cfg.trainer
        sizes = ParallelSizes(t.tensor_parallel, t.pipeline_parallel, t.expert_parallel,
                              t.context_parallel)
        dtype = MODEL_DTYPES[cfg.model.dtype]
        model, self.spec = build_model(hf_path, sizes=sizes, dtype=dtype,
                                       sequence_parallel=t.sequence_parallel,
                                       recompute=t.recompute_activations,
                                       expert_bias_update_rate=t.expert_bias_update_rate)
        load_hf_into_megatron(model, self.spec, hf_path)
        facts = self.spec.facts
        self.moe_shape = facts
        self.replay = ReplayController(model, facts.moe_layers, facts.topk, facts.num_experts,
                                       recompute=t.recompute_activations)
        self.routes = ReplayPlan.from_algorithm(cfg.algorithm)   # each pass's routing
        use_dist_opt = t.distributed_optimizer and not cuda_absent()
        self.model = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(
                use_distributed_optimizer=use_dist_opt, grad_reduce_in_fp32=True), model)
        with cuda_factories_on_cpu():
            self.optimizer = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
                adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, clip_grad=t.grad_clip,
                bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype,
                use_distributed_optimizer=use_dist_opt), [self.model])
        decay_steps = max(t.steps * t.epochs * t.mini_batches, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if t.lr_warmup_steps else t.lr, max_lr=t.lr,
            min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_steps,
            lr_decay_steps=max(decay_steps, t.lr_warmup_steps + 1),
            lr_decay_style=t.lr_schedule, start_wd=t.weight_decay, end_wd=t.weight_decay,
            wd_incr_steps=decay_steps, wd_incr_style="constant")
        self.ref_model = self.ref_replay = None
        if cfg.algorithm.kl.coef > 0:
            ref, _ = build_model(hf_path, sizes=sizes, dtype=dtype,
                                 sequence_parallel=t.sequence_parallel)
            load_hf_into_megatron(ref, self.spec, hf_path)
            ref.eval()
            for p in ref.parameters():
                p.requires_grad_(False)
            self.ref_model = ref
            self.ref_replay = ReplayController(ref, facts.moe_layers, facts.topk,
                                               facts.num_experts)
        self.ema = None
        if t.ema_decay is not None:
            self.ema = {n: p.detach().clone().float() for n, p in model.named_parameters()}
        self._dummy_mb: MicroBatch | None = None
        self.step = 0
        # the asynchronous pipeline scores stale samples at their own version as well
        self.versions = WeightVersions(model, cfg.rollout.max_staleness) \
            if cfg.rollout.max_staleness > 0 else None
        self.guard_skipped_total = 0
        self.generator = torch.Generator().manual_seed(t.seed)
        self.loss = PolicyLoss(cfg.algorithm, self.generator)
        self.bucket_bytes = max(1, int(cfg.cluster.weight_sync_bucket_mb * (1 << 20)))

    # ------------------------------------------------------------------ micro-batches
    def _micro_batches(self, samples: list[Sample], indices: list[int]) -> list[MicroBatch]:
        lengths = [samples[i].prompt_len + samples[i].response_len for i in indices]
        plan = plan_micro_batches(lengths, micro_batch_size=self.cfg.trainer.micro_batch_size)
        # sequence parallelism splits the sequence over the TP ranks: pad to a multiple of TP
        t = self.cfg.trainer
        multiple = t.tensor_parallel if t.sequence_parallel else 1
        return [pack_one(samples, [indices[j] for j in group], pad_token_id=0,
                         num_experts=self.spec.facts.num_experts, pad_to_multiple=multiple)
                for group in plan]

    def _aligned(self, mbs: list[MicroBatch]) -> list[MicroBatch | None]:
        """``mbs`` padded with None (a dummy micro-batch) to the largest count of any
        data-parallel rank: expert-parallel dispatch runs collectives in every forward and
        backward, so every rank must run as many, with or without work."""
        return mbs + [None] * (_dp_max(len(mbs)) - len(mbs))

    def _dummy(self) -> MicroBatch:
        """A one-token micro-batch whose loss is multiplied by 0 (for ranks with less work)."""
        if self._dummy_mb is None:
            keep = self.cfg.algorithm.keep_sampling_mask
            s = Sample(prompt_ids=[0], response_ids=[0], rollout_logprobs=[0.0],
                       loss_mask=[False], sampling_mask_offsets=[0, 1] if keep else None,
                       sampling_mask_ids=[0] if keep else None)
            self._dummy_mb = self._micro_batches([s], [0])[0]
        return self._dummy_mb

    def _dummy_forward(self, model, replay: ReplayController, grad: bool = False) -> None:
        """Enter the forward's (and, with ``grad``, the backward's) collectives with no work."""
        lp, _ = self._forward(model, replay, self._dummy(), Route.OFF, grad=grad)
        if grad:
            (lp.sum() * 0.0).backward()

    def _forward(self, model, replay: ReplayController, mb: MicroBatch, mode: Route,
                 grad: bool = False, collect_own: bool = False, kept_sets: bool = True):
        """Forward one micro-batch routed as ``mode`` (see :class:`Route`). ``kept_sets=False`` scores on the
        full vocabulary even with ``keep_sampling_mask`` (supervised samples have no kept sets)."""
        a = self.cfg.algorithm
        shape = mb.shape
        run = mb.padded_to(*self._ep_common_shape(shape), self.spec.facts.num_experts)
        B, S = run.shape
        if mode is Route.REPLAY:
            if mb.routing is None:
                raise ValueError("algorithm.replay=r3: the rollout carries no routing (start "
                                 "SGLang with --enable-return-routed-experts)")
            replay.replay(replay.local_indices(run.replay_indices(), S, B),
                          collect_own=collect_own)
        elif mode is Route.RECORD:
            replay.record()
        else:
            replay.off()
        with torch.set_grad_enabled(grad):
            lp, ent = forward_logprobs(model, run, temperature=self.cfg.rollout.temperature or 1.0,
                                       use_kept_sets=a.keep_sampling_mask and kept_sets,
                                       fp32_output_layer=self.cfg.model.fp32_output_layer)
        replay.finish_forward()
        if run is not mb:
            replay.crop(run.shape, shape)
            lp, ent = lp[:shape[0], :shape[1]], ent[:shape[0], :shape[1]]
        return lp, ent

    def _ep_common_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The [rows, positions] every rank of the expert-parallel group forwards: with
        megatron's allgather token dispatcher (CPU) the group gathers hidden states, so all its
        micro-batches must have one shape (the largest, others padded); else ``shape``."""
        from megatron.core import parallel_state as ps
        config = unwrap(self.model).config
        if (config.moe_token_dispatcher_type != "allgather"
                or ps.get_expert_tensor_and_model_parallel_world_size() == 1):
            return shape
        t = torch.tensor(shape, dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX,
                        group=ps.get_expert_tensor_and_model_parallel_group())
        return int(t[0]), int(t[1])

    # ------------------------------------------------------------------ step
    def prepare(self, samples: list[Sample]) -> tuple[StepBatch, dict[str, float]]:
        """pi_old / reference passes, advantages, corrections and the step's metrics."""
        a = self.cfg.algorithm
        for s in samples:
            s.validate(self.spec.vocab_size, self.moe_shape if s.routing is not None else None)
        if a.replay == "r3" and any(s.routing is None for s in samples):
            raise ValueError("algorithm.replay=r3 but a sample has no routing: start SGLang with "
                             "--enable-return-routed-experts (the reference engine always "
                             "returns it when asked)")
        n = len(samples)
        mask = _pad_rows([s.loss_mask for s in samples], dtype=torch.bool)
        lp_roll = _pad_rows([s.rollout_logprobs for s in samples])
        lp_tr = torch.zeros_like(lp_roll)
        ent = torch.zeros_like(lp_roll)
        lp_ref = torch.zeros_like(lp_roll) if self.ref_model is not None else None
        metrics: dict[str, float] = {}
        agree_rows: list[dict] = []
        r2_routing: dict[int, torch.Tensor] = {}
        self.model.eval()
        for mb in self._aligned(self._micro_batches(samples, list(range(n)))):
            if mb is None:
                self._dummy_forward(self.model, self.replay)
                if self.ref_model is not None:
                    self._dummy_forward(self.ref_model, self.ref_replay)
                continue
            lp, e = self._forward(self.model, self.replay, mb, self.routes.pi_old,
                                  collect_own=mb.routing is not None)
            rows = mb.sample_indices
            width = int(mb.response_lens.max())
            lp_tr[rows, :width] = mb.to_response_padded(lp.float())
            ent[rows, :width] = mb.to_response_padded(e.float())
            if mb.routing is not None:
                B, S = mb.input_ids.shape
                valid = self.replay.local_rows(mb.routing_valid_router_order(), S, B)
                trainer = None if self.routes.pi_old is Route.REPLAY else \
                    self.replay.recorded()
                engine = self.replay.local_indices(mb.replay_indices(), S, B)
                agree_rows.append({"w": float(valid.sum()),
                                   **self.replay.agreement(engine, valid, trainer=trainer)})
            if a.replay == "r2":
                r2_routing.update(self._per_sample_routing(samples, mb))
            if self.ref_model is not None:
                lr_, _ = self._forward(self.ref_model, self.ref_replay, mb, ReplayPlan.for_batch(
                    self.routes.reference, mb.routing is not None))
                lp_ref[rows, :width] = mb.to_response_padded(lr_.float())
        metrics.update(self._agreement_metrics(agree_rows))
        lp_same = scored = stale = None
        if self.versions is not None:
            lp_same, scored, stale = self._score_at_own_versions(samples, lp_tr)
        passes = None
        if samples and all(s.pass_logprobs is not None for s in samples):
            passes = torch.stack([_pad_rows([s.pass_logprobs[j] for s in samples])
                                  for j in range(samples[0].pass_logprobs.shape[0])])
        has_mass = bool(samples) and all(s.kept_logmass is not None for s in samples)
        kept = self._kept(samples)
        local = StepRows(
            mask=mask, lp_roll=lp_roll, lp_tr=lp_tr, entropy=ent,
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            groups=torch.tensor([s.group_id for s in samples], dtype=torch.long),
            weight_versions=torch.tensor([s.weight_version for s in samples], dtype=torch.long),
            lp_ref=lp_ref, passes=passes, lp_same=lp_same, same_scored=scored, stale=stale,
            kept_logmass=_pad_rows([s.kept_logmass for s in samples]) if has_mass else None,
            kept_sizes=_pad_rows(kept, dtype=torch.long) if kept is not None else None)
        rows_all, mine = gather_rows(local, _dp_group())
        inputs = step_inputs(a, rows_all, deferred=self.loss.live,
                             generator=self.generator)
        metrics.update(inputs.metrics)
        if self.versions is not None and rows_all.weight_versions.numel():
            lag = (self.step - rows_all.weight_versions).clamp(min=0).double()
            metrics["rollout/staleness_mean"] = float(lag.mean())
            metrics["rollout/staleness_max"] = float(lag.max())
        replay_samples = samples
        if a.replay == "r2":   # the update replays, per sample, what the pi_old pass chose
            replay_samples = [dataclasses.replace(s, routing=r2_routing[i])
                              for i, s in enumerate(samples)]
        own = lambda t: None if t is None else t[mine]   # noqa: E731  (this rank's rows)
        return StepBatch(samples, own(rows_all.mask), own(rows_all.lp_roll),
                         own(rows_all.lp_tr), own(rows_all.entropy), own(inputs.lp_old),
                         own(rows_all.lp_ref), own(inputs.weights), own(inputs.keep),
                         own(inputs.advantages), replay_samples), metrics

    def _score_at_own_versions(self, samples: list[Sample], lp_tr: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The asynchronous pipeline's same-version score: each sample generated from an older
        weight version is scored again by the trainer with that version's weights (R3 replays
        its routing), so ``mismatch/*`` compares engine and trainer at one version and
        ``staleness/*`` shows the policy lag. Returns (log-probs at the sample's version,
        scored [N], stale [N]); a sample whose version is no longer held (older than
        ``rollout.max_staleness``) is left out of both. Every rank walks the same versions
        with aligned micro-batches (expert-parallel collectives)."""
        lp_same = lp_tr.clone()
        versions = [s.weight_version for s in samples]
        stale = torch.tensor([v < self.step for v in versions], dtype=torch.bool)
        scored = torch.tensor([v == self.step or (v < self.step and self.versions.has(v))
                               for v in versions], dtype=torch.bool)
        for v in range(self.step - self.cfg.rollout.max_staleness, self.step):
            rows = [i for i, u in enumerate(versions) if u == v] if self.versions.has(v) else []
            if not _dp_max(len(rows)):
                continue
            with contextlib.ExitStack() as stack:
                if rows:
                    stack.enter_context(self.versions.weights_of(v))
                for mb in self._aligned(self._micro_batches(samples, rows)):
                    if mb is None:
                        self._dummy_forward(self.model, self.replay)
                        continue
                    lp, _ = self._forward(self.model, self.replay, mb, ReplayPlan.for_batch(
                        self.routes.own_version, mb.routing is not None))
                    width = int(mb.response_lens.max())
                    lp_same[mb.sample_indices, :width] = mb.to_response_padded(lp.float())
        return lp_same, scored, stale

    def _agreement_metrics(self, agree_rows: list[dict]) -> dict[str, float]:
        """routing/agreement (+ per layer) over the whole batch: position-weighted sums
        all-reduced over the data-parallel group (every rank enters, with or without rows)."""
        keys = ["routing/agreement", "routing/token_differs_frac"] + [
            f"routing/agreement_layer_{n}" for n in self.replay.layer_names]
        sums = [sum(r["w"] for r in agree_rows)] + [
            sum(r.get(k, 0.0) * r["w"] for r in agree_rows) for k in keys]
        total, *values = _dp_sum(sums)
        return {k: v / total for k, v in zip(keys, values)} if total > 0 else {}

    def _per_sample_routing(self, samples: list[Sample], mb: MicroBatch
                            ) -> dict[int, torch.Tensor]:
        """R2: the routing this rank's routers recorded in the last forward of ``mb``, cut into
        one [routed positions, MoE layers, K] record per sample (as the rollout's), so any later
        micro- or mini-batch plan can replay it."""
        from megatron.core import parallel_state as ps
        B, S = mb.input_ids.shape
        rows = self.replay.recorded()
        tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() \
            else 1
        if tp > 1 and self.cfg.trainer.sequence_parallel:   # each TP rank routed a slice
            group = ps.get_tensor_model_parallel_group()
            full = []
            for t in rows:
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=group)
                full.append(torch.cat(parts))
            rows = full
        per = torch.stack([t.reshape(S, B, -1) for t in rows], dim=2)   # router order s*B+b
        return {row: compact_routing(per[:samples[row].routed_positions, b].long(),
                                     self.spec.facts.num_experts)
                for b, row in enumerate(mb.sample_indices)}

    @staticmethod
    def _kept(samples: list[Sample]) -> list[torch.Tensor] | None:
        """Kept-set size of every response token, one row per sample."""
        if not samples or any(s.sampling_mask_offsets is None for s in samples):
            return None
        return [kept_set_sizes(s.sampling_mask_offsets) for s in samples]

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL step on this rank's samples: returns the metrics (floats)."""
        a = self.cfg.algorithm
        if self.versions is not None:
            self.versions.remember(self.step)
        batch, metrics = self.prepare(samples)
        skip = collapse_guard(metrics, a.collapse_guard_k3)
        self.guard_skipped_total += int(skip)
        metrics["guard/skipped"] = float(skip)
        metrics["guard/skipped_total"] = float(self.guard_skipped_total)
        if not skip:
            metrics.update(self._update(batch))
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        self.step += 1
        return metrics

    def _update(self, batch: StepBatch) -> dict[str, float]:
        cfg, a, t = self.cfg, self.cfg.algorithm, self.cfg.trainer
        n = len(batch.samples)
        order = list(range(n))
        sums: dict[str, float] = {}
        grad_norms = []
        self.model.train()
        first = True
        for _ in range(t.epochs):
            for mini in np.array_split(order, t.mini_batches):
                mini = [int(i) for i in mini]   # may be empty: the rank still takes part
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
                eff = batch.mask[mini]
                if a.loss_denominator == "kept":
                    eff = eff & batch.keep[mini]
                local = count_normalisers(eff)   # this rank's part; the loss uses the sums
                counts = _dp_sum([local.num_tokens, local.num_seqs])
                norm = Normalisers(counts[0], counts[1],
                                   float(a.max_len_norm or response_cap(cfg)))
                selection = self._covariance_selection(batch, mini)
                for mb in self._aligned(self._micro_batches(batch.replay_samples, mini)):
                    if mb is None:
                        self._dummy_forward(self.model, self.replay, grad=True)
                    else:
                        self._micro_step(batch, mb, norm, sums, first, selection)
                first = False
                sums["_minibatches"] = sums.get("_minibatches", 0.0) + 1
                finalize_grads(self.model)
                with cuda_factories_on_cpu():
                    ok, grad_norm, _ = self.optimizer.step()
                self.scheduler.step(increment=1)
                if grad_norm is not None:
                    grad_norms.append(float(grad_norm))
                self._ema_update()
        sums = reduce_sums(sums, ("_first_dev", "_minibatches"), _dp_group())
        out = {k: v / max(sums.get("_tokens", 1.0), 1.0) for k, v in sums.items()
               if not k.startswith("_") and k != "loss"}
        out["loss"] = sums.get("loss", 0.0) / max(sums.get("_minibatches", 1.0), 1.0)
        out["grad_norm"] = float(np.mean(grad_norms)) if grad_norms else 0.0
        for k, v in sums.items():
            if k.startswith("_live/"):
                out[k[len("_live/"):]] = v / max(sums["_live_tokens"], 1.0)
        if "_first_dev" in sums:
            out["ratio/first_minibatch_max_dev"] = sums["_first_dev"]
        return out

    def _covariance_selection(self, batch: StepBatch, mini: list[int]) -> torch.Tensor | None:
        """Clip-Cov / KL-Cov tokens chosen over the whole mini-batch (not per micro-batch, where
        round(r N) of a small micro-batch is 0), from a no-grad forward with the weights the
        mini-batch's micro-steps will use (so the same log-probs) under the step's replay."""
        if self.cfg.algorithm.entropy_control.method not in ("clip_cov", "kl_cov"):
            return None
        lp_now = torch.zeros_like(batch.lp_old)
        for mb in self._aligned(self._micro_batches(batch.replay_samples, mini)):
            if mb is None:
                self._dummy_forward(self.model, self.replay)
                continue
            lp, _ = self._forward(self.model, self.replay, mb, self.routes.update)
            width = int(mb.response_lens.max())
            lp_now[mb.sample_indices, :width] = mb.to_response_padded(lp.float())
        chosen = self.loss.select(lp_now[mini], batch.advantages[mini].float(),
                                  batch.mask[mini] & batch.keep[mini])
        selection = torch.zeros_like(batch.mask)
        selection[mini] = chosen
        return selection

    def _micro_step(self, batch: StepBatch, mb: MicroBatch, norm: Normalisers,
                    sums: dict[str, float], first: bool = False,
                    selection: torch.Tensor | None = None) -> None:
        """Forward with the update's replay mode, the policy loss, backward; metric sums."""
        rows, width = mb.sample_indices, int(mb.response_lens.max())
        lp_pos, ent_pos = self._forward(self.model, self.replay, mb, self.routes.update,
                                        grad=True)
        mask = batch.mask[rows, :width]
        inputs = LossInputs(
            lp_old=batch.lp_old[rows, :width], lp_roll=batch.lp_roll[rows, :width],
            lp_ref=None if batch.lp_ref is None else batch.lp_ref[rows, :width],
            advantages=batch.advantages[rows], mask=mask,
            keep=batch.keep[rows, :width] & mask, weights=batch.weights[rows, :width],
            chosen=None if selection is None else selection[rows, :width])
        loss, got = self.loss(mb.to_response_padded(lp_pos), mb.to_response_padded(ent_pos),
                              inputs, norm, first)
        with self.replay.backward():
            loss.backward()
        for k, v in got.items():
            sums[k] = max(sums.get(k, 0.0), v) if k == "_first_dev" else sums.get(k, 0.0) + v

    def sft_step(self, samples: list[Sample], lr: float) -> dict[str, float]:
        """One supervised step (mean negative log-likelihood of the response tokens, ordinary
        routing) at learning rate ``lr``: the demo's warm start."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        n_tok = sum(int(s.loss_mask.sum()) for s in samples)
        norm = Normalisers(*_dp_sum([float(n_tok), float(len(samples))]))
        total = 0.0
        for mb in self._aligned(self._micro_batches(samples, list(range(len(samples))))):
            if mb is None:
                self._dummy_forward(self.model, self.replay, grad=True)
                continue
            lp, _ = self._forward(self.model, self.replay, mb, self.routes.supervised,
                                  grad=True, kept_sets=False)
            mask = mb.score_mask.to(lp.device)
            loss = aggregate(-lp, mask, "token-mean", norm)
            loss.backward()
            total += float(loss.detach())
        finalize_grads(self.model)
        saved = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        with cuda_factories_on_cpu():
            _, grad_norm, _ = self.optimizer.step()
        for g, v in zip(self.optimizer.param_groups, saved):
            g["lr"] = v
        return {"sft/loss": total, "sft/grad_norm": float(grad_norm or 0.0)}

    def _ema_update(self) -> None:
        if self.ema is None:
            return
        d = self.cfg.trainer.ema_decay
        model = self.model.module
        with torch.no_grad():
            for name, p in model.named_parameters():
                self.ema[name].mul_(d).add_(p.detach().float(), alpha=1 - d)

    # ------------------------------------------------------------------ weights out
    def hf_buckets(self, everywhere: bool = False):
        """The policy as HF-named tensors in buckets of ``cluster.weight_sync_bucket_mb``:
        (bucket, is_last) pairs, full tensors on the exporting rank (every rank with
        ``everywhere``); collective over the tensor/expert ranks, iterate to the end."""
        return iter_hf_buckets(self.model.module, self.spec, self.bucket_bytes, everywhere)

    def export_hf(self, out_dir: str, use_ema: bool = False) -> None:
        """Write the current (or, with ``use_ema``, the EMA) policy as a HF checkpoint (rank 0
        writes). The EMA weights are swapped in for the export and the raw ones put back."""
        model = self.model.module
        saved = None
        if use_ema and self.ema is not None:
            with torch.no_grad():
                saved = {n: p.detach().clone() for n, p in model.named_parameters()}
                for name, p in model.named_parameters():
                    p.copy_(self.ema[name].to(p.dtype))
        try:   # streamed: the exporting rank writes shards as the tensors arrive
            stream = iter_hf_buckets(model, self.spec, self.bucket_bytes)
            if exporting_rank():
                save_hf_checkpoint(stream, self.spec, out_dir, source_dir=self.hf_path)
            else:
                for _ in stream:   # the other ranks take part in the gathers
                    pass
        finally:
            if saved is not None:
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.copy_(saved[name])

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Save to directory ``path`` (collective over the trainer ranks): the weights, Adam's
        state and the EMA through megatron-core ``dist_checkpointing`` in ``path/dist`` (any
        parallel layout can load them), and this rank's scheduler, counters and RNG states in
        ``path/rank{r}.pt``."""
        save_sharded(os.path.join(path, "dist"), self.model.module, self.optimizer, self.ema)
        state = {"scheduler": self.scheduler.state_dict(), "step": self.step,
                 "adam_steps": optimizer_step_count(self.optimizer),
                 "guard_skipped_total": self.guard_skipped_total,
                 "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
                 "python_rng": random.getstate(), "numpy_rng": _numpy_rng_state()}
        torch.save(state, os.path.join(path, f"rank{_rank()}.pt"))

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, whatever parallel layout wrote it
        (collective). A rank the saving run did not have takes rank 0's scheduler, counters and
        RNG states. Files are read with ``weights_only=True``: a crafted file cannot run code."""
        rank_file = os.path.join(path, f"rank{_rank()}.pt")
        if not os.path.isfile(rank_file):
            rank_file = os.path.join(path, "rank0.pt")
        state = torch.load(rank_file, map_location="cpu", weights_only=True)
        load_sharded(os.path.join(path, "dist"), self.model.module, self.optimizer, self.ema,
                     step=state["adam_steps"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.guard_skipped_total = state["guard_skipped_total"]
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        np.random.set_state(_numpy_rng_tuple(state["numpy_rng"]))
