"""The configured engine kind, by ``rollout.engine``: an :class:`~moe_rl.engines.base.EngineKind`
for the configuration (what a server takes, its command and process, its engine, receiver and
sender)."""
from __future__ import annotations

from moe_rl.config import Config
from moe_rl.engines import reference, sglang
from moe_rl.engines.base import EngineKind

KINDS: dict[str, type[EngineKind]] = {"reference": reference.KIND, "sglang": sglang.KIND}


def engine_kind(cfg: Config) -> EngineKind:
    """The engine kind of ``rollout.engine`` under ``cfg``."""
    return KINDS[cfg.rollout.engine](cfg)
