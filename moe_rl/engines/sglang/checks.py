"""What SGLang refuses, checked when the configuration is loaded (right after the general
checks): a GPU server without GPUs, what needs CUDA on CPU, weight updates from a group or
tensors at dp_size > 1, min_p under deterministic inference, an fp32 LM head on the engine only,
block-wise FP8 at TP/EP sizes that cut a block, a MoE runner that captures no routing where the
run needs it."""
from __future__ import annotations

from moe_rl.config import Config, ConfigError
from moe_rl.config.schema import (AlgorithmConfig, ClusterConfig, ModelConfig,
                                  RolloutConfig)
from moe_rl.engines.needs import requests_routing
from moe_rl.engines.sglang.launcher import ROUTING_BLIND_RUNNERS, ROUTING_RUNNER
from moe_rl.config.model_facts import model_hf_fields
from moe_rl.families import FAMILIES
from moe_rl.engines.sglang.fp8_shapes import fp8_shape_errors


def check_gpus(cfg: Config) -> None:
    """SGLang on GPUs needs them; on CPU (``rollout.sglang.device: cpu``) what needs CUDA is
    refused: FP8 kernels, deterministic inference (no CPU attention backend supports it), the
    memory saver of colocated runs (tensor updates need GPUs: the general checks refuse them),
    MLA models (SGLang's CPU rotary embedding and attention for MLA), attention sinks
    (gpt-oss), a q/k norm over all heads (MiniMax-M2)."""
    r, c = cfg.rollout, cfg.cluster
    if r.sglang.device == "cuda":
        if c.gpus_per_node == 0:
            raise ConfigError("rollout.engine: SGLang on GPUs needs cluster.gpus_per_node > 0; "
                              "on a machine without GPUs set rollout.sglang.device=cpu (an "
                              "environment from `moe-rl sglang-cpu-env`) or "
                              "rollout.engine=reference")
        return
    refused = {"rollout.quantization": (r.quantization == "fp8", "fp8 (SGLang's FP8 kernels "
                                        "need GPUs); use none"),
               "rollout.sglang.deterministic_inference": (
                   r.sglang.deterministic_inference, "true (SGLang refuses every CPU attention "
                   "backend in deterministic mode); set it false"),
               "cluster.colocate": (c.colocate, "true (SGLang's memory saver needs CUDA); "
                                    "set it false")}
    for key, (bad, why) in refused.items():
        if bad:
            raise ConfigError(f"{key}: SGLang on CPU (rollout.sglang.device=cpu) cannot run "
                              f"with {why}")
    hf = model_hf_fields(cfg.model)
    fam = FAMILIES.get(hf.get("model_type"))
    if fam is not None and fam.ATTENTION_SINKS:
        # SGLang 0.5.23's gpt_oss.py hands its learned sinks to the attention backend, which
        # passes them on as a keyword the torch-native backend does not take: "TypeError:
        # TorchNativeAttnBackend.forward_extend() got an unexpected keyword argument 'sinks'"
        # at the first prefill, measured on the tiny gpt-oss
        raise ConfigError(f"model.path: SGLang on CPU (rollout.sglang.device=cpu) cannot serve "
                          f"models with attention sinks ({hf.get('model_type')}): its "
                          f"torch-native attention backend takes no sinks (TypeError at the "
                          f"first prefill); use rollout.engine=reference")
    if fam is not None and fam.QK_NORM_ACROSS_HEADS:
        # SGLang 0.5.23's minimax_m2.py normalises q and k over all heads with Triton kernels
        # that assert CUDA tensors ("assert x1.is_cuda and x2.is_cuda", rms_sumsq_serial) at
        # the first forward, measured on the tiny MiniMax-M2
        raise ConfigError(f"model.path: SGLang on CPU (rollout.sglang.device=cpu) cannot serve "
                          f"models whose q/k norm spans all heads ({hf.get('model_type')}): its "
                          f"kernel for that norm asserts CUDA tensors at the first forward; use "
                          f"rollout.engine=reference")
    if fam is not None and fam.MULTI_LATENT_ATTENTION:
        # SGLang 0.5.23 on CPU: without rope scaling its rotary embedding asserts deepseek_yarn
        # (layers/rotary_embedding/factory.py); with YaRN (which its DeepSeek attention turns
        # into deepseek_yarn) the torch-native attention fails on MLA's first prefill
        # ("Expected size for first two dimensions of batch2 tensor to be: [4, 24] but got:
        # [4, 40]", attention/torch_native_backend.py), measured on the tiny DeepSeek-V3
        raise ConfigError(f"model.path: SGLang on CPU (rollout.sglang.device=cpu) cannot serve "
                          f"MLA models ({hf.get('model_type')}): its CPU rotary embedding "
                          f"asserts deepseek_yarn scaling and, with YaRN, its torch-native "
                          f"attention fails on MLA's prefill; use rollout.engine=reference")


def check_weight_updates(cluster: ClusterConfig, rollout: RolloutConfig) -> None:
    """SGLang asserts dp_size 1 for updates from a process group or from tensors."""
    r = rollout
    if cluster.weight_sync in ("distributed", "tensor") and r.sglang.dp_size > 1:
        raise ConfigError(f"rollout.sglang.dp_size: SGLang updates weights from a process group "
                          f"or from tensors only with dp_size 1 (it asserts so); got "
                          f"{r.sglang.dp_size} with cluster.weight_sync={cluster.weight_sync}"
                          f"; use more servers (rollout.num_servers) or weight_sync=disk")


def check_lm_head(rollout: RolloutConfig, model: ModelConfig) -> None:
    """An fp32 LM head on the engine only is refused: each side's head then rounds to another
    grid, a larger gap than bf16 on both (NeMo-RL's finding); ``model.fp32_output_layer`` sets
    it on both."""
    one_sided = "--enable-fp32-lm-head" in rollout.sglang.extra_args
    if one_sided and not model.fp32_output_layer:
        raise ConfigError("rollout.sglang.extra_args: --enable-fp32-lm-head puts the engine's "
                          "LM head in float32 while the trainer's stays in model.dtype (a head "
                          "precision on one side only widens the mismatch); set "
                          "model.fp32_output_layer=true, which sets it on both sides")


def check_sampling(rollout: RolloutConfig) -> None:
    """min_p is not supported by SGLang's deterministic inference."""
    r = rollout
    if r.sglang.deterministic_inference and r.sampling.min_p > 0:
        raise ConfigError("rollout.sampling.min_p: SGLang's deterministic inference does not "
                          "support min_p sampling; set rollout.sampling.min_p=0 or turn "
                          "deterministic_inference off")


def check_fp8(rollout: RolloutConfig, model: ModelConfig) -> None:
    """Block-wise FP8 needs every TP/EP shard of a quantised weight to hold whole blocks."""
    r = rollout
    if r.quantization != "fp8":
        return
    errors = fp8_shape_errors(model_hf_fields(model), r.sglang.tp_size, r.sglang.ep_size)
    if errors:
        raise ConfigError(f"rollout.quantization: SGLang refuses block-wise FP8 for this model "
                          f"at rollout.sglang.tp_size={r.sglang.tp_size}, ep_size="
                          f"{r.sglang.ep_size}: {'; '.join(errors)}. Change the TP/EP sizes "
                          f"(a larger ep_size keeps experts whole) or set "
                          f"rollout.quantization=none")


def check_mxfp4(rollout: RolloutConfig) -> None:
    """MXFP4 rollouts are the reference engine's emulation (SGLang serves MXFP4 only from
    checkpoints quantised that way, such as gpt-oss's, not by quantising at load)."""
    if rollout.quantization == "mxfp4":
        raise ConfigError("rollout.quantization: mxfp4 is emulated by the reference engine "
                          "(rollout.engine=reference); with SGLang use fp8 or none")


def check_tensor_sync_ranks(cfg: Config) -> None:
    """Colocated tensor sync without trainer model parallelism: one trainer rank per SGLang TP
    rank (each builds the payload of the rank sharing its GPU)."""
    c, r, t = cfg.cluster, cfg.rollout, cfg.trainer
    if (c.weight_sync == "tensor" and
            t.parallel.tensor * t.parallel.context * t.parallel.expert == 1 and
            c.trainer_workers != r.num_servers * r.sglang.tp_size):
        raise ConfigError(f"cluster.trainer_workers: colocated tensor sync builds each SGLang TP "
                          f"rank's payload on the trainer rank sharing its GPU, so it needs "
                          f"trainer_workers == rollout.num_servers * rollout.sglang.tp_size "
                          f"({r.num_servers * r.sglang.tp_size}); got {c.trainer_workers}")


def check_moe_runner(algorithm: AlgorithmConfig, rollout: RolloutConfig) -> None:
    """A MoE runner of ``rollout.sglang.extra_args`` that routes inside its kernel, where the
    run needs the engine's routing (it would come back all zeros)."""
    args = list(rollout.sglang.extra_args)
    if not requests_routing(algorithm, rollout) or "--moe-runner-backend" not in args:
        return
    at = args.index("--moe-runner-backend")
    runner = args[at + 1] if at + 1 < len(args) else ""
    if runner in ROUTING_BLIND_RUNNERS:
        raise ConfigError(f"rollout.sglang.extra_args: --moe-runner-backend {runner} routes "
                          f"inside its kernel, where SGLang captures no routed experts, and this "
                          f"run needs them (algorithm.replay / rollout.return_routing); leave the "
                          f"runner to moe_rl ({ROUTING_RUNNER}) or name one that routes in "
                          f"select_experts (triton, deep_gemm, cutlass, flashinfer_cutlass)")


def check_config(cfg: Config) -> None:
    """Every SGLang refusal, in this order."""
    check_moe_runner(cfg.algorithm, cfg.rollout)
    check_gpus(cfg)
    check_weight_updates(cfg.cluster, cfg.rollout)
    check_tensor_sync_ranks(cfg)
    check_sampling(cfg.rollout)
    check_lm_head(cfg.rollout, cfg.model)
    check_fp8(cfg.rollout, cfg.model)
    check_mxfp4(cfg.rollout)
