"""The SGLang server's command line and environment, as moe_rl launches it (the placement plan
puts them on a node and its GPUs; :class:`moe_rl.engines.process.CommandServer` runs
them)."""
from __future__ import annotations

import sys

from moe_rl.config import Config
from moe_rl.engines.needs import requests_routing, requests_sampling_mask


def sglang_argv(cfg: Config, model_path: str, host: str, port: int) -> list[str]:
    """``python -m sglang.launch_server ...`` for one server on ``host:port`` (its GPUs are the
    visible ones from 0: ``--base-gpu-id 0``, see :func:`sglang_env`)."""
    r = cfg.rollout
    g = r.sglang
    argv = [g.python or sys.executable, "-m", "sglang.launch_server",
            "--model-path", model_path, "--host", host, "--port", str(port),
            "--tp-size", str(g.tp_size), "--dp-size", str(g.dp_size), "--ep-size", str(g.ep_size),
            "--base-gpu-id", "0", "--mem-fraction-static", str(g.mem_fraction_static)]
    if requests_routing(cfg):
        argv.append("--enable-return-routed-experts")
    if requests_sampling_mask(cfg):
        argv += ["--sampling-mask-max-tokens", str(r.sampling_mask_max_tokens)]
    if cfg.cluster.colocate:
        argv.append("--enable-memory-saver")
    if g.deterministic_inference:
        argv.append("--enable-deterministic-inference")
    if r.api_key:
        argv += ["--api-key", r.api_key]
    return argv + list(g.extra_args)


def sglang_env(gpus: list[int]) -> dict[str, str]:
    """The environment moe_rl sets for an SGLang server: its GPUs (``CUDA_VISIBLE_DEVICES``),
    and output log-probs at the sampling temperature, ``log_softmax(logits / T)`` (the
    trainer's distribution, SGLang's default; ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` would make
    them raw, so it is pinned off even when the caller's environment sets it)."""
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return env


def sglang_command(cfg: Config, port: int, model_path: str | None = None,
                   host: str | None = None, gpus: list[int] = ()) -> tuple[list[str], dict]:
    """(argv, environment moe_rl sets) of one SGLang server."""
    return (sglang_argv(cfg, model_path or cfg.model.path, host or cfg.rollout.host, port),
            sglang_env(list(gpus)))
