"""The trainer of one rank, composed of its parts: the policy (and optional frozen reference)
built from a HF checkpoint with megatron-core's optimizer and LR schedule; a
:class:`~moe_rl.trainer.forwarder.Forwarder` (micro-batches, routed forwards); the step's no-grad
passes (:mod:`~moe_rl.trainer.passes`); the optimizer steps (:mod:`~moe_rl.trainer.update`);
EMA, exports and checkpoints (:mod:`~moe_rl.trainer.state`). Every pass's routing is decided once
from the config (:class:`~moe_rl.trainer.replay_plan.ReplayPlan`).

``train_step`` receives this rank's share of the batch (whole prompt groups) and returns the
step's metrics.
"""
from __future__ import annotations

import sys

import torch

from moe_rl.algo import collapse_guard
from moe_rl.config import Config
from moe_rl.trainer.forwarder import Forwarder
from moe_rl.trainer.loss import PolicyLoss
from moe_rl.trainer.model_builder import build_model, mla_packing_warning
from moe_rl.trainer.optimizer import build_optimizer, uses_distributed_optimizer
from moe_rl.trainer.parallel import ParallelSizes
from moe_rl.trainer.passes import StepBatch, StepPasses
from moe_rl.trainer.replay import ReplayController
from moe_rl.trainer.replay_plan import ReplayPlan
from moe_rl.trainer.state import TrainerState
from moe_rl.trainer.update import PolicyUpdate
from moe_rl.trainer.versions import WeightVersions
from moe_rl.rollout_record import MODEL_DTYPES, Sample
from moe_rl.weights.hf import load_hf_into_megatron


class PolicyTrainer:
    """The policy (and optional frozen reference) on this rank, built from ``hf_path``."""

    def __init__(self, cfg: Config, hf_path: str):
        from megatron.core.distributed import (DistributedDataParallel,
            DistributedDataParallelConfig)
        self.cfg = cfg
        self.hf_path = hf_path
        t = cfg.trainer
        sizes = ParallelSizes(t.parallel.tensor, t.parallel.pipeline, t.parallel.expert,
                              t.parallel.context)
        dtype = MODEL_DTYPES[cfg.model.dtype]
        model, self.spec = build_model(hf_path, sizes=sizes, dtype=dtype,
                                       sequence_parallel=t.parallel.sequence,
                                       recompute=t.recompute_activations,
                                       expert_bias_update_rate=t.expert_bias_update_rate,
                                       experts=t.experts)
        load_hf_into_megatron(model, self.spec, hf_path)
        # how the experts and the attention compute as built: {"experts": (path, why), ...}
        self.compute_paths = {"experts": model.expert_path, "attention": model.attention_path,
                              "dispatch": model.dispatch_path}
        risk = mla_packing_warning(model.config, t.pack_sequences)
        if risk is not None:
            print(f"warning: {risk}", file=sys.stderr, flush=True)
        moe_shape = self.spec.moe_shape
        self.moe_shape = moe_shape
        self.replay = ReplayController(model, moe_shape.moe_layers, moe_shape.topk,
                                       moe_shape.num_experts, recompute=t.recompute_activations)
        self.routes = ReplayPlan.from_algorithm(cfg.algorithm)   # each pass's routing
        self.model = DistributedDataParallel(
            model.config, DistributedDataParallelConfig(
                use_distributed_optimizer=uses_distributed_optimizer(t.optim),
                grad_reduce_in_fp32=True), model)
        self.optimizer, self.scheduler = build_optimizer(
            self.model, t.optim, t.loss_scale, dtype, t.steps * t.epochs * t.mini_batches)
        self.ref_model = self.ref_replay = None
        if cfg.algorithm.kl.coef > 0:
            ref, _ = build_model(hf_path, sizes=sizes, dtype=dtype,
                                 sequence_parallel=t.parallel.sequence, experts=t.experts)
            load_hf_into_megatron(ref, self.spec, hf_path)
            ref.eval()
            for p in ref.parameters():
                p.requires_grad_(False)
            self.ref_model = ref
            self.ref_replay = ReplayController(ref, moe_shape.moe_layers, moe_shape.topk,
                                               moe_shape.num_experts)
        self.step = 0
        # the asynchronous pipeline scores stale samples at their own version as well
        self.versions = (WeightVersions(model, cfg.rollout.max_staleness)
            if cfg.rollout.max_staleness > 0 else None)
        self.guard_skipped_total = 0
        self.generator = torch.Generator().manual_seed(t.seed)
        self.loss = PolicyLoss(cfg.algorithm, self.generator)
        # the parts: one forward, the step's no-grad passes, the optimizer steps, the state
        self.forwarder = Forwarder(cfg, moe_shape.num_experts,
                                   model.config.moe_token_dispatcher_type)
        self.state = TrainerState(cfg, self.model, self.spec, hf_path, self.optimizer,
                                  self.scheduler, self)
        self.passes = StepPasses(cfg, self.forwarder, self.model, self.replay, self.ref_model,
                                 self.ref_replay, self.routes, self.loss, self.versions,
                                 self.spec.vocab_size, moe_shape)
        self.update = PolicyUpdate(cfg, self.forwarder, self.model, self.replay, self.optimizer,
                                   self.scheduler, self.routes, self.loss, self.state.ema_update)

    @property
    def ema(self) -> dict | None:
        """The EMA of the weights by parameter name (``trainer.ema.decay``), or None."""
        return self.state.ema

    def prepare(self, samples: list[Sample]) -> tuple[StepBatch, dict[str, float]]:
        """The step's no-grad passes: pi_old / reference, advantages, corrections, metrics."""
        return self.passes.run(samples, self.step)

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """One RL step on this rank's samples: returns the metrics (floats)."""
        if self.versions is not None:
            self.versions.remember(self.step)
        batch, metrics = self.prepare(samples)
        skip = collapse_guard(metrics, self.cfg.algorithm.collapse_guard_k3)
        self.guard_skipped_total += int(skip)
        metrics["guard/skipped"] = float(skip)
        metrics["guard/skipped_total"] = float(self.guard_skipped_total)
        if not skip:
            metrics.update(self.update.rl_update(batch))
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        self.step += 1
        return metrics

    def sft_step(self, samples: list[Sample], lr: float) -> dict[str, float]:
        """One supervised step at learning rate ``lr`` (the warm start)."""
        return self.update.sft_step(samples, lr)

    def hf_buckets(self, everywhere: bool = False):
        """The policy as HF-named tensors in buckets (see :meth:`TrainerState.hf_buckets`)."""
        return self.state.hf_buckets(everywhere)

    def export_hf(self, out_dir: str, use_ema: bool = False, version: int | None = None) -> int:
        """Write the policy (or its EMA) as a HF checkpoint: with ``version``, that version's
        weights where they are still held (the asynchronous pipeline keeps the last
        ``rollout.max_staleness``), else the current ones. Returns the version written."""
        held = (version is not None and version != self.step and self.versions is not None
                and self.versions.has(version))
        if held:
            if use_ema:
                raise ValueError("use_ema: the EMA of an earlier version is not kept")
            with self.versions.weights_of(version):
                self.state.export_hf(out_dir)
            return version
        self.state.export_hf(out_dir, use_ema)
        return self.step

    def save_checkpoint(self, path: str) -> None:
        """Save the rank's state to directory ``path`` (collective)."""
        self.state.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, whatever layout wrote it (collective)."""
        self.state.load_checkpoint(path)
