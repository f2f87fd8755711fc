"""What a run reads before it starts (model, tokenizer, prompts, reward function), loaded and
checked once, so `moe-rl config` and `moe-rl train` refuse a bad one with the key named."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from moe_rl.config import Config, ConfigError, facts_context, set_name
from moe_rl.config.schema import ClusterConfig, DataConfig, ModelConfig
from moe_rl.data.prompt_rules import check_answer_lengths, check_prompt_lengths, prompt_limit
from moe_rl.data.prompts import PromptRecord, load_prompt_sets, load_prompts, set_source
from moe_rl.envs import load_environment
from moe_rl.rewards.service import reward_scorer, reward_setting


@dataclass
class RunInputs:
    tokenizer: object
    prompts: list[PromptRecord]   # the training sets one after the other
    reward: object   # RewardFunction or RewardService: ``await reward.score(items)``
    environment: type | None = None   # data.environment's class (multi-turn), if any
    set_sizes: list[int] = field(default_factory=list)   # prompts of each training set
    eval_sets: list[tuple[str, list[PromptRecord]]] = field(default_factory=list)

    def prompt_sets(self) -> list[tuple[str, list[PromptRecord]]]:
        """(where, prompts) of the training prompts and of every eval set."""
        return [("training", self.prompts)] + [(f"eval {n}", p) for n, p in self.eval_sets]


def load_eval_sets(cfg: Config, tokenizer) -> list[tuple[str, list[PromptRecord]]]:
    """(name, prompts) of every ``eval.sets`` entry (its first ``eval.max_prompts``); a prompt
    that cannot fit the model's context with the evaluation's new tokens is refused."""
    out = []
    new_tokens, key = ((cfg.eval.max_new_tokens, "eval.max_new_tokens")
        if cfg.eval.max_new_tokens is not None else (cfg.rollout.max_new_tokens,
                                                     "rollout.max_new_tokens"))
    for i, entry in enumerate(cfg.eval.sets):
        if not os.path.isfile(entry.path):
            raise ConfigError(f"eval.sets[{i}].path: {entry.path!r} is not a readable file")
        try:
            prompts = load_prompts(set_source(cfg.data, entry), tokenizer,
                                   prompt_limit(facts_context(cfg.model), new_tokens, key))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"eval.sets[{i}]: {exc}") from None
        prompts = prompts[:cfg.eval.max_prompts]
        check_prompt_lengths(prompts, f"eval.sets[{i}] ({entry.path})",
                             facts_context(cfg.model), new_tokens, key)
        out.append((set_name(entry), prompts))
    return out


def load_run_inputs(cfg: Config, training: bool = True) -> RunInputs:
    """The run's tokenizer, prompts, reward function and environment class; ConfigError naming
    the key whose file, module or content is missing or unreadable. ``training=False``
    (``moe-rl eval``): the training data (``data.path``, ``data.sets``) and the warm start are
    neither read nor checked, and the inputs hold no training prompts."""
    tokenizer = load_tokenizer(cfg.model, cfg.cluster)
    reward, environment = load_user_code(cfg, training)
    if not training:
        return RunInputs(tokenizer, [], reward, environment, [], load_eval_sets(cfg, tokenizer))
    prompts, sizes = load_training_prompts(cfg, tokenizer, with_answers=(
        bool(cfg.trainer.warmup.steps) and environment is None))
    return RunInputs(tokenizer, prompts, reward, environment, sizes,
                     load_eval_sets(cfg, tokenizer))


def load_tokenizer(model: ModelConfig, cluster: ClusterConfig):
    """The tokenizer of ``model.path`` (a local HF checkpoint), or ConfigError saying how to get
    one."""
    from transformers import AutoTokenizer
    path = model.path
    if not os.path.isfile(os.path.join(path, "config.json")):
        hint = ("point model.path at your local copy of the model's Hugging Face checkpoint "
                "(moe-rl init-model writes only the tiny CPU models)" if cluster.gpus_per_node
                else "write the tiny one with `moe-rl init-model --config FILE`, or point "
                     "model.path at a Hugging Face checkpoint")
        raise ConfigError(f"model.path: no local HF model at {path!r} (a directory with "
                          f"config.json); {hint}")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: no tokenizer loads from {path!r}: {exc}") from None


def load_user_code(cfg: Config, training: bool) -> tuple:
    """The reward scorer (``eval.reward`` checked too) and the environment class (None without
    ``data.environment``); a multi-turn warm start needs the environment's demonstrations."""
    try:
        reward = reward_scorer(cfg.data)
        if cfg.eval.reward is not None:   # checked now, loaded where the evaluation runs
            reward_scorer(cfg.data, cfg.eval.reward)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.data.environment is None:
        return reward, None
    try:
        environment = load_environment(cfg.data.environment)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if training and cfg.trainer.warmup.steps and not callable(
            getattr(environment, "demonstration", None)):
        raise ConfigError(f"trainer.warmup.steps: the warm start of a multi-turn run "
                          f"trains on the environment's demonstrations, and "
                          f"{cfg.data.environment!r} has no demonstration(prompt) method; "
                          f"set trainer.warmup.steps=0")
    return reward, environment


def load_training_prompts(cfg: Config, tokenizer, with_answers: bool) -> tuple[list, list[int]]:
    """The training prompts and each set's size, every prompt checked to fit the context with
    ``rollout.max_new_tokens`` (``with_answers``: its answer too, for the warm start)."""
    if cfg.data.source != "toy" and not os.path.isfile(cfg.data.path or ""):
        raise ConfigError(f"data.path: {cfg.data.path!r} is not a readable file")
    for i, entry in enumerate(cfg.data.sets):
        if not os.path.isfile(entry.path):
            raise ConfigError(f"data.sets[{i}].path: {entry.path!r} is not a readable file")
    try:
        prompts, sizes = load_prompt_sets(cfg.data, tokenizer, prompt_limit(
            facts_context(cfg.model), cfg.rollout.max_new_tokens, "rollout.max_new_tokens"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        message = str(exc) if str(exc).startswith("data") else f"data.path: {exc}"
        raise ConfigError(message) from None
    start = 0
    for i, size in enumerate(sizes):   # each training set on its own, rows numbered in it
        where = (f"data.sets[{i}] ({cfg.data.sets[i].path})" if cfg.data.sets else
                 f"data.path ({cfg.data.path or 'the toy task'})")
        check_prompt_lengths(prompts[start:start + size], where, facts_context(cfg.model),
                             cfg.rollout.max_new_tokens, "rollout.max_new_tokens")
        if with_answers:
            check_answer_lengths(prompts[start:start + size], where, facts_context(cfg.model),
                                 tokenizer)
        start += size
    return prompts, sizes


def inputs_summary(data: DataConfig, model: ModelConfig, inputs: RunInputs) -> str:
    """What ``moe-rl config`` checked, in one line."""
    sets = f"{len(inputs.prompts)} training prompts" + (
        f" in {len(inputs.set_sizes)} sets" if data.sets else "")
    evals = "".join(f", eval set {name}: {len(p)} prompts" for name, p in inputs.eval_sets)
    env = f", environment {data.environment}" if inputs.environment is not None else ""
    return (f"inputs checked: model {model.path} (tokenizer loads), {sets}{evals}, "
            f"{reward_setting(data)[0]}{env}; every prompt fits the context")

