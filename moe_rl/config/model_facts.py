"""Facts about the configured model the rules need (its config.json when present, else the
``model.init`` shape): context length, MoE shape, HF fields; and a sample's response cap."""
from __future__ import annotations

import json
import os

from moe_rl.config.fields import ConfigError
from moe_rl.config.init_model import init_hf_fields
from moe_rl.config.schema import Config, ModelConfig
from moe_rl.families.shape import MoEShape


def response_cap(cfg: Config) -> int:
    """Most response tokens of a sample: rollout.max_new_tokens for single-turn completions; with
    an environment, rollout.max_response_tokens (default max_new_tokens x max_turns)."""
    r = cfg.rollout
    if cfg.data.environment is None:
        return r.max_new_tokens
    return r.max_response_tokens or r.max_new_tokens * r.max_turns


def probe_temperature(cfg: Config) -> float:
    """The temperature both sides score the weight check's probe at: the rollout's with the
    keep-sampling-mask (the kept ids are listed, few), else 1 (the engine's prefill log-probs as
    they are: at another temperature renormalising them would list the whole vocabulary at
    every position). Equal weights give equal log-probs at any temperature."""
    return cfg.rollout.sampling.temperature or 1.0 if cfg.algorithm.keep_sampling_mask else 1.0


def facts_context(model: ModelConfig) -> int | None:
    """The model's context length (max_position_embeddings) from its config.json (None when
    there is none yet)."""
    cfg_file = os.path.join(model.path, "config.json")
    if not os.path.isfile(cfg_file):
        return None
    with open(cfg_file, encoding="utf-8") as fh:
        value = json.load(fh).get("max_position_embeddings")
    return int(value) if value else None


def model_hf_fields(model: ModelConfig) -> dict:
    """The configured model's HF ``config.json`` fields: the file when present, else the
    ``init`` shape."""
    cfg_file = os.path.join(model.path, "config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file, encoding="utf-8") as fh:
            return json.load(fh)
    return init_hf_fields(model.init)


def model_moe_shape(model: ModelConfig) -> MoEShape:
    """Facts of the configured model: its config.json when present, else the ``init`` shape
    (a size beyond any model refused naming the field)."""
    try:
        return MoEShape.from_hf(model_hf_fields(model))
    except ValueError as exc:
        where = os.path.join(model.path, "config.json")
        if not os.path.isfile(where):   # the shape init-model would write
            raise ConfigError(f"model.init: {exc} (the shape moe-rl init-model writes to "
                              f"model.path)") from None
        raise ConfigError(f"model.path: {where}: {exc}") from None
