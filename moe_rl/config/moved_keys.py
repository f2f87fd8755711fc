"""Keys that moved into a section (issue 79: a component receives its section): each old
dotted name and its new one. A configuration, an override, a run directory's or checkpoint's
saved ``config.yaml`` that uses an old name still loads, with a one-line warning naming the
new one; giving both is refused. Where a switch became its section's ``enabled``
(``rollout.partial``, ``rollout.weight_check``), a value under the old name is the switch and a
mapping is the section."""
from __future__ import annotations

import sys

from moe_rl.errors import ConfigError

MOVED_KEYS = {
    "trainer.ema_decay": "trainer.ema.decay",
    "trainer.ema_policy": "trainer.ema.policy",
    "trainer.ema_start_step": "trainer.ema.start_step",
    "trainer.sft_warmup_steps": "trainer.warmup.steps",
    "trainer.sft_lr": "trainer.warmup.lr",
    "trainer.save_interval": "trainer.checkpoint.interval",
    "trainer.save_interval_minutes": "trainer.checkpoint.interval_minutes",
    "trainer.stop_grace_s": "trainer.checkpoint.stop_grace_s",
    "trainer.checkpoint_dir": "trainer.checkpoint.dir",
    "trainer.keep_checkpoints": "trainer.checkpoint.keep",
    "trainer.export_hf": "trainer.checkpoint.export_hf",
    "trainer.export_hf_interval": "trainer.checkpoint.export_hf_interval",
    "trainer.tensor_parallel": "trainer.parallel.tensor",
    "trainer.pipeline_parallel": "trainer.parallel.pipeline",
    "trainer.expert_parallel": "trainer.parallel.expert",
    "trainer.context_parallel": "trainer.parallel.context",
    "trainer.sequence_parallel": "trainer.parallel.sequence",
    "trainer.lr": "trainer.optim.lr",
    "trainer.min_lr": "trainer.optim.min_lr",
    "trainer.lr_warmup_steps": "trainer.optim.warmup_steps",
    "trainer.lr_schedule": "trainer.optim.schedule",
    "trainer.weight_decay": "trainer.optim.weight_decay",
    "trainer.adam_beta1": "trainer.optim.adam_beta1",
    "trainer.adam_beta2": "trainer.optim.adam_beta2",
    "trainer.grad_clip": "trainer.optim.grad_clip",
    "trainer.distributed_optimizer": "trainer.optim.distributed",
    "rollout.host": "rollout.servers.host",
    "rollout.base_port": "rollout.servers.base_port",
    "rollout.api_key": "rollout.servers.api_key",
    "rollout.request_timeout_s": "rollout.servers.request_timeout_s",
    "rollout.max_retries": "rollout.servers.max_retries",
    "rollout.concurrency": "rollout.servers.concurrency",
    "rollout.health_timeout_s": "rollout.servers.health_timeout_s",
    "rollout.startup_timeout_s": "rollout.servers.startup_timeout_s",
    "rollout.weight_load_timeout_s": "rollout.servers.weight_load_timeout_s",
    "rollout.max_answer_mb": "rollout.servers.max_answer_mb",
    "rollout.temperature": "rollout.sampling.temperature",
    "rollout.top_p": "rollout.sampling.top_p",
    "rollout.top_k": "rollout.sampling.top_k",
    "rollout.min_p": "rollout.sampling.min_p",
    "rollout.sampling_mask_max_tokens": "rollout.sampling.mask_max_tokens",
    "rollout.partial": "rollout.partial.enabled",
    "rollout.partial_extra_groups": "rollout.partial.extra_groups",
    "rollout.partial_stale": "rollout.partial.stale",
    "rollout.partial_mask_offpolicy": "rollout.partial.mask_offpolicy",
    "rollout.weight_check": "rollout.weight_check.enabled",
    "rollout.weight_check_prompts": "rollout.weight_check.prompts",
    "rollout.weight_check_factor": "rollout.weight_check.factor",
    "rollout.weight_check_floor": "rollout.weight_check.floor",
    "rollout.score_window_tokens": "rollout.scoring.window_tokens",
    "rollout.score_full_vocab_max": "rollout.scoring.full_vocab_max",
}


def _warn(old: str, new: str) -> None:
    print(f"warning: {old} is now {new} (the old name still loads; rename it)",
          file=sys.stderr, flush=True)


def moved_key(key: str, warn: bool = True) -> str:
    """The current name of dotted key ``key`` (an override's), warning when it is an old one."""
    new = MOVED_KEYS.get(key)
    if new is None:
        return key
    if warn:
        _warn(key, new)
    return new


def move_keys(tree: dict, warn: bool = True) -> dict:
    """``tree`` (a nested configuration mapping) with every old key moved to its new place (in
    place; returned). ConfigError when a key is given under both names."""
    for old, new in MOVED_KEYS.items():
        *old_path, old_name = old.split(".")
        node = tree
        for part in old_path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or old_name not in node or isinstance(node[old_name], dict):
            continue   # absent, or the section a switch became (given under its new form)
        value = node.pop(old_name)
        *new_path, new_name = new.split(".")
        target = tree
        for part in new_path:
            if target.get(part) is None:
                target[part] = {}
            target = target[part]
            if not isinstance(target, dict):
                raise ConfigError(f"{new}: its section is given as a value; {old} cannot move "
                                  f"there")
        if new_name in target:
            raise ConfigError(f"{old} and {new}: the same key under its old and new names; "
                              f"keep {new}")
        target[new_name] = value
        if warn:
            _warn(old, new)
    return tree


def moved_flat(flat: dict) -> dict:
    """A flat ``{dotted key: value}`` mapping with old names replaced by the new ones."""
    return {MOVED_KEYS.get(k, k): v for k, v in flat.items()}
