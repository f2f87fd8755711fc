"""The trainer's weights and optimizer state as megatron-core sharded tensors, saved and loaded
with ``dist_checkpointing`` (``torch_dist`` format) so that any parallel layout can read what
another wrote (expert parallel 2 / data parallel 2 <-> 1 / 1, tensor parallel on GPUs).

Every tensor is keyed by the model parameter it belongs to and carries that parameter's place in
the global tensor: the weights (``model``), Adam's moments (``optim.exp_avg.*``,
``optim.exp_avg_sq.*``), the float32 main weights of a bfloat16 model (``optim.main.*``) and the
EMA (``ema.*``). The keys do not depend on how megatron splits its optimizer (one optimizer, or a
dense and an expert one under expert parallelism), which is what makes the state reshardable.
With megatron's distributed optimizer (GPUs) the optimizer writes its own sharded state
(``fully_reshardable``) under ``optimizer``."""
from __future__ import annotations

import os
import queue
from typing import Iterator

import torch
from moe_rl.trainer.dcp_metadata import check, install

_MOMENTS = ("exp_avg", "exp_avg_sq")
# seen on an H100 without Transformer Engine: megatron's load sets a per-parameter "step" for
# torch's Adam and then copies every state key from the checkpoint, which has none
DIST_OPT_RESUME_NEEDS_TE = (
    "trainer.optim.distributed: megatron-core 0.16.1 cannot resume its distributed optimizer "
    "without Transformer Engine or Apex (torch's Adam keeps a per-parameter step that its "
    "reshardable load does not restore: KeyError 'step', distrib_optimizer.py:940); install "
    "transformer-engine[pytorch], or run with trainer.optim.distributed=false")


def leaf_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _param_pairs(leaf) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, the parameter the torch optimizer updates) of one megatron optimizer."""
    if hasattr(leaf, "float16_groups"):   # bfloat16 model: float32 main copies
        for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
            yield from zip(model_group, main_group)
        for group in leaf.fp32_from_fp32_groups:
            yield from ((p, p) for p in group)
    else:
        for group in leaf.optimizer.param_groups:
            yield from ((p, p) for p in group["params"])


def _uses_distributed_optimizer(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    return any(isinstance(leaf, DistributedOptimizer) for leaf in leaf_optimizers(optimizer))


def _by_param(model_sd: dict) -> dict[int, object]:
    """id(parameter) -> its ShardedTensor (or factory) in the model's sharded state dict."""
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    sharded, _ = extract_sharded_tensors_and_factories(model_sd)
    return {id(t.data): t for t in nested_values(sharded)}


def _keeps_step_per_group(torch_optimizer) -> bool:
    """Whether the optimizer counts its steps per parameter group (Transformer Engine's and
    Apex's FusedAdam, which megatron uses when either is installed: ``group["step"]``,
    transformer_engine/pytorch/optimizers/fused_adam.py) rather than per parameter (torch's
    Adam and AdamW: ``state[p]["step"]``)."""
    if any("step" in g for g in torch_optimizer.param_groups):
        return True
    return not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW))


def optimizer_step_count(optimizer) -> int:
    """How many Adam steps the optimizer took (0 before the first), wherever it counts them."""
    for leaf in leaf_optimizers(optimizer):
        for group in leaf.optimizer.param_groups:
            if "step" in group:
                return int(group["step"])
        for _, main in _param_pairs(leaf):
            step = leaf.optimizer.state.get(main, {}).get("step")
            if step is not None:
                return int(step)
    return 0


def _loss_scalers(optimizer) -> list:
    """float16's dynamic loss scaler of each leaf optimizer (none in bfloat16, float32)."""
    return [leaf.grad_scaler for leaf in leaf_optimizers(optimizer)
            if getattr(leaf, "grad_scaler", None) is not None]


def loss_scaler_state(optimizer) -> list[dict]:
    """The loss scalers' scale, growth and hysteresis trackers as plain numbers."""
    return [{"scale": float(s.scale), "growth_tracker": int(s._growth_tracker),
             "hysteresis_tracker": int(s._hysteresis_tracker)} for s in _loss_scalers(optimizer)]


def restore_loss_scaler(optimizer, states: list[dict]) -> None:
    """Put :func:`loss_scaler_state`'s numbers back (megatron's own ``load_state_dict`` moves
    the scale to CUDA, which a CPU trainer has not)."""
    for scaler, state in zip(_loss_scalers(optimizer), states):
        scaler._scale = torch.full_like(scaler._scale, state["scale"])
        scaler._growth_tracker = state["growth_tracker"]
        scaler._hysteresis_tracker = state["hysteresis_tracker"]


def _set_step(leaf, step: int) -> None:
    """Set the Adam step count ``step`` where the optimizer keeps it (per group or per
    parameter), so that bias correction continues after a resume."""
    opt = leaf.optimizer
    if _keeps_step_per_group(opt):
        for group in opt.param_groups:
            group["step"] = step
    else:
        for _, main in _param_pairs(leaf):
            opt.state[main]["step"] = torch.tensor(float(step))


def sharded_trainer_state(model, optimizer, ema: dict | None, loading: bool = False,
                          step: int = 0) -> dict:
    """The sharded state dict of the weights, optimizer and EMA. With ``loading`` the optimizer
    state is created first (zeros, Adam step ``step``) so that loading fills it in place."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    model_sd = model.sharded_state_dict()
    state: dict = {"model": model_sd}
    by_param = _by_param(model_sd)
    names = {id(p): n for n, p in model.named_parameters()}   # local names: unique on a rank
    if _uses_distributed_optimizer(optimizer):
        if loading:   # a fresh optimizer has no state: megatron's state_dict() asserts one Adam
            for leaf in leaf_optimizers(optimizer):   # step (distrib_optimizer.py:640)
                leaf.init_state_fn(leaf.optimizer, leaf.config)
                _set_step(leaf, step)
        state["optimizer"] = optimizer.sharded_state_dict(   # megatron's reshardable format
            model_sd, is_loading=loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable",
                      "chained_optim_avoid_prefix": True})
    else:
        optim: dict = {}
        for leaf in leaf_optimizers(optimizer):
            # before Adam's first step (every step skipped: float16 overflows, the collapse
            # guard) it holds no state, and none was saved: Adam starts afresh
            started = loading and step > 0
            if started:
                _set_step(leaf, step)
            for param, main in _param_pairs(leaf):
                slot = leaf.optimizer.state[main]
                if started:
                    for k in _MOMENTS:
                        slot.setdefault(k, torch.zeros_like(
                            main, memory_format=torch.preserve_format))
                sharded, name = by_param[id(param)], names[id(param)]
                for k in _MOMENTS:
                    if k in slot:
                        optim[f"{k}.{name}"] = make_sharded_optimizer_tensor(
                            sharded, slot[k], f"optim.{k}")
                if main is not param:
                    optim[f"main.{name}"] = make_sharded_optimizer_tensor(
                        sharded, main, "optim.main")
        state["optim"] = optim
    if ema is not None:
        state["ema"] = {n: make_sharded_optimizer_tensor(by_param[i], ema[n], "ema")
                        for i, n in names.items() if i in by_param}
    return state


def in_process_write_results() -> None:
    """megatron-core hands a save's write results over a queue that it makes, on the first save
    of a process, with a spawned multiprocessing Manager: a new Python process (in a Ray actor
    it re-imports Ray; about 2 s) living as long as the trainer. A synchronous save, the only
    kind the trainer makes, puts and takes them in this process, so a plain queue serves."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if getattr(filesystem_async, "_results_queue", False) is None:   # none made yet
        filesystem_async._results_queue = queue.Queue()


def save_sharded(path: str, model, optimizer, ema: dict | None) -> None:
    """Write the sharded state to directory ``path`` (collective over every trainer rank)."""
    from megatron.core import dist_checkpointing
    os.makedirs(path, exist_ok=True)
    in_process_write_results()
    dist_checkpointing.save(sharded_trainer_state(model, optimizer, ema), path)


def load_sharded(path: str, model, optimizer, ema: dict | None, step: int) -> None:
    """Fill the model, optimizer (Adam at step ``step``) and EMA from directory ``path``, whatever
    parallel layout wrote it (collective over every trainer rank). The DCP metadata is read
    without running code from it (:mod:`moe_rl.trainer.dcp_metadata`)."""
    from megatron.core import dist_checkpointing
    if _uses_distributed_optimizer(optimizer):
        from megatron.core.optimizer import distrib_optimizer
        if not distrib_optimizer.HAVE_APEX_OR_TE:
            raise ValueError(DIST_OPT_RESUME_NEEDS_TE)
    install()
    check(path)
    state = sharded_trainer_state(model, optimizer, ema, loading=True, step=step)
    targets = {part: {k: v.data for k, v in state[part].items()}   # where the values belong
               for part in ("optim", "ema") if part in state}
    loaded = dist_checkpointing.load(state, path)
    model.load_state_dict(loaded["model"])
    if "optimizer" in loaded:
        optimizer.load_state_dict(loaded["optimizer"])
    with torch.no_grad():
        for part, tensors in targets.items():
            for key, target in tensors.items():
                if target is not loaded[part][key]:
                    target.copy_(loaded[part][key])


def load_sharded_weights(path: str, model, use_ema: bool = False) -> None:
    """Fill only the model's weights from directory ``path`` (``use_ema``: with the EMA that
    was saved beside them), whatever parallel layout wrote it (DCP metadata read safely, as in
    :func:`load_sharded`)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    install()
    check(path)
    model_sd = model.sharded_state_dict()
    if not use_ema:
        model.load_state_dict(dist_checkpointing.load({"model": model_sd}, path)["model"])
        return
    by_param = _by_param(model_sd)
    params = {n: p for n, p in model.named_parameters() if id(p) in by_param}
    state = {"ema": {n: make_sharded_optimizer_tensor(by_param[id(p)], torch.empty_like(p), "ema")
                     for n, p in params.items()}}
    loaded = dist_checkpointing.load(state, path)["ema"]
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(loaded[n])
