"""What a run reads before it starts (model, tokenizer, prompts, reward function), loaded and
checked once, so `moe-rl config` and `moe-rl train` refuse a bad one with the key named."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from moe_rl.config import Config, ConfigError
from moe_rl.data.prompts import PromptRecord, load_prompt_sets, load_prompts, set_source
from moe_rl.envs import load_environment
from moe_rl.rewards.service import reward_scorer


@dataclass
class RunInputs:
    tokenizer: object
    prompts: list[PromptRecord]   # the training sets one after the other
    reward: object   # RewardFunction or RewardService: ``await reward.score(items)``
    environment: type | None = None   # data.environment's class (multi-turn), if any
    set_sizes: list[int] = field(default_factory=list)   # prompts of each training set
    eval_sets: list[tuple[str, list[PromptRecord]]] = field(default_factory=list)


def load_eval_sets(cfg: Config, tokenizer) -> list[tuple[str, list[PromptRecord]]]:
    """(name, prompts) of every ``eval.sets`` entry (its first ``eval.max_prompts``)."""
    from moe_rl.config import set_name
    out = []
    for i, entry in enumerate(cfg.eval.sets):
        if not os.path.isfile(entry.path):
            raise ConfigError(f"eval.sets[{i}].path: {entry.path!r} is not a readable file")
        try:
            prompts = load_prompts(set_source(cfg.data, entry), tokenizer)
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"eval.sets[{i}]: {exc}") from None
        out.append((set_name(entry), prompts[:cfg.eval.max_prompts]))
    return out


def load_run_inputs(cfg: Config) -> RunInputs:
    """The run's tokenizer, prompts, reward function and environment class; ConfigError naming the key whose file,
    module or content is missing or unreadable."""
    from transformers import AutoTokenizer
    path = cfg.model.path
    if not os.path.isfile(os.path.join(path, "config.json")):
        hint = ("point model.path at your local copy of the model's Hugging Face checkpoint "
                "(moe-rl init-model writes only the tiny CPU models)" if cfg.cluster.gpus_per_node
                else "write the tiny one with `moe-rl init-model --config FILE`, or point "
                     "model.path at a Hugging Face checkpoint")
        raise ConfigError(f"model.path: no local HF model at {path!r} (a directory with "
                          f"config.json); {hint}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: no tokenizer loads from {path!r}: {exc}") from None
    try:
        reward = reward_scorer(cfg.data)
        if cfg.eval.reward is not None:   # checked now, loaded where the evaluation runs
            reward_scorer(cfg.data, cfg.eval.reward)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    environment = None
    if cfg.data.environment is not None:
        try:
            environment = load_environment(cfg.data.environment)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if cfg.trainer.sft_warmup_steps and not callable(getattr(environment, "demonstration",
                                                                 None)):
            raise ConfigError(f"trainer.sft_warmup_steps: the warm start of a multi-turn run "
                              f"trains on the environment's demonstrations, and "
                              f"{cfg.data.environment!r} has no demonstration(prompt) method; "
                              f"set trainer.sft_warmup_steps=0")
    if cfg.data.source != "toy" and not os.path.isfile(cfg.data.path or ""):
        raise ConfigError(f"data.path: {cfg.data.path!r} is not a readable file")
    for i, entry in enumerate(cfg.data.sets):
        if not os.path.isfile(entry.path):
            raise ConfigError(f"data.sets[{i}].path: {entry.path!r} is not a readable file")
    try:
        prompts, sizes = load_prompt_sets(cfg.data, tokenizer)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(str(exc) if str(exc).startswith("data") else f"data.path: {exc}") \
            from None
    return RunInputs(tokenizer, prompts, reward, environment, sizes,
                     load_eval_sets(cfg, tokenizer))
