"""Launch SGLang servers with the flags the configuration needs, wait for health, restart."""
from __future__ import annotations

import os
import sys

from moe_rl.config import Config
from moe_rl.rollout.reference_process import ServerProcess
from moe_rl.rollout.server_needs import requests_routing, requests_sampling_mask


def sglang_command(cfg: Config, port: int, model_path: str | None = None) -> tuple[list[str],
                                                                                   dict]:
    """(argv, extra environment) of ``python -m sglang.launch_server`` for server ``port``."""
    r = cfg.rollout
    g = r.sglang
    argv = [sys.executable, "-m", "sglang.launch_server",
            "--model-path", model_path or cfg.model.path, "--host", r.host, "--port", str(port),
            "--tp-size", str(g.tp_size), "--dp-size", str(g.dp_size), "--ep-size", str(g.ep_size),
            "--mem-fraction-static", str(g.mem_fraction_static)]
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
    argv += list(g.extra_args)
    # Output log-probs must be log_softmax(logits / T), the distribution the trainer scores at the
    # sampling temperature: SGLang's default. SGLANG_RETURN_ORIGINAL_LOGPROB=1 would make them raw
    # (T = 1), so it is pinned off even when the caller's environment sets it.
    env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}
    return argv, env


class SGLangProcess(ServerProcess):
    """One SGLang server subprocess (same start / health / restart logic as the reference;
    SGLang binds its port itself)."""

    inherits_socket = False

    def __init__(self, cfg: Config, port: int, log_path: str | None = None,
                 model_path: str | None = None):
        super().__init__(model_path or cfg.model.path, port, host=cfg.rollout.host,
                         api_key=cfg.rollout.api_key, log_path=log_path)
        self.cfg = cfg

    def command(self, fd: int | None = None) -> tuple[list[str], dict]:
        argv, env = sglang_command(self.cfg, self.port, self.model)
        return argv, dict(os.environ, **env)

    def start(self, timeout: float | None = None) -> "SGLangProcess":
        """Launch SGLang and wait for /health up to rollout.health_timeout_s."""
        return super().start(timeout or self.cfg.rollout.health_timeout_s)
