"""What the reference engine refuses, checked when the configuration is loaded."""
from __future__ import annotations

from moe_rl.config import Config, ConfigError


def check_config(cfg: Config) -> None:
    """It cannot take CUDA tensors (weight_sync tensor)."""
    if cfg.cluster.weight_sync == "tensor":
        raise ConfigError("cluster.weight_sync: 'tensor' hands CUDA tensors to SGLang on the "
                          "same GPUs: it needs cluster.colocate=true, rollout.engine=sglang "
                          "and GPUs; use 'distributed' or 'disk' otherwise")
