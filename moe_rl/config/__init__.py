"""Typed configuration: YAML file + ``key.sub=value`` overrides, validated before anything starts.

:mod:`~moe_rl.config.schema` holds every key (type, default, meaning, range);
:mod:`~moe_rl.config.loader` reads YAML and overrides into it; :mod:`~moe_rl.config.checks`
holds the cross-field rules, one small check per concern; :mod:`~moe_rl.config.model_facts` what
the rules need to know about the model. ``load_config`` raises :class:`ConfigError` naming the
offending key.
"""
from moe_rl.config.checks import engine_avg_refusal, validate
from moe_rl.config.loader import (PATH_KEYS, config_from_dict, dump_config, iter_keys,
                                  load_config, load_yaml, parse_override, resolve_paths)
from moe_rl.config.fields import ConfigError, as_dict
from moe_rl.config.init_model import DeepseekInitConfig, ModelInitConfig, init_hf_fields
from moe_rl.config.model_facts import (facts_context, model_hf_fields, model_moe_shape,
                                       probe_temperature, response_cap)
from moe_rl.config.schema import (CORRECTIONS, AlgorithmConfig, ClusterConfig, Config,
                                  CorrectionParams, DPPOConfig, DataConfig, DataSetConfig,
                                  EntropyControlConfig, EvalConfig, KLConfig, LoggingConfig,
                                  ModelConfig, RewardServiceConfig, RolloutConfig, SGLangConfig,
                                  TrainerConfig, set_name)

__all__ = ["load_yaml", "CORRECTIONS", "DPPOConfig", "AlgorithmConfig", "ClusterConfig", "Config",
           "ConfigError", "CorrectionParams", "DataConfig", "DataSetConfig", "DeepseekInitConfig",
           "EvalConfig", "RewardServiceConfig", "set_name", "EntropyControlConfig", "KLConfig",
           "LoggingConfig", "ModelConfig", "ModelInitConfig", "RolloutConfig", "SGLangConfig",
           "TrainerConfig", "PATH_KEYS", "as_dict", "config_from_dict", "dump_config",
           "engine_avg_refusal", "facts_context", "init_hf_fields", "iter_keys", "load_config",
           "model_hf_fields", "model_moe_shape", "parse_override", "probe_temperature",
           "resolve_paths", "response_cap", "validate"]
