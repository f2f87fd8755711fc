"""The configuration's schema: one dataclass per section, every key with its type, default,
one-line meaning and range. Every default lives here, except those of ``model.init`` (the
settings of ``moe-rl init-model``), which live beside them in :mod:`moe_rl.config.init_model`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
import os

from moe_rl.config.fields import _f, _rng, _sub
from moe_rl.config.init_model import ModelInitConfig


@dataclass
class ModelConfig:
    path: str = _f("outputs/tiny_model", "Hugging Face model directory (config.json + safetensors)")
    dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "trainer parameter dtype (bfloat16 / float16: megatron's mixed-precision "
        "optimizer keeps float32 master weights; float16 with its dynamic loss scaler, "
        "trainer.loss_scale)")
    fp32_output_layer: bool = _f(False, "compute the output layer (LM head) in float32 on both "
                                 "sides: the trainer's, and the engines' (SGLang "
                                 "--enable-fp32-lm-head, the reference engine's likewise)")
    init: ModelInitConfig = _sub(ModelInitConfig, "tiny model shape for `moe-rl init-model`")


@dataclass
class SGLangConfig:
    tp_size: int = _f(1, "SGLang --tp-size", **_rng(1, 1024, why="GPUs one SGLang server spans"))
    dp_size: int = _f(1, "SGLang --dp-size", **_rng(1, 1024, why="GPUs one SGLang server spans"))
    ep_size: int = _f(1, "SGLang --ep-size", **_rng(1, 1024, why="GPUs one SGLang server spans"))
    mem_fraction_static: float = _f(0.7, "SGLang --mem-fraction-static", **_rng(0, 1, lo_open=True))
    deterministic_inference: bool = _f(False, "--enable-deterministic-inference for SGLang and "
                                       "the reference engine: batch-invariant results, "
                                       "reproducible runs (makes n-pass averaging useless)")
    extra_args: list[str] = _f([], "extra command-line arguments passed to sglang.launch_server")
    python: str | None = _f(None, "the Python interpreter that runs `-m sglang.launch_server` "
                            "(SGLang in its own environment; null = the trainer's)")
    device: Literal["cuda", "cpu"] = _f("cuda", "where SGLang serves: cuda (GPUs) or cpu (no "
                                        "GPU: --device cpu, SGLANG_USE_CPU_ENGINE=1, "
                                        "rollout.engine_dtype, in an environment from "
                                        "`moe-rl sglang-cpu-env`)")
    max_total_tokens: int | None = _f(None, "SGLang --max-total-tokens, the KV pool's size in "
                                      "tokens (null: SGLang sizes it from memory on GPUs; "
                                      "65536 on CPU, where it would take ~70% of the RAM)",
                                      **_rng(1))


@dataclass
class ServersConfig:
    host: str = _f("127.0.0.1", "address the engine servers bind")
    base_port: int = _f(30000, "first server port tried: servers take the free ports from here "
                        "up, busy ones skipped", **_rng(1, 65535))
    api_key: str | None = _f(None, "API key the servers require (Authorization: Bearer)")
    request_timeout_s: float = _f(300.0, "seconds a server may stay silent on a request before "
                                  "its /health is checked: a healthy server is waited for (a "
                                  "long generation is not death), an unanswering one restarted",
                                  **_rng(0, lo_open=True))
    max_retries: int = _f(3, "retries per request on connection errors / 5xx",
        **_rng(0, 100, why="retries with exponential backoff: more never end"))
    concurrency: int = _f(64, "in-flight requests per server",
        **_rng(1, 65536, why="requests in flight per server, each a task and a connection"))
    health_timeout_s: float = _f(300.0, "the longest a silent server's /health may take before "
                                 "it is restarted, and the wait for a starting server's /health "
                                 "unless startup_timeout_s is set", **_rng(0, lo_open=True))
    startup_timeout_s: float | None = _f(None, "wait for a starting or restarted server's "
                                         "/health (null: health_timeout_s); a large model's "
                                         "start can take minutes where a running server's "
                                         "health check should not", **_rng(0, lo_open=True))
    weight_load_timeout_s: float = _f(3600.0, "the longest one weight-update call to a server "
                                      "may take (a disk load, a bucket); its /health is not "
                                      "asked meanwhile (SGLang's waits for the load to finish)",
                                      **_rng(0, lo_open=True))
    max_answer_mb: float = _f(1024.0, "the largest answer a server may send, in MB; a larger "
                              "one fails its request (a broken or hostile server cannot fill "
                              "the rollout's memory)", **_rng(0, 1 << 20, lo_open=True))


@dataclass
class RolloutSamplingConfig:
    temperature: float = _f(1.0, "sampling temperature (0 = greedy)", **_rng(0))
    top_p: float = _f(1.0, "nucleus sampling mass", **_rng(0, 1, lo_open=True))
    top_k: int = _f(-1, "top-k sampling (-1 = off)", **_rng(-1))
    min_p: float = _f(0.0, "min-p relative to the most likely token", **_rng(0, 1))
    mask_max_tokens: int = _f(4096, "engine cap on the kept-set size (SGLang "
                              "--sampling-mask-max-tokens)",
        **_rng(2, 1048576, why="kept-set ids per position an engine returns"))


@dataclass
class PartialConfig:
    enabled: bool = _f(False, "a step stops generating once it has rollout.prompts_per_step "
                       "complete groups; the responses in flight are aborted, kept with each "
                       "token's weight version, and continued under the next weights (needs "
                       "rollout.max_staleness >= 1, which then bounds every token's lag)")
    extra_groups: int | None = _f(None, "groups started beyond the first step's, so the engines "
                                  "hold more work than one step needs (null = "
                                  "rollout.prompts_per_step)",
        **_rng(0, 1048576, why="groups held in flight between steps"))
    stale: Literal["drop", "mask"] = _f(
        "drop", "a response holding a token more than rollout.max_staleness versions old "
        "restarts from its prompt (drop) or keeps that token out of the loss (mask)")
    mask_offpolicy: bool = _f(False, "only the tokens of each response's newest weight version "
                              "count in the loss (slime's --mask-offpolicy-in-partial-rollout)")


@dataclass
class WeightCheckConfig:
    enabled: bool = _f(True, "after every weight sync, score a fixed probe on every engine "
                       "server and compare with the trainer at the same version; past the "
                       "limit the sync is redone from disk once, then the run stops")
    prompts: int = _f(2, "probe size: responses to the first N training prompts",
        **_rng(1, 4096, why="probe responses generated after every sync"))
    factor: float = _f(10.0, "the check fires when the probe's k3 exceeds this times its value "
                       "at the run's start (what the engine's precision explains) ...",
                       **_rng(1))
    floor: float = _f(1e-4, "... and this k3 (so identical float32 engine and trainer never "
                      "fire)", **_rng(0, lo_open=True))


@dataclass
class ScoringConfig:
    window_tokens: int = _f(32, "response tokens per engine scoring request when pi_old passes "
                            "are renormalised from listed ids (kept sets, or the vocabulary at "
                            "temperature != 1)", **_rng(1))
    full_vocab_max: int = _f(4096, "largest vocabulary for which engine_avg scoring at "
                             "temperature != 1 without the sampling mask lists every id",
                             **_rng(1))


@dataclass
class RolloutConfig:
    engine: Literal["reference", "sglang"] = _f("reference",
                                                "inference engine: CPU reference or SGLang")
    num_servers: int = _f(1, "engine servers behind the dispatcher",
        **_rng(1, 4096, why="servers behind one dispatcher, each a process started and watched"))
    engine_dtype: Literal["float32", "bfloat16", "float16"] = _f(
        "float32", "engine dtype: the reference engine's, and SGLang's --dtype")
    quantization: Literal["none", "fp8", "mxfp4"] = _f(
        "none", "rollout numerics: fp8 = the engines serve a block-wise FP8 checkpoint of the "
        "weights (128x128 E4M3 blocks), every sync quantised; mxfp4 = 4-bit weights (E2M1, a "
        "power-of-two scale per 32), emulated by the reference engine at every load")
    prompts_per_step: int = _f(8, "prompts sampled per RL step",
        **_rng(1, 1048576, why="prompts one step generates and holds in memory at once"))
    n_samples_per_prompt: int = _f(8, "responses per prompt (the GRPO group size)",
        **_rng(1, 4096, why="responses of one group, held and scored together"))
    max_staleness: int = _f(0, "asynchronous pipeline: the rollout generates the next batches "
                            "while the trainer trains, from weights at most this many versions "
                            "old (0 = the synchronous loop)",
        **_rng(0, 1024, why="weight versions the rollout may run ahead, each batch held"))
    retracted: Literal["keep", "mask"] = _f(
        "keep", "a response the engine retracted under KV-pool pressure (moved back to its queue "
        "and re-prefilled later: its routing recomputed, its log-probs those it sampled with) is "
        "trained as sampled (keep; counted in rollout/retracted) or, under algorithm.replay=r3, "
        "its tokens leave the loss (mask: the replayed routes may not be those it sampled with "
        "in bf16/fp16)")
    dynamic_sampling: bool = _f(False, "drop prompt groups whose rewards are all equal and "
                                "generate more until the step has prompts_per_step informative "
                                "groups (DAPO)")
    max_oversample: int | None = _f(None, "dynamic sampling: most extra prompt groups generated "
                                    "per step (null = prompts_per_step)",
        **_rng(0, 1048576, why="extra groups generated in one step"))
    max_new_tokens: int = _f(16, "response length cap (with data.environment: per model turn)",
                             **_rng(1))
    max_turns: int = _f(4, "data.environment: most model turns per trajectory",
        **_rng(1, 4096, why="model turns of one trajectory, each an engine request"))
    max_response_tokens: int | None = _f(None, "data.environment: cap on a trajectory's response "
                                         "(model + observation tokens; null = max_new_tokens x "
                                         "max_turns)", **_rng(1))
    return_routing: bool = _f(True, "ask for every token's routing (replay r3 always does; "
                              "otherwise it only feeds routing/agreement)")
    servers: ServersConfig = _sub(ServersConfig, "the engine servers: address, ports, key, "
                                  "timeouts, concurrency, retries")
    sampling: RolloutSamplingConfig = _sub(RolloutSamplingConfig, "how the engines sample")
    partial: PartialConfig = _sub(PartialConfig, "partial rollouts: the responses in flight at "
                                  "a step's end carried into the next")
    weight_check: WeightCheckConfig = _sub(WeightCheckConfig, "the probe after every weight "
                                           "sync: the engines serve the trainer's weights")
    scoring: ScoringConfig = _sub(ScoringConfig, "the engines' scoring passes of pi_old "
                                  "(algorithm.pi_old=engine_avg)")
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
    opsm_reference: Literal["engine", "pi_old"] = _f("engine",
                                                     "behaviour policy of the DeepSeek mask")
    trm_delta: float | None = _f(None, "Trust Region Masking: mask a sequence whose largest "
                                 "token divergence exceeds this", **_rng(0, lo_open=True))
    trm_measure: Literal["log_ratio", "k2", "k3"] = _f(
        "log_ratio", "Trust Region Masking's token divergence: abs(log rho), (log rho)^2/2 or "
        "rho - 1 - log rho, rho = pi_old / pi_rollout")
    metropolis_weight: Literal["seq", "geo", "token"] = _f("seq",
                                                           "weight the Metropolis sampler uses")
    metropolis_count_repeats: bool = _f(True, "Metropolis as a chain: a sample weighs the steps "
                                        "it was the state (false: accept-or-mask, biased)")


CORRECTIONS = ("token_tis", "seq_tis", "seq_mis", "seq_rs", "geo_rs", "icepop", "opsm", "trm",
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
class DPPOConfig:
    """DPPO's trust region (algorithm.loss: dppo_tv | dppo_kl); defaults from the authors'
    recipe (verl's DPPO example: TV 0.15, KL 0.05, no ratio truncation)."""
    delta_low: float | None = _f(None, "divergence bound for tokens with A <= 0 (null: 0.15 "
                                 "for dppo_tv, 0.05 for dppo_kl)", **_rng(0, lo_open=True))
    delta_high: float | None = _f(None, "divergence bound for tokens with A > 0 (null: 0.15 "
                                  "for dppo_tv, 0.05 for dppo_kl)", **_rng(0, lo_open=True))
    ratio_cap: float | None = _f(None, "cap of the (detached) ratio weighting a token's "
                                 "gradient inside the region (null: none, the authors' "
                                 "example; their paper wants any cap large, e.g. 20)",
                                 **_rng(1, lo_open=True))


@dataclass
class QAEConfig:
    """QAE's baseline (algorithm.advantage: qae): the group's k-quantile in place of its mean."""
    k: float = _f(0.4, "the quantile; with 0/1 rewards a group whose success rate is at most "
                  "1 - k trains only its successes, any other only its failures (the authors' "
                  "scripts: 0.4)", **_rng(0, 1, lo_open=True, hi_open=True))


@dataclass
class CISPOConfig:
    """CISPO's clipped importance weight (algorithm.loss: cispo); MiniMax-M1 imposes no lower
    bound and tunes only the upper one."""
    eps_low: float | None = _f(None, "the weight's floor is 1 - eps_low (null: no floor, as "
                               "the paper)", **_rng(0, 1, hi_open=True))
    eps_high: float = _f(0.28, "the weight's cap is 1 + eps_high", **_rng(0, lo_open=True))


@dataclass
class SAPOConfig:
    """SAPO's soft gate (algorithm.loss: sapo); the paper's temperatures."""
    tau_pos: float = _f(1.0, "gate temperature for tokens with A > 0", **_rng(0, lo_open=True))
    tau_neg: float = _f(1.05, "gate temperature for tokens with A <= 0 (the paper: above "
                        "tau_pos, negative updates fade faster)", **_rng(0, lo_open=True))


@dataclass
class RolloutPenaltyConfig:
    """A penalty on the trainer's gap to the engine's policy, with any loss (Prime-RL)."""
    coef: float = _f(0.0, "tau of tau * (log pi_theta - log pi_rollout)^2 per token, added to "
                     "the loss (0 = off; Prime-RL's default 1e-3)", **_rng(0))


@dataclass
class RouterShiftConfig:
    """RSPO's router-shift weight on the importance ratio (ppo, gspo, gmpo)."""
    enabled: bool = _f(False, "scale each token's ratio by gamma = max(exp(-d), floor), d the "
                       "mean |change| of the router's log-scores of the experts pi_old "
                       "activated (RSPO = loss gmpo + this)")
    floor: float = _f(0.8, "lower bound of gamma", **_rng(0, 1))


@dataclass
class AlgorithmConfig:
    advantage: Literal["grpo", "drgrpo", "rloo", "qae"] = _f(
        "grpo", "advantage estimator: GRPO, Dr.GRPO, RLOO or QAE (GRPO with the group's "
        "k-quantile as baseline; algorithm.qae)")
    loss: Literal["ppo", "gspo", "gmpo", "dppo_tv", "dppo_kl", "cispo", "sapo"] = _f(
        "ppo", "policy loss: token PPO-clip (GRPO), GSPO, GMPO (geometric mean of log-clipped "
        "token ratios; clip_low/clip_high bound log r, paper 0.4), DPPO's divergence trust "
        "region (binary total variation or binary KL; algorithm.dppo), CISPO (the detached "
        "weight clipped, never the update; algorithm.cispo) or SAPO (a soft gate on the ratio; "
        "algorithm.sapo)")
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
    dppo: DPPOConfig = _sub(DPPOConfig, "DPPO's divergence bounds")
    qae: QAEConfig = _sub(QAEConfig, "QAE's quantile")
    cispo: CISPOConfig = _sub(CISPOConfig, "CISPO's weight bounds")
    sapo: SAPOConfig = _sub(SAPOConfig, "SAPO's gate temperatures")
    rollout_penalty: RolloutPenaltyConfig = _sub(RolloutPenaltyConfig,
                                                 "penalty on the gap to the engine's policy")
    router_shift: RouterShiftConfig = _sub(RouterShiftConfig, "RSPO's router-shift weight")
    kl: KLConfig = _sub(KLConfig, "KL to the reference policy")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient", **_rng(0))
    entropy_control: EntropyControlConfig = _sub(EntropyControlConfig, "Clip-Cov / KL-Cov")
    collapse_guard_k3: float | None = _f(None, "skip the update when mismatch/k3 exceeds this "
                                         "(null = off)", **_rng(0, lo_open=True))


@dataclass
class LossScaleConfig:
    initial: float = _f(2.0 ** 14, "model.dtype=float16: the dynamic loss scale at the start "
                        "(megatron's initial_loss_scale; megatron's own 2^32 overflowed and "
                        "skipped the first 16 steps of a run)",
                        **_rng(1, 2.0 ** 64, why="float32 gradients times the scale overflow "
                               "long before"))
    min: float = _f(1.0, "the scale never falls below this; a run whose scale reaches it "
                    "stops (megatron's min_loss_scale)",
                    **_rng(0, 2.0 ** 64, lo_open=True, why="at most trainer.loss_scale.initial's "
                           "top"))
    growth_interval: int = _f(1000, "optimizer steps without an overflow before the scale "
                              "doubles (megatron's loss_scale_window)", **_rng(1))
    hysteresis: int = _f(2, "overflowing steps tolerated before the scale halves (megatron's "
                         "hysteresis)", **_rng(1))


@dataclass
class EMAConfig:
    decay: float | None = _f(None, "Polyak average of the weights, updated after every "
                             "optimizer step and exported as final_hf (rollouts keep the raw "
                             "weights unless trainer.ema.policy; null = off)",
                             **_rng(0, 1, lo_open=True, hi_open=True))
    policy: bool = _f(False, "EMA policy smoothing: after every optimizer step the weights are "
                      "replaced by their EMA, which the engines serve and the next step starts "
                      "from (needs trainer.ema.decay)")
    start_step: int = _f(0, "RL step from which the EMA averages; before it the EMA (and with "
                         "trainer.ema.policy the policy) follows the raw weights", **_rng(0))


@dataclass
class WarmupConfig:
    steps: int = _f(0, "supervised warm-start steps before RL", **_rng(0))
    lr: float = _f(1e-3, "learning rate of the supervised warm-start", **_rng(0, lo_open=True))


@dataclass
class OptimConfig:
    lr: float = _f(1e-5, "peak learning rate", **_rng(0, lo_open=True))
    min_lr: float = _f(0.0, "final learning rate of the schedule", **_rng(0))
    warmup_steps: int = _f(0, "linear learning-rate warm-up steps", **_rng(0))
    schedule: Literal["constant", "linear", "cosine"] = _f("constant", "decay after warm-up")
    weight_decay: float = _f(0.0, "AdamW weight decay", **_rng(0))
    adam_beta1: float = _f(0.9, "Adam beta1", **_rng(0, 1, hi_open=True))
    adam_beta2: float = _f(0.999, "Adam beta2", **_rng(0, 1, hi_open=True))
    grad_clip: float = _f(1.0, "gradient-norm clip (0 = off)", **_rng(0))
    distributed: bool = _f(True, "megatron's distributed optimizer where available")


@dataclass
class ParallelConfig:
    tensor: int = _f(1, "tensor-parallel size", **_rng(1, 4096, why="ranks of one parallel group"))
    pipeline: int = _f(1, "pipeline-parallel size",
                       **_rng(1, 4096, why="ranks of one parallel group"))
    expert: int = _f(1, "expert-parallel size", **_rng(1, 4096, why="ranks of one parallel group"))
    context: int = _f(1, "context-parallel size: every sequence cut in 2 x CP chunks, rank r "
                      "holding chunks r and 2CP-1-r (needs Transformer Engine's attention, GPU)",
                      **_rng(1, 4096, why="ranks of one parallel group"))
    sequence: bool = _f(False, "sequence parallelism (needs trainer.parallel.tensor > 1)")


@dataclass
class CheckpointConfig:
    interval: int = _f(50, "checkpoint every n steps (0 = by time and at the end only)",
                       **_rng(0))
    interval_minutes: float = _f(30.0, "also checkpoint when this many minutes passed since the "
                                 "last checkpoint (whichever of steps or minutes comes first; 0 "
                                 "= by steps only)", **_rng(0))
    stop_grace_s: float = _f(120.0, "on SIGINT / SIGTERM / SIGUSR1, seconds the current step and "
                             "its checkpoint may still take; past them the step is abandoned",
                             **_rng(0, lo_open=True))
    dir: str | None = _f(None, "checkpoint folder (null = <logging.dir>/checkpoints)")
    keep: int = _f(2, "saved steps kept (iter_NNNNNNN/ folders; older ones are removed once a "
                   "newer one is complete)", **_rng(1, 10000, why="checkpoints kept on disk"))
    export_hf: bool = _f(True, "export the final policy as a Hugging Face model")
    export_hf_interval: int = _f(0, "also export the policy as a Hugging Face model every n "
                                 "steps, to <logging.dir>/hf/iter_NNNNNNN (0 = never)", **_rng(0))


@dataclass
class TrainerConfig:
    steps: int = _f(20, "RL steps", **_rng(1))
    seed: int = _f(1234, "global seed", **_rng(0, 2 ** 32 - 1))
    epochs: int = _f(1, "passes over each rollout batch",
        **_rng(1, 1000, why="passes over one rollout batch"))
    mini_batches: int = _f(1, "optimizer steps per epoch (the batch is split in this many)",
                           **_rng(1, 1048576, why="optimizer steps per epoch"))
    micro_batch_size: int | None = _f(8, "most sequences per micro-batch (gradient "
                                      "accumulation; null = no row cap, with "
                                      "max_tokens_per_micro_batch)", **_rng(1))
    max_tokens_per_micro_batch: int | None = _f(
        None, "token budget of a micro-batch: rows x its longest row (the padded tokens it "
        "forwards), filled longest first; a longer sample forwards alone (null = by rows only)",
        **_rng(1))
    pack_sequences: bool = _f(False, "pack several samples into one row of at most "
                              "max_tokens_per_micro_batch tokens (first-fit decreasing), "
                              "attention causal within each sample only (THD with cu_seqlens: "
                              "Transformer Engine on GPU, slot by slot on CPU)")
    optim: OptimConfig = _sub(OptimConfig, "the optimizer (Adam) and its learning-rate schedule")
    parallel: ParallelConfig = _sub(ParallelConfig, "how the trainer's ranks split the model")
    recompute_activations: bool = _f(False, "full activation recomputation (replay in backward)")
    experts: Literal["auto", "te_grouped", "grouped", "sequential"] = _f(
        "auto", "the MoE experts' computation: te_grouped (Transformer Engine's grouped GEMM, "
        "megatron's TEGroupedMLP, with its fused permutation; needs TE and CUDA), grouped (two "
        "grouped GEMMs over the local experts, torch._grouped_mm), sequential (megatron's loop "
        "over them), auto (te_grouped where TE and CUDA are, else grouped wherever torch has it "
        "and the sizes fit its 16-byte rows)")
    loss_scale: LossScaleConfig = _sub(LossScaleConfig, "float16's dynamic loss scaling "
                                       "(skipped steps: train/skipped_steps)")
    ema: EMAConfig = _sub(EMAConfig, "the Polyak average (EMA) of the weights")
    expert_bias_update_rate: float = _f(0.0, "DeepSeek-V3 routers: megatron's aux-loss-free "
                                        "expert-bias update per optimizer step, from the "
                                        "batch's tokens per expert (0 = frozen, the default)",
                                        **_rng(0))
    warmup: WarmupConfig = _sub(WarmupConfig, "the supervised warm start before RL")
    checkpoint: CheckpointConfig = _sub(CheckpointConfig, "what the run saves and when: its "
                                        "checkpoints, Hugging Face exports, the stop's grace")


@dataclass
class ClusterConfig:
    num_nodes: int = _f(1, "nodes", **_rng(1, 100000, why="nodes one Ray cluster holds"))
    gpus_per_node: int = _f(0, "GPUs per node (0 = CPU run)", **_rng(0, 64, why="GPUs of one node"))
    trainer_workers: int = _f(1, "trainer ranks (one Ray actor each)",
        **_rng(1, 1048576, why="trainer ranks, one Ray actor each"))
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
class DataSetConfig:
    """One dataset file: a training set of ``data.sets`` or a held-out set of ``eval.sets``; a
    key left null takes the value of the same ``data.*`` key."""
    path: str = _f("", "JSONL or Parquet file")
    name: str | None = _f(None, "name in metrics (null: the file name without its extension)")
    source: Literal["jsonl", "parquet"] | None = _f(None, "file format (null: by the file's "
                                                    "extension, .parquet or else jsonl)")
    prompt_key: str | None = _f(None, "column holding the prompt text (null: data.prompt_key)")
    messages_key: str | None = _f(None, "column holding chat messages (null: data.messages_key)")
    answer_key: str | None = _f(None, "column holding the answer (null: data.answer_key)")
    weight: float = _f(1.0, "data.sets: share of the training prompts drawn from this set, "
                       "relative to the others' (eval.sets: unused)", **_rng(0, lo_open=True))


def set_name(entry: DataSetConfig) -> str:
    """The name a set's metrics carry: ``name``, else the file name without its extension."""
    return entry.name or os.path.splitext(os.path.basename(entry.path))[0]


@dataclass
class RewardServiceConfig:
    """Rewards computed by an HTTP service (protocol: docs/data.md)."""
    url: str | None = _f(None, "POST endpoint of the reward service (null = data.reward, a "
                         "Python function)")
    timeout_s: float = _f(60.0, "seconds one request may take, whole (connection, upload, the "
                          "full answer), before it is retried", **_rng(0, lo_open=True))
    max_answer_mb: float = _f(16.0, "largest answer read from the service; a larger one is "
                              "refused (its samples score 0, reward/errors)",
                              **_rng(0, lo_open=True))
    max_concurrency: int = _f(8, "requests in flight at once",
        **_rng(1, 65536, why="reward requests in flight at once"))
    batch_size: int = _f(16, "samples per request (a finished group is sent in requests of "
                         "at most this many)",
        **_rng(1, 1048576, why="samples in one reward request"))
    max_retries: int = _f(3, "retries of a request on connection errors, timeouts and 5xx "
                          "answers (exponential backoff; never on 4xx)",
        **_rng(0, 100, why="retries with exponential backoff: more never end"))
    api_key_env: str | None = _f(None, "environment variable holding the service's API key, "
                                 "sent as Authorization: Bearer (null = none)")


@dataclass
class DataConfig:
    source: Literal["toy", "jsonl", "parquet"] = _f("toy", "prompt source")
    path: str | None = _f(None, "dataset file for jsonl / parquet")
    prompt_key: str = _f("prompt", "column holding the prompt text")
    answer_key: str = _f("answer", "column holding the reference answer")
    chat_template: bool = _f(True, "wrap prompts with the tokenizer's chat template")
    messages_key: str | None = _f(None, "column holding a chat list of {role, content} messages "
                                  "(system prompt included), rendered with the chat template; "
                                  "null: rows hold prompt_key text")
    system_prompt: str | None = _f(None, "system message put before every prompt_key text "
                                   "(with chat_template)")
    chat_template_kwargs: dict[str, Any] = _f({}, "extra keyword arguments of the tokenizer's "
                                              "apply_chat_template, e.g. {enable_thinking: false}")
    metadata_keys: list[str] = _f([], "row columns handed to the reward function in its "
                                  "metadata")
    sets: list[DataSetConfig] = _f([], "several training sets sampled by weight "
                                   "(replaces data.source/data.path; each entry: path, name, "
                                   "source, prompt_key, messages_key, answer_key, weight)")
    reward: str = _f("toy", "reward: toy | math | module:function (per sample, batched or "
                     "async: docs/data.md)")
    reward_service: RewardServiceConfig = _sub(RewardServiceConfig, "HTTP reward service")
    environment: str | None = _f(None, "multi-turn environment: calculator | module:Class (null "
                                 "= single-turn completions scored by data.reward; with an "
                                 "environment, the environment gives the reward)")
    max_failed_reward_batches: int = _f(1, "stop the run when the reward function failed on "
                                        "every sample of this many batches in a row",
        **_rng(1, 1048576, why="batches in a row"))
    reward_abs_max: float = _f(1e12, "a reward beyond +-this is clipped to it and counted "
                               "(reward/clipped): GRPO's group mean and std of finite rewards "
                               "then cannot overflow",
                               **_rng(0, 1e15, lo_open=True, why="the group's float32 statistics "
                                      "of larger rewards lose every digit of the advantage"))
    reward_timeout_s: float = _f(60.0, "seconds one reward call may take; past it the sample is "
                                 "dropped and counted (reward/timeouts)", **_rng(0, lo_open=True))
    environment_timeout_s: float = _f(60.0, "seconds one environment call (constructor, reset, "
                                      "step) may take; past it the trajectory is dropped and "
                                      "counted (rollout/env_timeouts)", **_rng(0, lo_open=True))
    toy_max_operand: int = _f(9, "toy task: largest operand of the additions", **_rng(1))
    toy_size: int = _f(512, "toy task: number of prompts",
        **_rng(1, 16777216, why="toy prompts made in memory"))
    shuffle_seed: int = _f(0, "seed of the deterministic shuffle", **_rng(0, 2 ** 32 - 1))


@dataclass
class EvalConfig:
    """Evaluation on held-out sets during training (and ``moe-rl eval``)."""
    sets: list[DataSetConfig] = _f([], "held-out sets (each entry: path, name, source, "
                                   "prompt_key, messages_key, answer_key)")
    interval: int = _f(0, "evaluate every n steps (0 = only at the end)", **_rng(0))
    at_start: bool = _f(False, "also evaluate before the first update")
    n: int = _f(1, "samples per prompt",
        **_rng(1, 4096, why="samples per prompt, held and scored together"))
    temperature: float | None = _f(None, "sampling temperature (0 = greedy; null = "
                                   "rollout.sampling.temperature)", **_rng(0))
    top_p: float | None = _f(None, "top-p (null = rollout.sampling.top_p)",
                             **_rng(0, 1, lo_open=True))
    max_new_tokens: int | None = _f(None, "response cap (null = rollout.max_new_tokens)",
                                    **_rng(1))
    reward: str | None = _f(None, "reward of the evaluation (null = data.reward, or "
                            "data.reward_service when it has a url)")
    success_threshold: float = _f(1.0, "a sample succeeds when its reward is at least this "
                                  "(pass@k)")
    pass_k: list[int] = _f([], "k of the unbiased pass@k estimates reported besides pass@1 "
                           "(each k <= eval.n; empty: k = eval.n when n > 1)")
    max_prompts: int | None = _f(None, "evaluate the first n prompts of each set (null = all)",
                                 **_rng(1))


@dataclass
class WandbConfig:
    """Weights & Biases logging (optional: ``pip install 'moe_rl[wandb]'``)."""
    enabled: bool = _f(False, "also log every scalar and the resolved config to W&B")
    project: str = _f("moe_rl", "W&B project")
    entity: str | None = _f(None, "W&B entity (team or user; null: the account's default)")
    name: str | None = _f(None, "W&B run name (null: the run directory's name)")
    mode: Literal["online", "offline", "disabled"] = _f(
        "online", "online (needs W&B credentials and network), offline (files under "
        "<logging.dir>/wandb, `wandb sync` them later), disabled")
    tags: list[str] = _f([], "W&B run tags")


@dataclass
class LoggingConfig:
    dir: str = _f("runs/default", "run directory: TensorBoard events, metrics.jsonl, checkpoints")
    tensorboard: bool = _f(True, "write TensorBoard event files")
    jsonl: bool = _f(True, "write metrics.jsonl")
    progress: bool = _f(True, "per-step progress on the console: a bar on a terminal, else one "
                        "line per logging.log_interval steps on stdout")
    log_interval: int = _f(1, "steps between progress lines when the console is not a terminal "
                           "(nohup, Slurm, a pipe); the last step is always shown", **_rng(1))
    samples_per_step: int = _f(2, "samples of each step written to <logging.dir>/samples.jsonl "
                               "and TensorBoard text: prompt, response, reward and its inputs, "
                               "advantage, the tokens where engine and trainer differ most "
                               "(0: none)",
        **_rng(0, 1024, why="samples a step writes to samples.jsonl and TensorBoard"))
    samples_max_mb: float = _f(64.0, "size at which samples.jsonl, and separately the sample "
                               "text TensorBoard gets, stop growing (each said once on the "
                               "console)", **_rng(0.001))
    wandb: WandbConfig = _sub(WandbConfig, "Weights & Biases")


@dataclass
class Config:
    model: ModelConfig = _sub(ModelConfig, "policy model")
    rollout: RolloutConfig = _sub(RolloutConfig, "rollout engine and sampling")
    algorithm: AlgorithmConfig = _sub(AlgorithmConfig, "losses, pi_old, replay, corrections")
    trainer: TrainerConfig = _sub(TrainerConfig, "optimisation and parallelism")
    cluster: ClusterConfig = _sub(ClusterConfig, "devices and Ray")
    data: DataConfig = _sub(DataConfig, "prompts and rewards")
    eval: EvalConfig = _sub(EvalConfig, "held-out evaluation")
    logging: LoggingConfig = _sub(LoggingConfig, "outputs")
