"""The policy's optimizer steps: the RL update (epochs x mini-batches of micro-steps under the
update's routing, Clip-Cov / KL-Cov selection over the whole mini-batch, gradients finalised
over the parallel groups, megatron's optimizer and LR schedule) and the supervised warm start."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from moe_rl.algo import Normalisers, aggregate, count_normalisers, router_shift_weight
from moe_rl.config import Config, response_cap
from moe_rl.errors import LossScaleCollapsed
from moe_rl.trainer.packing import MicroBatch
from moe_rl.trainer.cpu_compat import cuda_factories_on_cpu
from moe_rl.trainer.dp import dp_group, dp_sum
from moe_rl.trainer.forwarder import Forwarder
from moe_rl.trainer.loss import LossInputs, PolicyLoss
from moe_rl.trainer.passes import StepBatch
from moe_rl.trainer.replay import ReplayController
from moe_rl.trainer.replay_plan import ReplayPlan
from moe_rl.trainer.router_rows import micro_batch_rows, response_rows
from moe_rl.trainer.step import reduce_sums
from moe_rl.rollout_record import Sample


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


class PolicyUpdate:
    """The optimizer steps of one trainer rank; ``after_step`` runs after each (the EMA)."""

    def __init__(self, cfg: Config, fw: Forwarder, model, replay: ReplayController, optimizer,
                 scheduler, routes: ReplayPlan, loss: PolicyLoss,
                 after_step: Callable[[], None]):
        self.cfg, self.fw, self.model, self.replay = cfg, fw, model, replay
        self.optimizer, self.scheduler = optimizer, scheduler
        self.routes, self.loss, self.after_step = routes, loss, after_step

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to differentiate: times the dynamic loss scale in float16 (megatron's
        optimizer unscales the gradients, and skips the step when they overflowed)."""
        if self.cfg.model.dtype != "float16":
            return loss
        return self.optimizer.scale_loss(loss)

    def rl_update(self, batch: StepBatch) -> dict[str, float]:
        """``trainer.epochs`` x ``trainer.mini_batches`` optimizer steps of the policy loss,
        every forward replaying as the update's route says; returns the update's metrics."""
        cfg, a, t = self.cfg, self.cfg.algorithm, self.cfg.trainer
        n = len(batch.samples)
        order = list(range(n))
        sums: dict[str, float] = {}
        grad_norms, skipped = [], 0
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
                counts = dp_sum([local.num_tokens, local.num_seqs])
                norm = Normalisers(counts[0], counts[1],
                                   float(a.max_len_norm or response_cap(cfg)))
                selection = self._covariance_selection(batch, mini)
                for mb in self.fw.aligned(self.fw.micro_batches(batch.replay_samples, mini)):
                    if mb is None:
                        self.fw.dummy_forward(self.model, self.replay, grad=True)
                    else:
                        self._micro_step(batch, mb, norm, sums, first, selection)
                first = False
                sums["_minibatches"] = sums.get("_minibatches", 0.0) + 1
                finalize_grads(self.model)
                with cuda_factories_on_cpu():
                    ok, grad_norm, _ = self.optimizer.step()
                if not ok:
                    skipped += 1
                    self._stop_at_the_minimum_scale()
                self.scheduler.step(increment=1)
                if grad_norm is not None:
                    grad_norms.append(float(grad_norm))
                self.after_step()
        sums = reduce_sums(sums, ("_first_dev", "_minibatches"), dp_group())
        out = {k: v / max(sums.get("_tokens", 1.0), 1.0) for k, v in sums.items()
               if not k.startswith("_") and k != "loss"}
        out["loss"] = sums.get("loss", 0.0) / max(sums.get("_minibatches", 1.0), 1.0)
        out["grad_norm"] = float(np.mean(grad_norms)) if grad_norms else 0.0
        if self.cfg.model.dtype == "float16":
            out["train/loss_scale"] = float(self.optimizer.get_loss_scale())
            out["train/skipped_steps"] = float(skipped)
        for k, v in sums.items():
            if k.startswith("_live/"):
                out[k[len("_live/"):]] = v / max(sums["_live_tokens"], 1.0)
        if "_first_dev" in sums:
            out["ratio/first_minibatch_max_dev"] = sums["_first_dev"]
        return out

    def _stop_at_the_minimum_scale(self) -> None:
        """float16: a step skipped for an overflow that leaves the scale at its minimum ends the
        run (the scale came down to ``trainer.loss_scale.min`` through overflows; the weights
        stay as they were)."""
        floor = self.cfg.trainer.loss_scale.min
        if float(self.optimizer.get_loss_scale()) <= floor:
            raise LossScaleCollapsed(
                f"trainer.loss_scale.min: the float16 loss scale fell to its minimum ({floor:g}) "
                f"after the gradients overflowed at every larger scale; the step was skipped and "
                f"the run stops (train in bfloat16, or lower trainer.optim.lr)")

    def _covariance_selection(self, batch: StepBatch, mini: list[int]) -> torch.Tensor | None:
        """Clip-Cov / KL-Cov tokens chosen over the whole mini-batch (not per micro-batch, where
        round(r N) of a small micro-batch is 0), from a no-grad forward with the weights the
        mini-batch's micro-steps will use (so the same log-probs) under the step's replay."""
        if self.cfg.algorithm.entropy_control.method not in ("clip_cov", "kl_cov"):
            return None
        lp_now = torch.zeros_like(batch.lp_old)
        for mb in self.fw.aligned(self.fw.micro_batches(batch.replay_samples, mini)):
            if mb is None:
                self.fw.dummy_forward(self.model, self.replay)
                continue
            lp, _ = self.fw.forward(self.model, self.replay, mb, self.routes.update)
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
        shift = batch.router_old is not None
        lp_pos, ent_pos = self.fw.forward(self.model, self.replay, mb, self.routes.update,
                                          grad=True, router_scores=shift)
        mask = batch.mask[rows, :width]
        log_scale = None
        if shift:
            rs = self.cfg.algorithm.router_shift
            now = response_rows(micro_batch_rows(self.replay.router_scores(), mb, self.fw,
                                                 self.cfg.trainer.parallel.sequence), mb)
            log_scale = router_shift_weight(batch.router_old[rows, :width], now,
                                            rs.floor).log().float()
        inputs = LossInputs(
            lp_old=batch.lp_old[rows, :width], lp_roll=batch.lp_roll[rows, :width],
            lp_ref=None if batch.lp_ref is None else batch.lp_ref[rows, :width],
            advantages=batch.advantages[rows], mask=mask,
            keep=batch.keep[rows, :width] & mask, weights=batch.weights[rows, :width],
            chosen=None if selection is None else selection[rows, :width],
            log_ratio_scale=log_scale)
        loss, got = self.loss(mb.to_response_padded(lp_pos), mb.to_response_padded(ent_pos),
                              inputs, norm, first)
        with self.replay.backward():
            self._scaled(loss).backward()
        for k, v in got.items():
            sums[k] = max(sums.get(k, 0.0), v) if k == "_first_dev" else sums.get(k, 0.0) + v

    def sft_step(self, samples: list[Sample], lr: float) -> dict[str, float]:
        """One supervised step (mean negative log-likelihood of the response tokens, ordinary
        routing) at learning rate ``lr``: the demo's warm start."""
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        n_tok = sum(int(s.loss_mask.sum()) for s in samples)
        norm = Normalisers(*dp_sum([float(n_tok), float(len(samples))]))
        total = 0.0
        for mb in self.fw.aligned(self.fw.micro_batches(samples, list(range(len(samples))))):
            if mb is None:
                self.fw.dummy_forward(self.model, self.replay, grad=True)
                continue
            lp, _ = self.fw.forward(self.model, self.replay, mb, self.routes.supervised,
                                  grad=True, kept_sets=False)
            mask = mb.score_mask.to(lp.device)
            loss = aggregate(-lp, mask, "token-mean", norm)
            self._scaled(loss).backward()
            total += float(loss.detach())
        finalize_grads(self.model)
        saved = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        with cuda_factories_on_cpu():
            ok, grad_norm, _ = self.optimizer.step()
        for g, v in zip(self.optimizer.param_groups, saved):
            g["lr"] = v
        # float16: a step whose gradients overflowed is skipped (the scale halves)
        return {"sft/loss": total, "sft/grad_norm": float(grad_norm or 0.0),
                "sft/skipped": float(not ok)}
