"""The cross-field rules: combinations of otherwise valid values that cannot run, each a small
named check per concern; :func:`validate` runs them all and raises :class:`ConfigError` naming
the key."""
from __future__ import annotations

import difflib
import importlib
import importlib.util

from moe_rl.config.model_facts import (facts_context, model_hf_fields, model_moe_shape,
                                       response_cap)
from moe_rl.families import FAMILIES, family
from moe_rl.config.fields import ConfigError
from moe_rl.config.schema import (AlgorithmConfig, ClusterConfig, Config, CORRECTIONS, DataConfig,
                                  EvalConfig, LoggingConfig, ModelConfig, RolloutConfig, set_name,
                                  TrainerConfig)
from moe_rl.families.shape import MoEShape, quantisation_refusal



def check_model_init(model: ModelConfig) -> None:
    """model.init: the shape ``init-model`` would write (the first of the cross-field checks)."""
    init = model.init
    if init.num_experts_per_tok > init.num_experts:
        raise ConfigError(f"model.init.num_experts_per_tok: {init.num_experts_per_tok} exceeds "
                          f"model.init.num_experts = {init.num_experts}")
    family(init.architecture).check_tiny_init(init)

def engine_avg_refusal(algorithm: AlgorithmConfig, rollout: RolloutConfig, vocab_size: int | None
        ) -> None:
    """engine_avg pi_old at temperature T != 1 without the sampling mask needs the engine's raw
    log-probs of the whole vocabulary at every position (SGLang's prefill log-probs ignore T):
    exact, but refused above ``rollout.scoring.full_vocab_max`` ids (``vocab_size`` None: unknown
    yet; the rollout worker checks again with the served model)."""
    a, r = algorithm, rollout
    temperature = r.sampling.temperature
    if a.pi_old != "engine_avg" or a.keep_sampling_mask or temperature in (0.0, 1.0):
        return
    if vocab_size is not None and vocab_size > r.scoring.full_vocab_max:
        raise ConfigError(
            f"algorithm.pi_old: engine_avg at rollout.sampling.temperature={temperature} needs "
            f"the engine's log-probs at that temperature, but SGLang's prefill (scoring) "
            f"log-probs are at T = 1; renormalising them exactly needs all {vocab_size} "
            f"vocabulary ids at every position (rollout.scoring.full_vocab_max="
            f"{r.scoring.full_vocab_max}). Use algorithm.keep_sampling_mask=true (exact from the "
            f"kept ids), rollout.sampling.temperature=1, or algorithm.pi_old=trainer")


def check_model_fit(cfg: Config, moe_shape: MoEShape) -> None:
    """What the model must have or leave room for: MoE layers to replay, context for a prompt."""
    a, r, m = cfg.algorithm, cfg.rollout, cfg.model
    if a.replay != "off" and not moe_shape.moe_layers:
        raise ConfigError(f"algorithm.replay: '{a.replay}' needs a model with MoE layers, but "
                          f"{m.path} has none; set algorithm.replay=off")
    if a.router_shift.enabled and not moe_shape.moe_layers:
        raise ConfigError(f"algorithm.router_shift.enabled: {m.path} has no MoE layer, so no "
                          f"routing to measure")
    context = facts_context(m)
    if context is not None and r.max_new_tokens >= context:
        raise ConfigError(f"rollout.max_new_tokens: {r.max_new_tokens} leaves no room for a "
                          f"prompt in the model's context ({context} positions)")
    if (cfg.data.environment is not None and context is not None
            and response_cap(cfg) >= context):
        raise ConfigError(f"rollout.max_response_tokens: a trajectory's response of up to "
                          f"{response_cap(cfg)} tokens leaves no room for a prompt in the "
                          f"model's context ({context} positions)")


def check_family(cfg: Config) -> None:
    """What cannot be trained from the checkpoint (its weights quantised otherwise than in
    MXFP4) and what the model's family cannot run (its module's ``check_config``, where it has
    one)."""
    hf = model_hf_fields(cfg.model)
    refusal = quantisation_refusal(hf)
    if refusal:
        raise ConfigError(f"model.path: {cfg.model.path}: {refusal}")
    check = getattr(FAMILIES.get(hf.get("model_type")), "check_config", None)
    if check is not None:
        check(cfg, hf)


def check_places(rollout: RolloutConfig, logging: LoggingConfig) -> None:
    """Ports and the run directory."""
    r = rollout
    if r.servers.base_port + r.num_servers - 1 > 65535:
        raise ConfigError(f"rollout.servers.base_port: servers use ports {r.servers.base_port}.."
                          f"{r.servers.base_port + r.num_servers - 1}, beyond 65535")
    if not logging.dir.strip():
        raise ConfigError("logging.dir: expected a directory path, got an empty string")


def check_sampling(algorithm: AlgorithmConfig, rollout: RolloutConfig,
                   moe_shape: MoEShape) -> None:
    """The sampling settings and the distribution pi_old is scored on (one rule for top_k
    against the mask's cap)."""
    a, s = algorithm, rollout.sampling
    if s.top_k == 0:
        raise ConfigError("rollout.sampling.top_k: 0 is not valid; use -1 for no top-k or a "
                          "value >= 1")
    if a.keep_sampling_mask:
        if not 1 < s.top_k:
            raise ConfigError(
                "algorithm.keep_sampling_mask: needs a finite rollout.sampling.top_k with 1 < "
                f"top_k < rollout.sampling.mask_max_tokens ({s.mask_max_tokens}); got "
                f"rollout.sampling.top_k={s.top_k}")
        if s.top_k >= s.mask_max_tokens:
            raise ConfigError(f"rollout.sampling.top_k: {s.top_k} must stay below "
                              f"rollout.sampling.mask_max_tokens ({s.mask_max_tokens}): "
                              f"tokens tied at the top-k cut overflow the cap and SGLang "
                              f"answers 400")
        if s.temperature == 0:
            raise ConfigError("algorithm.keep_sampling_mask: greedy sampling "
                              "(rollout.sampling.temperature=0) keeps one token; turn the mask "
                              "off")
    engine_avg_refusal(algorithm, rollout, moe_shape.vocab_size)
    if a.pi_old_passes < 1:
        raise ConfigError(f"algorithm.pi_old_passes: expected n >= 1 scoring passes, got "
                          f"{a.pi_old_passes}")


def check_loss(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> None:
    """The loss, its clip ranges, aggregation, KL and entropy control, the advantage's groups."""
    a, r = algorithm, rollout
    refusals = []
    if a.entropy_control.method == "kl_cov" and a.loss != "ppo":
        refusals.append("algorithm.entropy_control.method: kl_cov replaces the token PPO "
                        "surrogate (unclipped -A r + penalty); it needs algorithm.loss=ppo")
    if a.loss == "gspo" and (a.clip_low <= 0 or a.clip_high <= 0):
        refusals.append(f"algorithm.clip_low/clip_high: GSPO needs positive clip ranges, got "
                        f"{a.clip_low} / {a.clip_high}")
    if a.clip_low < 0 or a.clip_high < 0:
        refusals.append("algorithm.clip_low/clip_high: clip ranges must be >= 0")
    if a.loss in ("gspo", "gmpo") and a.aggregation != "seq-mean-token-mean":
        refusals.append(f"algorithm.aggregation: {a.loss.upper()}'s token form has the sequence "
                        f"objective's gradient only under seq-mean-token-mean; got "
                        f"{a.aggregation!r}")
    if a.router_shift.enabled and a.loss not in ("ppo", "gspo", "gmpo"):
        refusals.append(f"algorithm.router_shift.enabled: the router-shift weight scales the "
                        f"importance ratio of ppo, gspo or gmpo; algorithm.loss is {a.loss!r}")
    if a.router_shift.enabled and a.entropy_control.method == "kl_cov":
        refusals.append("algorithm.router_shift.enabled: kl_cov replaces the ratio surrogate "
                        "the router-shift weight scales; turn one off")
    if a.clip_low >= 1 and a.loss != "gmpo":
        refusals.append(f"algorithm.clip_low: must be < 1 (ratio floor 1 - clip_low), got "
                        f"{a.clip_low}")
    if a.kl.in_reward and a.kl.coef == 0:
        refusals.append("algorithm.kl.in_reward: needs algorithm.kl.coef > 0")
    if a.entropy_control.method == "clip_cov" and (a.entropy_control.clip_cov_low
                                                    >= a.entropy_control.clip_cov_high):
        refusals.append("algorithm.entropy_control.clip_cov_low: must be below clip_cov_high")
    if r.n_samples_per_prompt < 2 and a.advantage in ("grpo", "rloo", "qae"):
        refusals.append(f"rollout.n_samples_per_prompt: '{a.advantage}' advantages need groups "
                        f"of at least 2, got {r.n_samples_per_prompt}")
    if refusals:
        raise ConfigError.of(refusals)


def check_corrections(algorithm: AlgorithmConfig) -> None:
    """algorithm.corrections: known, once each, with their thresholds ordered."""
    a = algorithm
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
    if "trm" in a.corrections and a.correction.trm_delta is None:
        raise ConfigError("algorithm.correction.trm_delta: Trust Region Masking ('trm' in "
                          "algorithm.corrections) needs a threshold delta")
    c = a.correction
    for lo, hi in (("rs_low", "rs_high"), ("geo_low", "geo_high"), ("icepop_low", "icepop_high")):
        if getattr(c, lo) >= getattr(c, hi):
            raise ConfigError(f"algorithm.correction.{lo}: must be below algorithm.correction.{hi}"
                              f" ({getattr(c, lo)} >= {getattr(c, hi)})")


def check_loss_scale(trainer: TrainerConfig) -> None:
    """float16's loss scale: its floor at most its start (megatron asserts it, deep in the
    trainer, otherwise)."""
    s = trainer.loss_scale
    if s.min > s.initial:
        raise ConfigError(f"trainer.loss_scale.min: {s.min:g} is above trainer.loss_scale."
                          f"initial ({s.initial:g}); the scale starts at initial and never "
                          f"falls below min")


def check_ema(cfg: Config) -> None:
    """EMA policy smoothing averages with ``trainer.ema.decay``."""
    t = cfg.trainer
    if (t.ema.policy or t.ema.start_step) and t.ema.decay is None:
        key = "trainer.ema.policy" if t.ema.policy else "trainer.ema.start_step"
        raise ConfigError(f"{key}: needs trainer.ema.decay (the EMA's decay, e.g. 0.9)")
    if (t.ema.policy and cfg.model.dtype != "float32" and t.optim.distributed
            and cfg.cluster.gpus_per_node > 0):
        raise ConfigError(f"trainer.ema.policy: with model.dtype={cfg.model.dtype} the EMA is "
                          "written into "
                          "the optimizer's float32 main weights, of which megatron's distributed "
                          "optimizer keeps only a shard per rank; set "
                          "trainer.optim.distributed=false")


def precision_pair_warning(model: ModelConfig, rollout: RolloutConfig) -> str | None:
    """A float16 side against a bfloat16 side: allowed, said (each rounds to its own grid:
    10 mantissa bits against 7, so the two policies differ by bf16's rounding at least). A
    16-bit trainer against the engine's float32 default (``model.dtype`` set alone): said, on
    every engine and device."""
    trained, served = model.dtype, rollout.engine_dtype
    if served == "float32" and trained != "float32":
        return (f"warning: rollout.engine_dtype=float32: the engine serves in float32 while the "
                f"trainer trains in {trained}, so their log-probs differ by {trained}'s rounding; "
                f"set rollout.engine_dtype={trained} to serve in the trainer's precision")
    if {trained, served} != {"float16", "bfloat16"}:
        return None
    return (f"warning: model.dtype={trained} trains against rollout.engine_dtype="
            f"{served}: float16 and bfloat16 round to different grids, so "
            f"the engine's and the trainer's log-probs differ by bfloat16's rounding at least "
            f"(set both to float16, or both to bfloat16, to match them)")


# the clip ranges each ratio is clipped at in its paper: GSPO's sequence ratio (3e-4 / 4e-4)
# sits ~1000 times closer to 1 than PPO's token ratio (DAPO's 0.2 / 0.28)
GSPO_CLIP, PPO_CLIP = (3e-4, 4e-4), (0.2, 0.28)
CLIP_SCALE_APART = 0.01   # ranges at or above it are token-sized, below it sequence-sized


def clip_range_warning(algorithm: AlgorithmConfig) -> str | None:
    """A loss with the other loss's clip ranges (``algorithm.loss`` switched, its ranges kept):
    GSPO with token-sized ranges clips almost no sequence, PPO with sequence-sized ranges almost
    every token. Allowed (a range is the user's to choose), said."""
    a = algorithm
    widest = max(a.clip_low, a.clip_high)
    if a.loss == "gspo" and widest >= CLIP_SCALE_APART:
        sized, effect, (low, high), source = (
            "a token's ratio", "GSPO's sequence ratio (a geometric mean over the response) "
            "almost never leaves them, so almost nothing is clipped", GSPO_CLIP, "the GSPO paper")
    elif a.loss == "ppo" and 0 < widest < CLIP_SCALE_APART:
        sized, effect, (low, high), source = (
            "GSPO's sequence ratio", "a token's ratio almost always leaves them, so almost every "
            "token is clipped", PPO_CLIP, "PPO with DAPO's clip-higher")
    else:
        return None
    return (f"warning: algorithm.loss={a.loss} with algorithm.clip_low/clip_high = "
            f"{a.clip_low:g}/{a.clip_high:g}, ranges sized for {sized}: {effect} ({source}: "
            f"{low:g}/{high:g}; set algorithm.clip_low={low:g} algorithm.clip_high={high:g} "
            f"unless meant)")


def config_warnings(cfg: Config) -> list[str]:
    """Every ``warning: ...`` line of a config that loads (``moe-rl train`` and ``moe-rl
    config`` print them)."""
    return [w for w in (precision_pair_warning(cfg.model, cfg.rollout),
                        clip_range_warning(cfg.algorithm)) if w]


# torch._grouped_mm's row strides: multiples of 16 bytes (checked on CPU too)
GROUPED_ALIGN_BYTES = 16
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def grouped_misaligned(hidden: int, expert_width: int, dtype: str) -> str | None:
    """Why experts of ``hidden`` x ``expert_width`` (a rank's share of the width) cannot run in
    grouped GEMMs in ``dtype`` (None: their rows fit)."""
    per = GROUPED_ALIGN_BYTES // DTYPE_BYTES[dtype]
    for name, size in (("hidden size", hidden), ("expert width", expert_width)):
        if size % per:
            return (f"the {name} {size} is not a multiple of {per} ({GROUPED_ALIGN_BYTES}-byte "
                    f"rows in {dtype}), which torch._grouped_mm needs")
    return None


def expert_sizes(hf: dict, tensor_parallel: int) -> tuple[int, int]:
    """(hidden size, one rank's expert width) of the model of config.json ``hf``; megatron
    splits the experts' width over the tensor-parallel ranks."""
    width = int(hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 0)
    return int(hf["hidden_size"]), width // tensor_parallel


def check_experts(trainer: TrainerConfig, model: ModelConfig) -> None:
    """``trainer.experts: grouped`` on sizes the grouped GEMM cannot take (``auto`` falls back
    to the loop there)."""
    if trainer.experts != "grouped":
        return
    why = grouped_misaligned(*expert_sizes(model_hf_fields(model),
                                           trainer.parallel.tensor), model.dtype)
    if why:
        raise ConfigError(f"trainer.experts: grouped cannot run this model: {why}; use auto "
                          f"(the loop where the grouped GEMM cannot run) or sequential")


def check_micro_batches(trainer: TrainerConfig) -> None:
    """A micro-batch is bounded by rows, by tokens, or both."""
    t = trainer
    if t.micro_batch_size is None and t.max_tokens_per_micro_batch is None:
        raise ConfigError("trainer.micro_batch_size: null needs trainer."
                          "max_tokens_per_micro_batch (a micro-batch needs a row cap or a token "
                          "budget)")
    if t.pack_sequences and t.max_tokens_per_micro_batch is None:
        raise ConfigError("trainer.pack_sequences: needs trainer.max_tokens_per_micro_batch "
                          "(the length of a packed row)")


def check_optimiser_and_layout(trainer: TrainerConfig, moe_shape: MoEShape) -> None:
    """The learning-rate floor and the parallel layouts the trainer runs."""
    t = trainer
    if t.optim.min_lr > t.optim.lr:
        raise ConfigError(f"trainer.optim.min_lr: {t.optim.min_lr} exceeds trainer.optim.lr = "
                          f"{t.optim.lr}")
    if t.parallel.sequence and t.parallel.tensor == 1:
        raise ConfigError("trainer.parallel.sequence: needs trainer.parallel.tensor > 1")
    if moe_shape.moe_layers and moe_shape.num_experts % t.parallel.expert:
        raise ConfigError(f"trainer.parallel.expert: {t.parallel.expert} does not divide the "
                          f"{moe_shape.num_experts} experts")
    if t.parallel.pipeline > 1:
        raise ConfigError("trainer.parallel.pipeline: the training step runs the model without "
                          "megatron's pipeline schedules; use 1 (data, expert, tensor and context "
                          "parallelism are supported)")


# refused where the model is built (the trainer's nodes, which may have Transformer Engine where
# the driver does not), before the first forward would assert
CP_NEEDS_TE = ("trainer.parallel.context: > 1 needs Transformer Engine's attention on GPUs "
               "(megatron-core's local DotProductAttention asserts context parallel 1, "
               "transformer/dot_product_attention.py:58); install transformer-engine[pytorch] "
               "or set trainer.parallel.context=1")


def check_cpu(cluster: ClusterConfig, trainer: TrainerConfig) -> None:
    """What a CPU run (cluster.gpus_per_node 0) cannot do."""
    t = trainer
    if cluster.gpus_per_node == 0:
        for key in ("tensor", "context"):
            if getattr(t.parallel, key) > 1:
                raise ConfigError(f"trainer.parallel.{key}: > 1 is not supported on CPU "
                                  "(megatron-core's local spec refuses sequence parallelism "
                                  "there); run it on GPUs")


def check_weight_sync(cluster: ClusterConfig) -> None:
    """cluster.weight_sync against colocation and GPUs (the engine checks its own ranks)."""
    if cluster.weight_sync == "tensor" and not (cluster.colocate
                                                    and cluster.gpus_per_node > 0):
        raise ConfigError("cluster.weight_sync: 'tensor' hands CUDA tensors to SGLang on the same "
                          "GPUs: it needs cluster.colocate=true, rollout.engine=sglang and GPUs; "
                          "use 'distributed' or 'disk' otherwise")
    if (cluster.colocate and cluster.weight_sync == "distributed" and
            cluster.gpus_per_node > 0):
        raise ConfigError("cluster.weight_sync: 'distributed' with cluster.colocate=true puts "
                          "trainer rank 0 and an SGLang rank on the same GPU in one NCCL "
                          "communicator, which NCCL refuses; use weight_sync=tensor (CUDA "
                          "tensors handed over on the shared GPUs) or disk, or colocate=false")


def check_model_parallel(trainer: TrainerConfig, moe_shape: MoEShape) -> None:
    """Tensor parallelism of a MoE model."""
    t = trainer
    if t.parallel.tensor > 1 and moe_shape.moe_layers and not t.parallel.sequence:
        raise ConfigError("trainer.parallel.sequence: megatron-core's MoE layers need sequence "
                          "parallelism when trainer.parallel.tensor > 1; set it true")


def check_async(cfg: Config) -> None:
    """The asynchronous pipeline (rollout.max_staleness > 0)."""
    a, r = cfg.algorithm, cfg.rollout
    if r.max_staleness > 0 and cfg.cluster.colocate:
        raise ConfigError("rollout.max_staleness: the asynchronous pipeline generates while the "
                          "trainer trains, which colocated engines cannot (they give their memory "
                          "to the trainer); set cluster.colocate=false or max_staleness=0")
    if r.max_staleness > 0 and a.pi_old != "trainer":
        raise ConfigError(f"algorithm.pi_old: '{a.pi_old}' with rollout.max_staleness > 0 would "
                          f"make the (stale) behaviour policy the proximal policy; the "
                          f"asynchronous pipeline needs pi_old: trainer (the trainer's current "
                          f"pre-update policy), and the corrections act on the lag")


def check_partial(rollout: RolloutConfig) -> None:
    """Partial rollouts (rollout.partial)."""
    r = rollout
    if not r.partial.enabled:
        return
    if r.max_staleness < 1:
        raise ConfigError("rollout.partial.enabled: a response continued under the next weights is "
                          "trained one version after its first tokens; set "
                          "rollout.max_staleness >= 1 (it bounds every token's lag)")
    if r.dynamic_sampling:
        raise ConfigError("rollout.partial.enabled: dynamic sampling is not combined with "
                          "partial rollouts; set rollout.dynamic_sampling=false or "
                          "rollout.partial.enabled=false")
    most = 8 * r.prompts_per_step * (r.max_staleness + 1)
    if (r.partial.extra_groups or 0) > most:
        raise ConfigError(f"rollout.partial.extra_groups: {r.partial.extra_groups} is more than "
                          f"8 x rollout.prompts_per_step x (rollout.max_staleness + 1) = {most}: "
                          f"a step takes prompts_per_step groups and a token older than "
                          f"max_staleness versions is dropped or masked, so most groups past "
                          f"that would only hold memory")


def check_ranks(cfg: Config) -> None:
    """The trainer ranks split into model-parallel groups, each data-parallel rank with prompts."""
    r, t = cfg.rollout, cfg.trainer
    model_parallel = t.parallel.tensor * t.parallel.pipeline * t.parallel.context
    if (cfg.cluster.trainer_workers % model_parallel or
            (cfg.cluster.trainer_workers // model_parallel) % t.parallel.expert):
        raise ConfigError(f"cluster.trainer_workers: {cfg.cluster.trainer_workers} ranks do not "
                          f"split into tensor x pipeline x context parallel ({model_parallel}) "
                          f"groups whose data-parallel size is a multiple of "
                          f"trainer.parallel.expert ({t.parallel.expert})")
    data_parallel = cfg.cluster.trainer_workers // model_parallel
    if r.prompts_per_step < data_parallel:
        raise ConfigError(f"rollout.prompts_per_step: {r.prompts_per_step} prompt groups cannot "
                          f"give each of the {data_parallel} data-parallel ranks one; use at "
                          f"least {data_parallel}")


def check_data(data: DataConfig) -> None:
    """The prompt source and the row format."""
    d = data
    if d.sets and (d.path or d.source != "toy"):
        raise ConfigError("data.sets: replaces data.source and data.path; leave those unset "
                          "(each set names its own path and source)")
    _check_sets(d.sets, "data.sets")
    if d.source in ("jsonl", "parquet") and not d.path:
        raise ConfigError(f"data.path: data.source={d.source} needs a file path")
    if d.source == "toy" and not d.sets and (d.messages_key or d.metadata_keys):
        key = "data.messages_key" if d.messages_key else "data.metadata_keys"
        raise ConfigError(f"{key}: the toy task has no rows; set data.source to jsonl or parquet")
    if d.messages_key and not d.chat_template:
        raise ConfigError("data.chat_template: messages rows (data.messages_key) are rendered "
                          "with the tokenizer's chat template; set data.chat_template=true")
    if d.messages_key and d.system_prompt is not None:
        raise ConfigError("data.system_prompt: messages rows carry their own system message; "
                          "put it in the rows, or use prompt_key rows")
    if not d.chat_template and (d.system_prompt is not None or d.chat_template_kwargs):
        key = ("data.system_prompt" if d.system_prompt is not None else
            "data.chat_template_kwargs")
        raise ConfigError(f"{key}: applies through the chat template; set "
                          f"data.chat_template=true")


def _check_sets(sets: list, key: str) -> None:
    """Every entry names a file, and names are unique (they key the metrics)."""
    names = []
    for i, entry in enumerate(sets):
        if not entry.path:
            raise ConfigError(f"{key}[{i}].path: every set needs a file (JSONL or Parquet)")
        names.append(set_name(entry))
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"{key}: two sets are named {name!r}; give each a distinct "
                              f"name")


def check_rewards(data: DataConfig) -> None:
    """The reward service's address; the rewards a multi-turn run takes from its environment."""
    svc = data.reward_service
    if svc.url is not None and not svc.url.startswith(("http://", "https://")):
        raise ConfigError(f"data.reward_service.url: expected an http:// or https:// address, "
                          f"got {svc.url!r}")
    if svc.url is not None and data.environment is not None:
        raise ConfigError("data.reward_service.url: with data.environment the environment "
                          "gives the rewards; unset one of them")


def check_eval(evaluation: EvalConfig, data: DataConfig) -> None:
    """Held-out sets, the pass@k list, and what evaluation supports."""
    e = evaluation
    _check_sets(e.sets, "eval.sets")
    for k in e.pass_k:
        if not 1 <= k <= e.n:
            raise ConfigError(f"eval.pass_k: {k} is not in [1, eval.n={e.n}] (pass@k needs k "
                              f"of the n samples of a prompt)")
    if e.sets and data.environment is not None:
        raise ConfigError("eval.sets: evaluation scores single-turn completions with the "
                          "reward; multi-turn runs (data.environment) are not evaluated")


def check_logging(logging: LoggingConfig) -> None:
    """logging.wandb: the optional package is there when asked for."""
    if (logging.wandb.enabled and logging.wandb.mode != "disabled" and
            importlib.util.find_spec("wandb") is None):
        raise ConfigError("logging.wandb.enabled: W&B logging needs the wandb package: "
                          "pip install 'moe_rl[wandb]' (or set logging.wandb.enabled=false)")


def validate(cfg: Config) -> None:
    """Raise :class:`ConfigError` for incompatible combinations of otherwise valid values: the
    model's shape first (the others read it), then every check below and the checks of the
    engine named by ``rollout.engine`` (:func:`check_engine`), each one's refusals collected, so
    one error names them all."""
    check_model_init(cfg.model)
    moe_shape = model_moe_shape(cfg.model)
    refusals: list[str] = []
    a, c, d, m, r, t = (cfg.algorithm, cfg.cluster, cfg.data, cfg.model, cfg.rollout,
                        cfg.trainer)
    for check, args in ((check_model_fit, (cfg, moe_shape)), (check_family, (cfg,)),
                        (check_places, (r, cfg.logging)), (check_sampling, (a, r, moe_shape)),
                        (check_loss, (a, r)), (check_corrections, (a,)),
                        (check_optimiser_and_layout, (t, moe_shape)),
                        (check_micro_batches, (t,)), (check_experts, (t, m)),
                        (check_loss_scale, (t,)), (check_ema, (cfg,)), (check_cpu, (c, t)),
                        (check_weight_sync, (c,)), (check_model_parallel, (t, moe_shape)),
                        (check_async, (cfg,)), (check_partial, (r,)), (check_ranks, (cfg,)),
                        (check_data, (d,)), (check_rewards, (d,)), (check_eval, (cfg.eval, d)),
                        (check_logging, (cfg.logging,)), (check_engine, (cfg,))):
        try:
            check(*args)
        except ConfigError as exc:
            refusals.extend(exc.refusals)
    if refusals:
        raise ConfigError.of(refusals)


ENGINE_CHECKS = "moe_rl.engines.{}.checks"


def check_engine(cfg: Config) -> None:
    """The refusals of the engine ``rollout.engine`` names, which live beside that engine
    (``moe_rl.engines.<name>.checks.check_config``, which the engine kind applies too); the
    module is found by name, as a reward function is, so the configuration does not depend on
    the engines (nor imports what they need)."""
    importlib.import_module(ENGINE_CHECKS.format(cfg.rollout.engine)).check_config(cfg)
