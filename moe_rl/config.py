"""Typed configuration: YAML file + ``key.sub=value`` overrides, validated before anything starts.

Every default lives in the dataclasses below and nowhere else. ``load_config`` reads a YAML file,
applies command-line overrides, checks names, types, ranges and cross-field combinations, and
raises :class:`ConfigError` naming the offending key.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from moe_rl.errors import UserError
from moe_rl.moe_shape import MoEShape


class ConfigError(UserError, ValueError):
    """A configuration problem, with the dotted key it concerns."""


def _rng(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
         hi_open: bool = False) -> dict:
    return {"range": (lo, hi, lo_open, hi_open)}


def _f(default: Any, doc: str, **meta: Any) -> Any:
    """A dataclass field with a default, a one-line doc (for README) and optional range."""
    meta = dict(meta)
    meta["doc"] = doc
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _sub(cls: type, doc: str) -> Any:
    return field(default_factory=cls, metadata={"doc": doc})


@dataclass
class DeepseekInitConfig:
    """DeepSeek-V3-only shape of the tiny model (``model.init.architecture: deepseek_v3``)."""
    q_lora_rank: int | None = _f(32, "query LoRA rank of MLA (null = full query projection)",
                                 **_rng(1))
    kv_lora_rank: int = _f(32, "compressed key/value (latent) size of MLA", **_rng(1))
    qk_nope_head_dim: int = _f(16, "per-head query/key size without rotary", **_rng(1))
    qk_rope_head_dim: int = _f(8, "per-head rotary query/key size (even)", **_rng(2))
    v_head_dim: int = _f(16, "per-head value size", **_rng(1))
    n_group: int = _f(4, "expert groups of the group-limited router", **_rng(1))
    topk_group: int = _f(2, "groups a token may use (num_experts_per_tok / topk_group must be 2 "
                         "when < n_group)", **_rng(1))
    n_shared_experts: int = _f(1, "shared (always-on, never routed) experts per MoE layer",
                               **_rng(0))
    first_k_dense_replace: int = _f(1, "leading dense layers", **_rng(0))
    routed_scaling_factor: float = _f(2.5, "scale of the routed experts' gate weights",
                                      **_rng(0, lo_open=True))
    expert_bias_std: float = _f(0.01, "std of the random initial expert bias "
                                "(e_score_correction_bias)", **_rng(0))


@dataclass
class ModelInitConfig:
    """Shape of the tiny model written by ``moe-rl init-model`` (Qwen3-MoE or DeepSeek-V3)."""
    architecture: Literal["qwen3_moe", "deepseek_v3"] = _f(
        "qwen3_moe", "qwen3_moe, or deepseek_v3 (MLA, sigmoid router with expert bias, "
        "group-limited top-k, shared experts; shaped further by model.init.deepseek)")
    hidden_size: int = _f(64, "hidden size", **_rng(1))
    num_hidden_layers: int = _f(2, "decoder layers", **_rng(1))
    num_attention_heads: int = _f(4, "attention heads", **_rng(1))
    num_key_value_heads: int = _f(2, "key/value heads (GQA)", **_rng(1))
    head_dim: int = _f(16, "attention head dimension", **_rng(1))
    intermediate_size: int = _f(128, "dense MLP size (dense layers only)", **_rng(1))
    moe_intermediate_size: int = _f(64, "expert MLP size", **_rng(1))
    num_experts: int = _f(8, "routed experts per MoE layer", **_rng(1, 65535))
    num_experts_per_tok: int = _f(2, "router top-k", **_rng(1))
    decoder_sparse_step: int = _f(1, "every n-th layer is MoE", **_rng(1))
    norm_topk_prob: bool = _f(True, "renormalise the top-k gate probabilities")
    max_position_embeddings: int = _f(256, "maximum sequence length", **_rng(1))
    rope_theta: float = _f(10000.0, "rotary base", **_rng(0, lo_open=True))
    rms_norm_eps: float = _f(1e-6, "RMSNorm epsilon", **_rng(0, lo_open=True))
    tie_word_embeddings: bool = _f(False, "tie input and output embeddings")
    seed: int = _f(0, "weight initialisation seed")
    deepseek: DeepseekInitConfig = _sub(DeepseekInitConfig, "DeepSeek-V3-only shape "
                                        "(num_key_value_heads, head_dim, decoder_sparse_step "
                                        "do not apply to it)")


@dataclass
class ModelConfig:
    path: str = _f("outputs/tiny_model", "Hugging Face model directory (config.json + safetensors)")
    dtype: Literal["float32", "bfloat16"] = _f("float32",
                                               "trainer parameter dtype (bfloat16: GPUs only)")
    fp32_output_layer: bool = _f(False, "keep the output layer (LM head) in float32")
    init: ModelInitConfig = _sub(ModelInitConfig, "tiny model shape for `moe-rl init-model`")


@dataclass
class SGLangConfig:
    tp_size: int = _f(1, "SGLang --tp-size", **_rng(1))
    dp_size: int = _f(1, "SGLang --dp-size", **_rng(1))
    ep_size: int = _f(1, "SGLang --ep-size", **_rng(1))
    mem_fraction_static: float = _f(0.7, "SGLang --mem-fraction-static", **_rng(0, 1, lo_open=True))
    deterministic_inference: bool = _f(False, "--enable-deterministic-inference for SGLang and "
                                       "the reference engine: batch-invariant results, "
                                       "reproducible runs (makes n-pass averaging useless)")
    extra_args: list[str] = _f([], "extra command-line arguments passed to sglang.launch_server")
    python: str | None = _f(None, "the Python interpreter that runs `-m sglang.launch_server` "
                            "(SGLang in its own environment; null = the trainer's)")


@dataclass
class RolloutConfig:
    engine: Literal["reference", "sglang"] = _f("reference", "inference engine: CPU reference or SGLang")
    num_servers: int = _f(1, "engine servers behind the dispatcher", **_rng(1))
    host: str = _f("127.0.0.1", "address the engine servers bind")
    base_port: int = _f(30000, "first server port tried: servers take the free ports from here "
                        "up, busy ones skipped", **_rng(1, 65535))
    api_key: str | None = _f(None, "API key the servers require (Authorization: Bearer)")
    engine_dtype: Literal["float32", "bfloat16"] = _f("float32", "reference engine dtype")
    quantization: Literal["none", "fp8"] = _f("none", "rollout numerics: fp8 = the engines serve "
                                              "a block-wise FP8 checkpoint of the weights "
                                              "(128x128 E4M3 blocks), every sync quantised")
    prompts_per_step: int = _f(8, "prompts sampled per RL step", **_rng(1))
    n_samples_per_prompt: int = _f(8, "responses per prompt (the GRPO group size)", **_rng(1))
    max_staleness: int = _f(0, "asynchronous pipeline: the rollout generates the next batches "
                            "while the trainer trains, from weights at most this many versions "
                            "old (0 = the synchronous loop)", **_rng(0))
    dynamic_sampling: bool = _f(False, "drop prompt groups whose rewards are all equal and "
                                "generate more until the step has prompts_per_step informative "
                                "groups (DAPO)")
    max_oversample: int | None = _f(None, "dynamic sampling: most extra prompt groups generated "
                                    "per step (null = prompts_per_step)", **_rng(0))
    max_new_tokens: int = _f(16, "response length cap (with data.environment: per model turn)",
                             **_rng(1))
    max_turns: int = _f(4, "data.environment: most model turns per trajectory", **_rng(1))
    max_response_tokens: int | None = _f(None, "data.environment: cap on a trajectory's response "
                                         "(model + observation tokens; null = max_new_tokens x "
                                         "max_turns)", **_rng(1))
    temperature: float = _f(1.0, "sampling temperature (0 = greedy)", **_rng(0))
    top_p: float = _f(1.0, "nucleus sampling mass", **_rng(0, 1, lo_open=True))
    top_k: int = _f(-1, "top-k sampling (-1 = off)", **_rng(-1))
    min_p: float = _f(0.0, "min-p relative to the most likely token", **_rng(0, 1))
    sampling_mask_max_tokens: int = _f(4096, "engine cap on the kept-set size (SGLang "
                                       "--sampling-mask-max-tokens)", **_rng(2))
    return_routing: bool = _f(True, "ask for every token's routing (replay r3 always does; "
                              "otherwise it only feeds routing/agreement)")
    score_window_tokens: int = _f(32, "response tokens per engine scoring request when pi_old "
                                  "passes are renormalised from listed ids (kept sets, or the "
                                  "vocabulary at temperature != 1)", **_rng(1))
    score_full_vocab_max: int = _f(4096, "largest vocabulary for which engine_avg scoring at "
                                   "temperature != 1 without the sampling mask lists every id",
                                   **_rng(1))
    request_timeout_s: float = _f(300.0, "HTTP timeout per request", **_rng(0, lo_open=True))
    max_retries: int = _f(3, "retries per request on connection errors / 5xx", **_rng(0))
    concurrency: int = _f(64, "in-flight requests per server", **_rng(1))
    health_timeout_s: float = _f(300.0, "wait for a starting server's /health", **_rng(0, lo_open=True))
    sglang: SGLangConfig = _sub(SGLangConfig, "SGLang server settings")


@dataclass
class CorrectionParams:
    tis_c: float = _f(2.0, "token-TIS and seq-TIS truncation C", **_rng(0, lo_open=True))
    mis_c: float = _f(2.0, "seq-MIS threshold C", **_rng(0, lo_open=True))
    rs_low: float = _f(0.5, "seq-RS lower bound", **_rng(0))
    rs_high: float = _f(2.0, "seq-RS upper bound", **_rng(0, lo_open=True))
    geo_low: float = _f(0.999, "geo-RS lower bound", **_rng(0))
    geo_high: float = _f(1.001, "geo-RS upper bound", **_rng(0, lo_open=True))
    icepop_low: float = _f(0.5, "IcePop lower bound alpha", **_rng(0))
    icepop_high: float = _f(5.0, "IcePop upper bound beta", **_rng(0, lo_open=True))
    opsm_delta: float | None = _f(None, "DeepSeek-V3.2 off-policy mask threshold delta", **_rng(0))
    opsm_reference: Literal["engine", "pi_old"] = _f("engine", "behaviour policy of the DeepSeek mask")
    metropolis_weight: Literal["seq", "geo", "token"] = _f("seq", "weight the Metropolis sampler uses")
    metropolis_count_repeats: bool = _f(True, "Metropolis as a chain: a sample weighs the steps "
                                        "it was the state (false: accept-or-mask, biased)")


CORRECTIONS = ("token_tis", "seq_tis", "seq_mis", "seq_rs", "geo_rs", "icepop", "opsm",
               "metropolis", "snis")


@dataclass
class KLConfig:
    coef: float = _f(0.0, "KL coefficient (0 = no reference model)", **_rng(0))
    estimator: Literal["k1", "k2", "k3"] = _f("k3", "KL estimator")
    off_policy_corrected: bool = _f(False, "weight k3 by pi_theta/pi_old (DeepSeek-V3.2)")
    in_reward: bool = _f(False, "fold the KL into the reward instead of the loss")
    replay_routing: bool = _f(True, "the reference model replays the rollout routing too")


@dataclass
class EntropyControlConfig:
    method: Literal["none", "clip_cov", "kl_cov"] = _f("none", "entropy-collapse control")
    clip_cov_ratio: float = _f(2e-4, "Clip-Cov: fraction of tokens in the band detached",
                               **_rng(0, 1))
    clip_cov_low: float = _f(1.0, "Clip-Cov: lower covariance bound omega_low")
    clip_cov_high: float = _f(5.0, "Clip-Cov: upper covariance bound omega_high")
    kl_cov_ratio: float = _f(2e-3, "KL-Cov: top fraction by covariance penalised", **_rng(0, 1))
    kl_cov_coef: float = _f(1.0, "KL-Cov: coefficient beta", **_rng(0))


@dataclass
class AlgorithmConfig:
    advantage: Literal["grpo", "drgrpo", "rloo"] = _f("grpo", "advantage estimator")
    loss: Literal["ppo", "gspo"] = _f("ppo", "policy loss: token PPO-clip (GRPO) or GSPO")
    clip_low: float = _f(0.2, "epsilon_low of the ratio clip (GSPO paper: 3e-4)")
    clip_high: float = _f(0.28, "epsilon_high of the ratio clip (GSPO paper: 4e-4)")
    dual_clip_c: float | None = _f(3.0, "dual-clip cap c for negative advantages (null = off)",
                                   **_rng(1, lo_open=True))
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                         "seq-mean-token-sum-norm"] = _f("token-mean", "loss aggregation")
    loss_denominator: Literal["original", "kept"] = _f(
        "original", "normaliser of the aggregated loss: every response token (as verl, NeMo-RL, "
        "OpenRLHF: a masked token is a zero-weight sample) or only the tokens the corrections "
        "kept")
    max_len_norm: int | None = _f(None, "constant of seq-mean-token-sum-norm (null = "
                                  "rollout.max_new_tokens, or the response cap with "
                                  "data.environment)", **_rng(1))
    pi_old: Literal["trainer", "rollout", "engine_avg"] = _f("trainer", "source of pi_old")
    pi_old_passes: int = _f(1, "n scoring passes averaged for engine_avg")
    replay: Literal["off", "r2", "r3"] = _f("r3", "routing replay mode")
    keep_sampling_mask: bool = _f(False, "score tokens on the engine's top-k/top-p kept set")
    corrections: list[str] = _f([], "training-inference corrections, applied in order: "
                                + ", ".join(CORRECTIONS))
    correction: CorrectionParams = _sub(CorrectionParams, "correction thresholds")
    kl: KLConfig = _sub(KLConfig, "KL to the reference policy")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient", **_rng(0))
    entropy_control: EntropyControlConfig = _sub(EntropyControlConfig, "Clip-Cov / KL-Cov")
    collapse_guard_k3: float | None = _f(None, "skip the update when mismatch/k3 exceeds this "
                                         "(null = off)", **_rng(0, lo_open=True))


@dataclass
class TrainerConfig:
    steps: int = _f(20, "RL steps", **_rng(1))
    seed: int = _f(1234, "global seed", **_rng(0, 2 ** 32 - 1))
    lr: float = _f(1e-5, "peak learning rate", **_rng(0, lo_open=True))
    min_lr: float = _f(0.0, "final learning rate of the schedule", **_rng(0))
    lr_warmup_steps: int = _f(0, "linear warm-up steps", **_rng(0))
    lr_schedule: Literal["constant", "linear", "cosine"] = _f("constant", "decay after warm-up")
    weight_decay: float = _f(0.0, "AdamW weight decay", **_rng(0))
    adam_beta1: float = _f(0.9, "Adam beta1", **_rng(0, 1, hi_open=True))
    adam_beta2: float = _f(0.999, "Adam beta2", **_rng(0, 1, hi_open=True))
    grad_clip: float = _f(1.0, "gradient-norm clip (0 = off)", **_rng(0))
    epochs: int = _f(1, "passes over each rollout batch", **_rng(1))
    mini_batches: int = _f(1, "optimizer steps per epoch (the batch is split in this many)",
                           **_rng(1))
    micro_batch_size: int = _f(8, "sequences per micro-batch (gradient accumulation)", **_rng(1))
    tensor_parallel: int = _f(1, "tensor-parallel size", **_rng(1))
    pipeline_parallel: int = _f(1, "pipeline-parallel size", **_rng(1))
    expert_parallel: int = _f(1, "expert-parallel size", **_rng(1))
    context_parallel: int = _f(1, "context-parallel size", **_rng(1))
    sequence_parallel: bool = _f(False, "sequence parallelism (needs tensor_parallel > 1)")
    recompute_activations: bool = _f(False, "full activation recomputation (replay in backward)")
    distributed_optimizer: bool = _f(True, "megatron distributed optimizer where available")
    ema_decay: float | None = _f(None, "Polyak average of the weights, updated after every "
                                 "optimizer step and exported as final_hf (rollouts keep the raw "
                                 "weights; null = off)",
                                 **_rng(0, 1, lo_open=True, hi_open=True))
    expert_bias_update_rate: float = _f(0.0, "DeepSeek-V3 routers: megatron's aux-loss-free "
                                        "expert-bias update per optimizer step, from the "
                                        "batch's tokens per expert (0 = frozen, the default)",
                                        **_rng(0))
    sft_warmup_steps: int = _f(0, "supervised warm-start steps before RL", **_rng(0))
    sft_lr: float = _f(1e-3, "learning rate of the supervised warm-start", **_rng(0, lo_open=True))
    save_interval: int = _f(50, "checkpoint every n steps (0 = by time and at the end only)",
                            **_rng(0))
    save_interval_minutes: float = _f(30.0, "also checkpoint when this many minutes passed since "
                                      "the last checkpoint (whichever of steps or minutes comes "
                                      "first; 0 = by steps only)", **_rng(0))
    stop_grace_s: float = _f(120.0, "on SIGINT / SIGTERM / SIGUSR1, seconds the current step and "
                             "its checkpoint may still take; past them the step is abandoned",
                             **_rng(0, lo_open=True))
    checkpoint_dir: str | None = _f(None, "checkpoint folder (null = <logging.dir>/checkpoints)")
    keep_checkpoints: int = _f(2, "saved steps kept (iter_NNNNNNN/ folders; older ones are "
                               "removed once a newer one is complete)", **_rng(1))
    export_hf: bool = _f(True, "export the final policy as a Hugging Face model")
    export_hf_interval: int = _f(0, "also export the policy as a Hugging Face model every n "
                                 "steps, to <logging.dir>/hf/iter_NNNNNNN (0 = never)", **_rng(0))


@dataclass
class ClusterConfig:
    num_nodes: int = _f(1, "nodes", **_rng(1))
    gpus_per_node: int = _f(0, "GPUs per node (0 = CPU run)", **_rng(0))
    trainer_workers: int = _f(1, "trainer ranks (one Ray actor each)", **_rng(1))
    colocate: bool = _f(False, "engines and trainer share devices; engine memory released "
                        "during training")
    weight_sync: Literal["disk", "distributed", "tensor"] = _f(
        "disk", "trainer -> engine weights: HF checkpoint on disk; broadcast over a process "
        "group (NCCL on GPUs, gloo on CPU); or CUDA tensors handed to colocated SGLang")
    weight_sync_bucket_mb: float = _f(
        512.0, "the policy streams to the engines in buckets of this many MiB (every sync "
        "mode; also the shard size of exported checkpoints); a rank's extra memory during a "
        "sync stays within one bucket plus the largest tensor", **_rng(0, lo_open=True))
    ray_address: str | None = _f(None, "Ray cluster address (null = start a local Ray)")
    cpus_per_worker: float = _f(1.0, "CPUs reserved per Ray actor", **_rng(0, lo_open=True))


@dataclass
class DataConfig:
    source: Literal["toy", "jsonl", "parquet"] = _f("toy", "prompt source")
    path: str | None = _f(None, "dataset file for jsonl / parquet")
    prompt_key: str = _f("prompt", "column holding the prompt text")
    answer_key: str = _f("answer", "column holding the reference answer")
    chat_template: bool = _f(True, "wrap prompts with the tokenizer's chat template")
    reward: str = _f("toy", "reward: toy | math | module:function")
    environment: str | None = _f(None, "multi-turn environment: calculator | module:Class (null "
                                 "= single-turn completions scored by data.reward; with an "
                                 "environment, the environment gives the reward)")
    max_failed_reward_batches: int = _f(1, "stop the run when the reward function failed on "
                                        "every sample of this many batches in a row", **_rng(1))
    reward_timeout_s: float = _f(60.0, "seconds one reward call may take; past it the sample is "
                                 "dropped and counted (reward/timeouts)", **_rng(0, lo_open=True))
    environment_timeout_s: float = _f(60.0, "seconds one environment call (constructor, reset, "
                                      "step) may take; past it the trajectory is dropped and "
                                      "counted (rollout/env_timeouts)", **_rng(0, lo_open=True))
    toy_max_operand: int = _f(9, "toy task: largest operand of the additions", **_rng(1))
    toy_size: int = _f(512, "toy task: number of prompts", **_rng(1))
    shuffle_seed: int = _f(0, "seed of the deterministic shuffle", **_rng(0, 2 ** 32 - 1))


@dataclass
class LoggingConfig:
    dir: str = _f("runs/default", "run directory: TensorBoard events, metrics.jsonl, checkpoints")
    tensorboard: bool = _f(True, "write TensorBoard event files")
    jsonl: bool = _f(True, "write metrics.jsonl")
    progress: bool = _f(True, "per-step progress on the console: a bar on a terminal, else one "
                        "line per logging.log_interval steps on stdout")
    log_interval: int = _f(1, "steps between progress lines when the console is not a terminal "
                           "(nohup, Slurm, a pipe); the last step is always shown", **_rng(1))


@dataclass
class Config:
    model: ModelConfig = _sub(ModelConfig, "policy model")
    rollout: RolloutConfig = _sub(RolloutConfig, "rollout engine and sampling")
    algorithm: AlgorithmConfig = _sub(AlgorithmConfig, "losses, pi_old, replay, corrections")
    trainer: TrainerConfig = _sub(TrainerConfig, "optimisation and parallelism")
    cluster: ClusterConfig = _sub(ClusterConfig, "devices and Ray")
    data: DataConfig = _sub(DataConfig, "prompts and rewards")
    logging: LoggingConfig = _sub(LoggingConfig, "outputs")


# ----------------------------------------------------------------------------------------------
# Building typed values from plain data


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on as false/true
            value = {False: "off", True: "on"}[value]
        if value in typing.get_args(tp):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(tp)], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}{hint}")
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        (arg,) = typing.get_args(tp)
        return [_coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a boolean (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # PyYAML reads "1e-5" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp!r}")  # pragma: no cover - schema error


def _check_range(value: Any, meta: dict, key: str) -> None:
    if value is None or "range" not in meta:
        return
    lo, hi, lo_open, hi_open = meta["range"]
    bad = ((lo is not None and (value <= lo if lo_open else value < lo))
           or (hi is not None and (value >= hi if hi_open else value > hi)))
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        lo_s = "-inf" if lo is None else repr(lo)
        hi_s = "inf" if hi is None else repr(hi)
        raise ConfigError(f"{key}: {value!r} is out of range, expected a value in "
                          f"{left}{lo_s}, {hi_s}{right}")


def _unknown_key(cls: type, name: str, prefix: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{prefix}{name}'{hint} "
                       f"(valid keys under '{prefix or '<top>'}': {', '.join(names)})")


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking every key and value."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            raise _unknown_key(cls, str(name), prefix)
        tp = hints[name]
        key = prefix + name
        if _is_dataclass_type(tp):
            kwargs[name] = _build(tp, value, key + ".")
        else:
            kwargs[name] = _coerce(value, tp, key)
            _check_range(kwargs[name], fields[name].metadata, key)
    return cls(**kwargs)


def _to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``a.b.c``, validating names against the schema."""
    parts = dotted.split(".")
    cls: type = Config
    node = tree
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i]) + ("." if i else "")
        names = {f.name for f in dataclasses.fields(cls)}
        if part not in names:
            raise _unknown_key(cls, part, prefix)
        tp = typing.get_type_hints(cls)[part]
        if i == len(parts) - 1:
            if _is_dataclass_type(tp) and not isinstance(value, dict):
                raise ConfigError(f"{dotted}: is a section; set one of its keys, e.g. "
                                  f"{dotted}.{dataclasses.fields(tp)[0].name}=...")
            node[part] = value
            return
        if not _is_dataclass_type(tp):
            raise ConfigError(f"{'.'.join(parts[:i + 1])}: is a value, not a section "
                              f"(cannot set '{dotted}')")
        cls = tp
        if node.get(part) is None:
            node[part] = {}
        if not isinstance(node[part], dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])}: expected a mapping, got {node[part]!r}")
        node = node[part]


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key.sub=value``; the value is parsed as YAML (numbers, booleans, null, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {exc}") from None
    return key, value


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"config file: key {key!r} is given twice in one mapping "
                                  f"(line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML ``path`` (optional), apply ``overrides`` and return a validated :class:`Config`."""
    tree: dict = {}
    if path is not None:
        from moe_rl.shipped import config_path, shipped_configs
        path = config_path(os.fspath(path))
        if not os.path.exists(path):
            raise ConfigError(f"config file not found: {path} (shipped configs, usable by name: "
                              f"{', '.join(sorted(shipped_configs()))})")
        if os.path.isdir(path):
            raise ConfigError(f"config file {path}: is a directory; give a YAML file")
        try:
            with open(path, encoding="utf-8") as fh:
                tree = yaml.load(fh, Loader=_UniqueKeyLoader) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path}: not UTF-8 text") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level")
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    cfg = _build(Config, tree, "")
    resolve_paths(cfg)
    validate(cfg)
    return cfg


# file and folder keys; relative ones resolve against the current directory when the config is
# loaded (so every process of the run, on every node, sees the same absolute path)
PATH_KEYS = ("model.path", "data.path", "logging.dir", "trainer.checkpoint_dir")


def resolve_paths(cfg: Config) -> None:
    """Make the :data:`PATH_KEYS` of ``cfg`` absolute (``~`` expanded; relative to the current
    directory)."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value:
            setattr(getattr(cfg, section), name, os.path.abspath(os.path.expanduser(value)))


def config_from_dict(tree: dict) -> Config:
    """Build and validate a :class:`Config` from a plain nested dict."""
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def dump_config(cfg: Config) -> str:
    """The resolved configuration as YAML (printed at start, saved in the run directory)."""
    return yaml.safe_dump(_to_dict(cfg), sort_keys=False, default_flow_style=False)


# ----------------------------------------------------------------------------------------------
# Model facts needed by validation


def response_cap(cfg: Config) -> int:
    """Most response tokens of a sample: rollout.max_new_tokens for single-turn completions; with
    an environment, rollout.max_response_tokens (default max_new_tokens x max_turns)."""
    r = cfg.rollout
    if cfg.data.environment is None:
        return r.max_new_tokens
    return r.max_response_tokens or r.max_new_tokens * r.max_turns


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


def model_moe_facts(model: ModelConfig) -> MoEShape:
    """Facts of the configured model: its config.json when present, else the ``init`` shape."""
    return MoEShape.from_hf(model_hf_fields(model))


def init_hf_fields(init: ModelInitConfig) -> dict:
    """The ``model.init`` shape under the names of the architecture's HF ``config.json``."""
    fields = _to_dict(init)
    deepseek = fields.pop("deepseek")
    fields["model_type"] = fields.pop("architecture")
    if init.architecture == "deepseek_v3":
        deepseek.pop("expert_bias_std")
        for key in ("num_key_value_heads", "head_dim", "decoder_sparse_step"):
            fields.pop(key)
        fields.update(deepseek, n_routed_experts=fields.pop("num_experts"))
    return fields


# ----------------------------------------------------------------------------------------------
# Cross-field validation


def engine_avg_refusal(cfg: Config, vocab_size: int | None) -> None:
    """engine_avg pi_old at temperature T != 1 without the sampling mask needs the engine's raw
    log-probs of the whole vocabulary at every position (SGLang's prefill log-probs ignore T):
    exact, but refused above ``rollout.score_full_vocab_max`` ids (``vocab_size`` None: unknown
    yet; the rollout worker checks again with the served model)."""
    a, r = cfg.algorithm, cfg.rollout
    if a.pi_old != "engine_avg" or a.keep_sampling_mask or r.temperature in (0.0, 1.0):
        return
    if vocab_size is not None and vocab_size > r.score_full_vocab_max:
        raise ConfigError(
            f"algorithm.pi_old: engine_avg at rollout.temperature={r.temperature} needs the "
            f"engine's log-probs at that temperature, but SGLang's prefill (scoring) log-probs "
            f"are at T = 1; renormalising them exactly needs all {vocab_size} vocabulary ids at "
            f"every position (rollout.score_full_vocab_max={r.score_full_vocab_max}). Use "
            f"algorithm.keep_sampling_mask=true (exact from the kept ids), rollout.temperature=1, "
            f"or algorithm.pi_old=trainer")


def _check_deepseek_init(init: ModelInitConfig) -> None:
    d = init.deepseek
    if d.qk_rope_head_dim % 2:
        raise ConfigError(f"model.init.deepseek.qk_rope_head_dim: must be even, got "
                          f"{d.qk_rope_head_dim}")
    if init.num_experts % d.n_group:
        raise ConfigError(f"model.init.deepseek.n_group: {d.n_group} must divide "
                          f"model.init.num_experts ({init.num_experts})")
    if d.topk_group > d.n_group:
        raise ConfigError(f"model.init.deepseek.topk_group: {d.topk_group} exceeds n_group "
                          f"({d.n_group})")
    if d.topk_group < d.n_group and init.num_experts_per_tok != 2 * d.topk_group:
        raise ConfigError(f"model.init.deepseek.topk_group: group-limited routing needs "
                          f"num_experts_per_tok = 2 x topk_group (both transformers and "
                          f"megatron-core rank a group by its best experts), got "
                          f"{init.num_experts_per_tok} and {d.topk_group}")
    if d.first_k_dense_replace >= init.num_hidden_layers:
        raise ConfigError(f"model.init.deepseek.first_k_dense_replace: {d.first_k_dense_replace} "
                          f"leaves no MoE layer of {init.num_hidden_layers}")


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` for incompatible combinations of otherwise valid values."""
    a, r, t, m = cfg.algorithm, cfg.rollout, cfg.trainer, cfg.model
    init = m.init
    if init.num_experts_per_tok > init.num_experts:
        raise ConfigError(f"model.init.num_experts_per_tok: {init.num_experts_per_tok} exceeds "
                          f"model.init.num_experts = {init.num_experts}")
    if init.architecture == "qwen3_moe" and init.num_attention_heads % init.num_key_value_heads:
        raise ConfigError("model.init.num_key_value_heads: must divide model.init."
                          f"num_attention_heads ({init.num_attention_heads})")
    if init.architecture == "deepseek_v3":
        _check_deepseek_init(init)
    facts = model_moe_facts(m)
    if a.replay != "off" and not facts.moe_layers:
        raise ConfigError(f"algorithm.replay: '{a.replay}' needs a model with MoE layers, but "
                          f"{m.path} has none; set algorithm.replay=off")
    if r.base_port + r.num_servers - 1 > 65535:
        raise ConfigError(f"rollout.base_port: servers use ports {r.base_port}.."
                          f"{r.base_port + r.num_servers - 1}, beyond 65535")
    if not cfg.logging.dir.strip():
        raise ConfigError("logging.dir: expected a directory path, got an empty string")
    context = facts_context(m)
    if context is not None and r.max_new_tokens >= context:
        raise ConfigError(f"rollout.max_new_tokens: {r.max_new_tokens} leaves no room for a "
                          f"prompt in the model's context ({context} positions)")
    if cfg.data.environment is not None and context is not None \
            and response_cap(cfg) >= context:
        raise ConfigError(f"rollout.max_response_tokens: a trajectory's response of up to "
                          f"{response_cap(cfg)} tokens leaves no room for a prompt in the "
                          f"model's context ({context} positions)")
    if r.top_k == 0:
        raise ConfigError("rollout.top_k: 0 is not valid; use -1 for no top-k or a value >= 1")
    if a.keep_sampling_mask:
        if not (1 < r.top_k <= r.sampling_mask_max_tokens):
            raise ConfigError(
                "algorithm.keep_sampling_mask: needs a finite rollout.top_k with 1 < top_k < "
                f"rollout.sampling_mask_max_tokens ({r.sampling_mask_max_tokens}); got "
                f"rollout.top_k={r.top_k}")
        if r.temperature == 0:
            raise ConfigError("algorithm.keep_sampling_mask: greedy sampling (rollout.temperature"
                              "=0) keeps one token; turn the mask off")
    engine_avg_refusal(cfg, facts.vocab_size)
    if a.pi_old == "engine_avg" and a.pi_old_passes < 1:
        raise ConfigError(f"algorithm.pi_old_passes: engine_avg needs n >= 1, got "
                          f"{a.pi_old_passes}")
    if a.pi_old_passes < 1:
        raise ConfigError(f"algorithm.pi_old_passes: expected >= 1, got {a.pi_old_passes}")
    if a.entropy_control.method == "kl_cov" and a.loss != "ppo":
        raise ConfigError("algorithm.entropy_control.method: kl_cov replaces the token PPO "
                          "surrogate (unclipped -A r + penalty); it needs algorithm.loss=ppo")
    if a.loss == "gspo" and (a.clip_low <= 0 or a.clip_high <= 0):
        raise ConfigError(f"algorithm.clip_low/clip_high: GSPO needs positive clip ranges, got "
                          f"{a.clip_low} / {a.clip_high}")
    if a.clip_low < 0 or a.clip_high < 0:
        raise ConfigError("algorithm.clip_low/clip_high: clip ranges must be >= 0")
    if a.loss == "gspo" and a.aggregation != "seq-mean-token-mean":
        raise ConfigError(f"algorithm.aggregation: GSPO's token form has the sequence objective's "
                          f"gradient only under seq-mean-token-mean; got {a.aggregation!r}")
    if a.clip_low >= 1:
        raise ConfigError(f"algorithm.clip_low: must be < 1 (ratio floor 1 - clip_low), got "
                          f"{a.clip_low}")
    for i, name in enumerate(a.corrections):
        if name not in CORRECTIONS:
            close = difflib.get_close_matches(name, CORRECTIONS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"algorithm.corrections[{i}]: unknown correction '{name}'{hint}; "
                              f"valid: {', '.join(CORRECTIONS)}")
    if len(set(a.corrections)) != len(a.corrections):
        raise ConfigError(f"algorithm.corrections: a correction is listed twice: {a.corrections}")
    if "opsm" in a.corrections and a.correction.opsm_delta is None:
        raise ConfigError("algorithm.correction.opsm_delta: the DeepSeek off-policy mask ('opsm' "
                          "in algorithm.corrections) needs a threshold delta")
    c = a.correction
    for lo, hi in (("rs_low", "rs_high"), ("geo_low", "geo_high"), ("icepop_low", "icepop_high")):
        if getattr(c, lo) >= getattr(c, hi):
            raise ConfigError(f"algorithm.correction.{lo}: must be below algorithm.correction.{hi}"
                              f" ({getattr(c, lo)} >= {getattr(c, hi)})")
    if a.kl.in_reward and a.kl.coef == 0:
        raise ConfigError("algorithm.kl.in_reward: needs algorithm.kl.coef > 0")
    if a.entropy_control.method == "clip_cov" and (a.entropy_control.clip_cov_low
                                                    >= a.entropy_control.clip_cov_high):
        raise ConfigError("algorithm.entropy_control.clip_cov_low: must be below clip_cov_high")
    if r.n_samples_per_prompt < 2 and a.advantage in ("grpo", "rloo"):
        raise ConfigError(f"rollout.n_samples_per_prompt: '{a.advantage}' advantages need groups "
                          f"of at least 2, got {r.n_samples_per_prompt}")
    if t.min_lr > t.lr:
        raise ConfigError(f"trainer.min_lr: {t.min_lr} exceeds trainer.lr = {t.lr}")
    if t.sequence_parallel and t.tensor_parallel == 1:
        raise ConfigError("trainer.sequence_parallel: needs trainer.tensor_parallel > 1")
    if facts.moe_layers and facts.num_experts % t.expert_parallel:
        raise ConfigError(f"trainer.expert_parallel: {t.expert_parallel} does not divide the "
                          f"{facts.num_experts} experts")
    if t.pipeline_parallel > 1:
        raise ConfigError("trainer.pipeline_parallel: the training step runs the model without "
                          "megatron's pipeline schedules; use 1 (data, expert, tensor and context "
                          "parallelism are supported)")
    if cfg.cluster.gpus_per_node == 0:
        if r.engine == "sglang":
            raise ConfigError("rollout.engine: SGLang needs GPUs (cluster.gpus_per_node > 0); use "
                              "rollout.engine=reference on CPU")
        if cfg.model.dtype == "bfloat16":
            raise ConfigError("model.dtype: bfloat16 training needs GPUs (cluster.gpus_per_node > "
                              "0): megatron-core's mixed-precision optimizer wraps CUDA tensors "
                              "only; use float32 on CPU (rollout.engine_dtype=bfloat16 still "
                              "gives a bfloat16 engine)")
        for key in ("tensor_parallel", "context_parallel"):
            if getattr(t, key) > 1:
                raise ConfigError(f"trainer.{key}: > 1 is not supported on CPU (megatron-core's "
                                  "local spec refuses sequence parallelism there); run it on GPUs")
    if cfg.cluster.weight_sync == "tensor" and not (cfg.cluster.colocate and r.engine == "sglang"
                                                    and cfg.cluster.gpus_per_node > 0):
        raise ConfigError("cluster.weight_sync: 'tensor' hands CUDA tensors to SGLang on the same "
                          "GPUs: it needs cluster.colocate=true, rollout.engine=sglang and GPUs; "
                          "use 'distributed' or 'disk' otherwise")
    if r.engine == "sglang" and cfg.cluster.weight_sync in ("distributed", "tensor") \
            and r.sglang.dp_size > 1:
        raise ConfigError(f"rollout.sglang.dp_size: SGLang updates weights from a process group "
                          f"or from tensors only with dp_size 1 (it asserts so); got "
                          f"{r.sglang.dp_size} with cluster.weight_sync={cfg.cluster.weight_sync}"
                          f"; use more servers (rollout.num_servers) or weight_sync=disk")
    if cfg.cluster.weight_sync == "tensor" and \
            t.tensor_parallel * t.context_parallel * t.expert_parallel == 1 and \
            cfg.cluster.trainer_workers != r.num_servers * r.sglang.tp_size:
        raise ConfigError(f"cluster.trainer_workers: colocated tensor sync builds each SGLang TP "
                          f"rank's payload on the trainer rank sharing its GPU, so it needs "
                          f"trainer_workers == rollout.num_servers * rollout.sglang.tp_size "
                          f"({r.num_servers * r.sglang.tp_size}); got {cfg.cluster.trainer_workers}")
    if t.tensor_parallel > 1 and facts.moe_layers and not t.sequence_parallel:
        raise ConfigError("trainer.sequence_parallel: megatron-core's MoE layers need sequence "
                          "parallelism when trainer.tensor_parallel > 1; set it true")
    if t.context_parallel > 1:
        raise ConfigError("trainer.context_parallel: > 1 is refused until the inputs are split "
                          "per CP rank in megatron's layout (the replay slices are ready, the "
                          "input split is not); use 1")
    if r.engine == "sglang" and r.sglang.deterministic_inference and r.min_p > 0:
        raise ConfigError("rollout.min_p: SGLang's deterministic inference does not support min_p "
                          "sampling; set rollout.min_p=0 or turn deterministic_inference off")
    if r.quantization == "fp8" and r.engine == "sglang":
        from moe_rl.rollout.fp8_shapes import fp8_shape_errors
        errors = fp8_shape_errors(model_hf_fields(m), r.sglang.tp_size, r.sglang.ep_size)
        if errors:
            raise ConfigError(f"rollout.quantization: SGLang refuses block-wise FP8 for this model "
                              f"at rollout.sglang.tp_size={r.sglang.tp_size}, ep_size="
                              f"{r.sglang.ep_size}: {'; '.join(errors)}. Change the TP/EP sizes "
                              f"(a larger ep_size keeps experts whole) or set "
                              f"rollout.quantization=none")
    if cfg.cluster.colocate and cfg.cluster.weight_sync == "distributed" and \
            cfg.cluster.gpus_per_node > 0:
        raise ConfigError("cluster.weight_sync: 'distributed' with cluster.colocate=true puts "
                          "trainer rank 0 and an SGLang rank on the same GPU in one NCCL "
                          "communicator, which NCCL refuses; use weight_sync=tensor (CUDA "
                          "tensors handed over on the shared GPUs) or disk, or colocate=false")
    if r.max_staleness > 0 and cfg.cluster.colocate:
        raise ConfigError("rollout.max_staleness: the asynchronous pipeline generates while the "
                          "trainer trains, which colocated engines cannot (they give their memory "
                          "to the trainer); set cluster.colocate=false or max_staleness=0")
    if r.max_staleness > 0 and a.pi_old != "trainer":
        raise ConfigError(f"algorithm.pi_old: '{a.pi_old}' with rollout.max_staleness > 0 would "
                          f"make the (stale) behaviour policy the proximal policy; the "
                          f"asynchronous pipeline needs pi_old: trainer (the trainer's current "
                          f"pre-update policy), and the corrections act on the lag")
    if a.keep_sampling_mask and r.top_k >= r.sampling_mask_max_tokens:
        raise ConfigError(f"rollout.top_k: {r.top_k} must stay below "
                          f"rollout.sampling_mask_max_tokens ({r.sampling_mask_max_tokens}): "
                          f"tokens tied at the top-k cut overflow the cap and SGLang answers 400")
    model_parallel = t.tensor_parallel * t.pipeline_parallel * t.context_parallel
    if cfg.cluster.trainer_workers % model_parallel or \
            (cfg.cluster.trainer_workers // model_parallel) % t.expert_parallel:
        raise ConfigError(f"cluster.trainer_workers: {cfg.cluster.trainer_workers} ranks do not "
                          f"split into tensor x pipeline x context parallel ({model_parallel}) "
                          f"groups whose data-parallel size is a multiple of "
                          f"trainer.expert_parallel ({t.expert_parallel})")
    data_parallel = cfg.cluster.trainer_workers // model_parallel
    if r.prompts_per_step < data_parallel:
        raise ConfigError(f"rollout.prompts_per_step: {r.prompts_per_step} prompt groups cannot "
                          f"give each of the {data_parallel} data-parallel ranks one; use at "
                          f"least {data_parallel}")
    if cfg.data.source in ("jsonl", "parquet") and not cfg.data.path:
        raise ConfigError(f"data.path: data.source={cfg.data.source} needs a file path")


def iter_keys(cls: type = Config, prefix: str = "") -> typing.Iterator[tuple[str, str, Any, str]]:
    """Yield (dotted key, type name, default, doc) for every leaf key: README's table."""
    default_obj = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_dataclass_type(tp):
            yield from iter_keys(tp, prefix + f.name + ".")
        else:
            yield (prefix + f.name, _type_name(tp), getattr(default_obj, f.name),
                   f.metadata.get("doc", ""))
