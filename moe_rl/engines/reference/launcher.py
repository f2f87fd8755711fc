"""The reference engine's server process: its command line (``moe-rl serve-reference``), its
environment, and :class:`ReferenceServer`, which starts one on a socket it binds and hands over."""
from __future__ import annotations

import os
import sys

from moe_rl.safe_path import SAFE_PATH_ENV
from moe_rl.engines.process import ServerProcess

# unbuffered output (its log is read while it runs); the working directory off its sys.path
REFERENCE_ENV = {"PYTHONUNBUFFERED": "1", **SAFE_PATH_ENV}


def reference_argv(model: str, host: str, port: int, *, dtype: str = "float32", seed: int = 0,
                   api_key: str | None = None, return_routed_experts: bool = True,
                   sampling_mask_max_tokens: int = 4096, deterministic_inference: bool = False,
                   quantization: str = "none", max_total_tokens: int | None = None,
                   fp32_lm_head: bool = False) -> list[str]:
    """``moe-rl serve-reference ...`` for one server (``--fd`` is added when it starts on a
    socket its parent bound)."""
    cmd = [sys.executable, "-m", "moe_rl.cli", "serve-reference", "--model", model,
           "--host", host, "--port", str(port), "--dtype", dtype, "--seed", str(seed)]
    if api_key:
        cmd += ["--api-key", api_key]
    if return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    cmd += ["--sampling-mask-max-tokens", str(sampling_mask_max_tokens)]
    if deterministic_inference:
        cmd.append("--enable-deterministic-inference")
    if quantization != "none":
        cmd += ["--quantization", quantization]
    if max_total_tokens is not None:
        cmd += ["--max-total-tokens", str(max_total_tokens)]
    if fp32_lm_head:
        cmd.append("--enable-fp32-lm-head")
    return cmd


class ReferenceServer(ServerProcess):
    """One ``moe-rl serve-reference`` subprocess, serving on the socket its parent bound."""

    def __init__(self, model: str, port: int, host: str = "127.0.0.1", dtype: str = "float32",
                 api_key: str | None = None, seed: int = 0, log_path: str | None = None,
                 return_routed_experts: bool = True, sampling_mask_max_tokens: int = 4096,
                 max_total_tokens: int | None = None, deterministic_inference: bool = False,
                 quantization: str = "none", extra_args: tuple[str, ...] = ()):
        super().__init__(port, host=host, api_key=api_key, log_path=log_path)
        self.model, self.dtype, self.seed = model, dtype, seed
        self.return_routed_experts = return_routed_experts
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        self.max_total_tokens = max_total_tokens
        self.deterministic_inference = deterministic_inference
        self.quantization = quantization
        self.extra_args = list(extra_args)   # further serve-reference flags (limits, timeouts)

    def command(self, fd: int | None = None) -> tuple[list[str], dict]:
        cmd = reference_argv(self.model, self.host, self.port, dtype=self.dtype, seed=self.seed,
                             api_key=self.api_key,
                             return_routed_experts=self.return_routed_experts,
                             sampling_mask_max_tokens=self.sampling_mask_max_tokens,
                             deterministic_inference=self.deterministic_inference,
                             quantization=self.quantization,
                             max_total_tokens=self.max_total_tokens) + self.extra_args
        if fd is not None:
            cmd += ["--fd", str(fd)]
        return cmd, dict(os.environ, **REFERENCE_ENV)
