"""The CPU reference engine: a transformers MoE model with SGLang's semantics (:mod:`.engine`),
its SGLang-protocol HTTP server (:mod:`.server`), prefix cache, split-KV attention, FP8
emulation, its server process (:mod:`.launcher`) and its engine kind (:mod:`.kind`). The loop
talks to it with the SGLang client, as to SGLang."""
from __future__ import annotations

from moe_rl.engines.reference.kind import ReferenceKind as KIND

__all__ = ["KIND"]
