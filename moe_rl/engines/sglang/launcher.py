"""The SGLang server's command line and environment, as moe_rl launches it (the placement plan
puts them on a node and its GPUs; :class:`moe_rl.engines.process.CommandServer` runs
them)."""
from __future__ import annotations

import sys

from moe_rl.safe_path import SAFE_PATH_ENV
from moe_rl.config import Config
from moe_rl.engines.needs import requests_routing, requests_sampling_mask

CPU_MAX_TOTAL_TOKENS = 65536   # the KV pool on CPU unless rollout.sglang.max_total_tokens says
# SGLang 0.5.23 captures the routed experts in select_experts (layers/moe/topk.py); these MoE
# runners route inside their own kernel and never reach it, so every routing row comes back
# zeros: triton_kernel (chosen by SGLang itself for gpt-oss at ep_size 1, unquantised, on every
# NVIDIA GPU), the FlashInfer TRT-LLM runners (Blackwell), FlashInfer's MXFP4 one
ROUTING_BLIND_RUNNERS = ("triton_kernel", "flashinfer_trtllm", "experimental_sgl_trtllm",
                         "flashinfer_mxfp4")
# the runner moe_rl pins on GPUs when the run needs the engine's routing: SGLang's fused Triton
# MoE, routed by select_experts for every family (SGLang's own fallback for gpt-oss on Blackwell)
ROUTING_RUNNER = "triton"


def sglang_argv(cfg: Config, model_path: str, host: str, port: int) -> list[str]:
    """``python -m sglang.launch_server ...`` for one server on ``host:port`` (its GPUs are the
    visible ones from 0: ``--base-gpu-id 0``, see :func:`sglang_env`)."""
    r = cfg.rollout
    g = r.sglang
    argv = [g.python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", model_path, "--host", host, "--port", str(port),
            "--tp-size", str(g.tp_size), "--dp-size", str(g.dp_size), "--ep-size", str(g.ep_size),
            "--mem-fraction-static", str(g.mem_fraction_static), "--dtype", r.engine_dtype]
    if g.device == "cpu":
        argv += ["--device", "cpu",
                 "--max-total-tokens", str(g.max_total_tokens or CPU_MAX_TOTAL_TOKENS)]
    else:
        argv += ["--base-gpu-id", "0"]
        if g.max_total_tokens:
            argv += ["--max-total-tokens", str(g.max_total_tokens)]
    if requests_routing(cfg.algorithm, cfg.rollout):
        argv.append("--enable-return-routed-experts")
        if g.device == "cuda" and "--moe-runner-backend" not in g.extra_args:
            argv += ["--moe-runner-backend", ROUTING_RUNNER]
    if requests_sampling_mask(cfg.algorithm):
        argv += ["--sampling-mask-max-tokens", str(r.sampling.mask_max_tokens)]
    if cfg.cluster.colocate:
        argv.append("--enable-memory-saver")
    if g.deterministic_inference:
        argv.append("--enable-deterministic-inference")
    if cfg.model.fp32_output_layer:   # the head's precision as the trainer's
        argv.append("--enable-fp32-lm-head")
    if r.servers.api_key:
        argv += ["--api-key", r.servers.api_key]
    return argv + list(g.extra_args)


def sglang_env(gpus: list[int], device: str = "cuda") -> dict[str, str]:
    """The environment moe_rl sets for an SGLang server: its GPUs (``CUDA_VISIBLE_DEVICES``),
    or on CPU ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU engine; it also activates the import-time
    shims of ``moe-rl sglang-cpu-env``), and output log-probs at the sampling temperature,
    ``log_softmax(logits / T)`` (the trainer's distribution, SGLang's default;
    ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` would make them raw, so it is pinned off even when the
    caller's environment sets it). ``PYTHONSAFEPATH=1`` keeps the working directory off the
    server's ``sys.path`` (:mod:`moe_rl.safe_path`): no folder where it starts can stand
    in for a package SGLang imports."""
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false", **SAFE_PATH_ENV}
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    elif gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return env
