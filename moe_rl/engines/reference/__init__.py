"""The CPU reference engine: a transformers MoE model with SGLang's semantics (:mod:`.engine`),
its SGLang-protocol HTTP server (:mod:`.server`), prefix cache, split-KV attention, FP8
emulation, and its server process (:mod:`.launcher`). The loop talks to it with the SGLang
client, as to SGLang."""
from __future__ import annotations

from moe_rl.config import Config, ConfigError
from moe_rl.engines.needs import requests_routing
from moe_rl.engines.reference.launcher import REFERENCE_ENV, reference_argv

INHERITS_SOCKET = True   # serves on the socket its parent bound (--fd)


def gpus_per_server(cfg: Config) -> int:
    """The reference engine runs on CPU."""
    return 0


def weight_ranks_per_server(cfg: Config) -> int:
    """One weight-update group rank per server."""
    return 1


def server_command(cfg: Config, host: str, port: int, gpus: list[int], index: int,
                   model_path: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment moe_rl sets) of server ``index`` (seeded ``trainer.seed + index``)."""
    r = cfg.rollout
    return (reference_argv(model_path, host, port, dtype=r.engine_dtype,
                          seed=cfg.trainer.seed + index, api_key=r.api_key,
                          return_routed_experts=requests_routing(cfg),
                          sampling_mask_max_tokens=r.sampling_mask_max_tokens,
                          deterministic_inference=r.sglang.deterministic_inference,
                          # FP8 arrives as an FP8 checkpoint; MXFP4 is quantised at every load
                          quantization="mxfp4" if r.quantization == "mxfp4" else "none"),
        dict(REFERENCE_ENV))


def port_span(cfg: Config) -> int:
    """Ports one server takes from its own: just it."""
    return 1


def describe(cfg: Config) -> str:
    """The engine in words."""
    return f"{cfg.rollout.engine_dtype} reference engine"


def check_config(cfg: Config) -> None:
    """What the reference engine cannot do: take CUDA tensors (weight_sync tensor)."""
    if cfg.cluster.weight_sync == "tensor":
        raise ConfigError("cluster.weight_sync: 'tensor' hands CUDA tensors to SGLang on the same "
                          "GPUs: it needs cluster.colocate=true, rollout.engine=sglang and GPUs; "
                          "use 'distributed' or 'disk' otherwise")


__all__ = ["INHERITS_SOCKET", "check_config", "describe", "gpus_per_server", "port_span", "server_command",
           "weight_ranks_per_server"]
