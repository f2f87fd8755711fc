"""The configured engine kind, by ``rollout.engine``: an :class:`~moe_rl.engines.base.EngineKind`
for the configuration (what a server takes, its command and process, its engine, receiver and
sender). A new engine is a package with its kind and one line here."""
from __future__ import annotations

from moe_rl.config import Config
from moe_rl.engines.base import EngineKind
from moe_rl.engines.reference.kind import ReferenceKind
from moe_rl.engines.sglang.kind import SGLangKind

KINDS: dict[str, type[EngineKind]] = {"reference": ReferenceKind, "sglang": SGLangKind}


def engine_kind(cfg: Config) -> EngineKind:
    """The engine kind of ``rollout.engine`` under ``cfg``."""
    return KINDS[cfg.rollout.engine](cfg)
