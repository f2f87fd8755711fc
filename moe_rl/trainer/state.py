"""What a trainer rank keeps beyond the step: the EMA of the weights, the policy out as HF
tensors (buckets for a weight sync, a checkpoint for an export), and its checkpoints (weights,
Adam and EMA through dist_checkpointing; scheduler, counters and RNG states per rank)."""
from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.config import Config
from moe_rl.trainer.sharded_state import (load_sharded, loss_scaler_state, optimizer_step_count,
                                         restore_loss_scaler, save_sharded)
from moe_rl.weights.hf import exporting_rank, iter_hf_buckets, save_hf_checkpoint


def main_weights(param: torch.nn.Parameter) -> torch.Tensor:
    """The float32 weights the optimizer updates for ``param``: the main (master) copy that
    megatron's mixed-precision optimizer keeps for a bfloat16 parameter (``param.main_param``,
    megatron/core/optimizer/optimizer.py:683), else the parameter itself. The distributed
    optimizer keeps only a shard of it on each rank (``main_param_sharded``): there the
    parameter itself (an EMA of it is good to the parameter's rounding; ``trainer.ema.policy``
    is refused there by the config checks)."""
    main = getattr(param, "main_param", None)
    if main is None or getattr(param, "main_param_sharded", False):
        return param
    return main


def rank() -> int:
    """This process's rank (0 outside torch.distributed)."""
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


class TrainerState:
    """EMA, exports and checkpoints of the policy ``model`` (DDP-wrapped) and its optimizer,
    scheduler and counters (``counters``: the trainer whose ``step``, ``guard_skipped_total``
    and ``generator`` are saved and restored)."""

    def __init__(self, cfg: Config, model, spec, hf_path: str, optimizer, scheduler, counters):
        self.cfg, self.model, self.spec, self.hf_path = cfg, model, spec, hf_path
        self.optimizer, self.scheduler, self.counters = optimizer, scheduler, counters
        self.bucket_bytes = max(1, int(cfg.cluster.weight_sync_bucket_mb * (1 << 20)))
        self.ema = None
        if cfg.trainer.ema.decay is not None:
            self.ema = {n: main_weights(p).detach().clone().float()
                        for n, p in model.module.named_parameters()}

    def ema_update(self) -> None:
        """Fold the current weights into the EMA (``trainer.ema.decay``; before the RL step
        ``trainer.ema.start_step`` the EMA takes the weights as they are), when kept. The EMA
        averages the optimizer's float32 main weights (a bfloat16 model's master copies: its
        own bfloat16 weights would round each step's update, already scaled by 1 - decay, away).
        With ``trainer.ema.policy`` the EMA is then written into those main weights and the
        model's weights (rounded to their dtype), so the next step starts from the EMA."""
        if self.ema is None:
            return
        t = self.cfg.trainer
        d = t.ema.decay if self.counters.step >= t.ema.start_step else 0.0
        with torch.no_grad():
            for name, p in self.model.module.named_parameters():
                master = main_weights(p)
                self.ema[name].mul_(d).add_(master.float(), alpha=1 - d)
                if t.ema.policy:
                    master.copy_(self.ema[name])
                    if master is not p:
                        p.copy_(self.ema[name].to(p.dtype))

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
        state = {"scheduler": self.scheduler.state_dict(), "step": self.counters.step,
                 "adam_steps": optimizer_step_count(self.optimizer),
                 "loss_scaler": loss_scaler_state(self.optimizer),
                 "guard_skipped_total": self.counters.guard_skipped_total,
                 "generator": self.counters.generator.get_state(),
                 "torch_rng": torch.get_rng_state(),
                 "python_rng": random.getstate(), "numpy_rng": _numpy_rng_state()}
        torch.save(state, os.path.join(path, f"rank{rank()}.pt"))

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, whatever parallel layout wrote it
        (collective). A rank the saving run did not have takes rank 0's scheduler, counters and
        RNG states. Files are read with ``weights_only=True``: a crafted file cannot run code."""
        rank_file = os.path.join(path, f"rank{rank()}.pt")
        if not os.path.isfile(rank_file):
            rank_file = os.path.join(path, "rank0.pt")
        state = torch.load(rank_file, map_location="cpu", weights_only=True)
        load_sharded(os.path.join(path, "dist"), self.model.module, self.optimizer, self.ema,
                     step=state["adam_steps"])
        restore_loss_scaler(self.optimizer, state.get("loss_scaler", []))
        self.scheduler.load_state_dict(state["scheduler"])
        self.counters.step = state["step"]
        self.counters.guard_skipped_total = state["guard_skipped_total"]
        self.counters.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        np.random.set_state(_numpy_rng_tuple(state["numpy_rng"]))
