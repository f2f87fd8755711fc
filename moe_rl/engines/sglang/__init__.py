"""SGLang servers, on GPUs or on CPU (from `moe-rl sglang-cpu-env`'s environment): their launch
command (:mod:`.launcher`), the HTTP client (:mod:`.client`, :mod:`.pool`, :mod:`.decode`), the
weight-update dialect (:mod:`.weights`), the CPU environment and its shims
(:mod:`.cpu_environment`, :mod:`.cpu_shims`) and what SGLang refuses (:mod:`.checks`)."""
from __future__ import annotations

from moe_rl.config import Config
from moe_rl.engines.sglang.checks import check_config
from moe_rl.engines.sglang.launcher import sglang_argv, sglang_env

INHERITS_SOCKET = False   # SGLang binds its port itself


def gpus_per_server(cfg: Config) -> int:
    """GPUs one server uses: tp_size x dp_size (tp_size with DP attention); none on CPU."""
    g = cfg.rollout.sglang
    if g.device == "cpu":
        return 0
    dp = 1 if "--enable-dp-attention" in g.extra_args else g.dp_size
    return g.tp_size * dp


# SGLang 0.5.23 under --enable-dp-attention on one node also binds port+233 (its ZMQ_TCP_PORT_DELTA)
# and port+234..port+239 (server_args.py:728,818-846)
DP_ATTENTION_PORT_SPAN = 233 + 7


def port_span(cfg: Config) -> int:
    """Ports one server takes from its own: 1, or with ``--enable-dp-attention`` the
    :data:`DP_ATTENTION_PORT_SPAN` that SGLang derives from it (servers on one node are spaced
    by this, or the second cannot bind)."""
    return (DP_ATTENTION_PORT_SPAN if "--enable-dp-attention" in cfg.rollout.sglang.extra_args
        else 1)


def describe(cfg: Config) -> str:
    """The engine in words (on CPU with the dtype moe_rl sets; on GPUs the checkpoint's)."""
    g = cfg.rollout.sglang
    return f"{cfg.rollout.engine_dtype} SGLang on cpu" if g.device == "cpu" else "SGLang on GPUs"


def weight_ranks_per_server(cfg: Config) -> int:
    """Weight-update group ranks of one server: one per TP rank."""
    return cfg.rollout.sglang.tp_size


def server_command(cfg: Config, host: str, port: int, gpus: list[int], index: int,
                   model_path: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment moe_rl sets) of server ``index``."""
    return sglang_argv(cfg, model_path, host, port), sglang_env(gpus, cfg.rollout.sglang.device)


__all__ = ["INHERITS_SOCKET", "check_config", "describe", "gpus_per_server", "port_span", "server_command",
           "weight_ranks_per_server"]
