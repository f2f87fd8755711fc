"""The policy's optimizer and learning-rate schedule, from ``trainer.optim`` and
``trainer.loss_scale``: megatron-core's Adam (its distributed optimizer where CUDA is, with one
loss scale shared by the dense and expert leaves under float16) and its parameter scheduler."""
from __future__ import annotations

import torch

from moe_rl.config.schema import LossScaleConfig, OptimConfig
from moe_rl.trainer.cpu_compat import cuda_absent, cuda_factories_on_cpu
from moe_rl.trainer.loss_scale import share_loss_scale


def uses_distributed_optimizer(optim: OptimConfig) -> bool:
    """Whether megatron's distributed optimizer runs (it needs CUDA)."""
    return optim.distributed and not cuda_absent()


def build_optimizer(ddp_model, optim: OptimConfig, loss_scale: LossScaleConfig,
                    dtype: torch.dtype, decay_steps: int):
    """(optimizer, scheduler) of ``ddp_model`` (megatron's DistributedDataParallel), the
    schedule decaying over ``decay_steps`` optimizer steps after its warm-up."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    with cuda_factories_on_cpu():
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.min_lr,
            weight_decay=optim.weight_decay, adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2, clip_grad=optim.grad_clip,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            initial_loss_scale=loss_scale.initial, min_loss_scale=loss_scale.min,
            loss_scale_window=loss_scale.growth_interval, hysteresis=loss_scale.hysteresis,
            use_distributed_optimizer=uses_distributed_optimizer(optim)), [ddp_model])
    share_loss_scale(optimizer)   # float16: one scale for dense and expert leaves
    decay_steps = max(decay_steps, 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.warmup_steps else optim.lr, max_lr=optim.lr,
        min_lr=optim.min_lr, lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(decay_steps, optim.warmup_steps + 1),
        lr_decay_style=optim.schedule, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
        wd_incr_steps=decay_steps, wd_incr_style="constant")
    return optimizer, scheduler
