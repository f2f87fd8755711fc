"""Which computation an MoE layer's experts take (``trainer.experts``): megatron-core's loop over
them (``SequentialMLP``) or two grouped GEMMs over all local experts
(:mod:`moe_rl.trainer.grouped_experts`). Decided from sizes alone, so ``moe-rl plan`` and the
run's start say it without building the model."""
from __future__ import annotations

import torch

from moe_rl.config.checks import expert_sizes, grouped_misaligned

EXPERT_PATHS = ("auto", "grouped", "sequential")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def grouped_gemm_available() -> bool:
    """Whether this torch has the grouped GEMM (``torch._grouped_mm``, torch >= 2.9)."""
    return hasattr(torch, "_grouped_mm")


def grouped_unsupported(hidden: int, expert_width: int, dtype: torch.dtype) -> str | None:
    """Why experts of ``hidden`` x ``expert_width`` (this rank's share of the width) cannot run
    grouped in ``dtype`` here (None: they can)."""
    if not grouped_gemm_available():
        return f"torch {torch.__version__} has no grouped GEMM (torch._grouped_mm, torch >= 2.9)"
    return grouped_misaligned(hidden, expert_width, DTYPE_NAMES[dtype])


def choose_expert_path(requested: str, hidden: int, expert_width: int, dtype: torch.dtype
                       ) -> tuple[str, str]:
    """(``grouped`` or ``sequential``, why) for ``trainer.experts`` = ``requested``: ``auto``
    takes the grouped GEMM wherever it can run, ``grouped`` refuses where it cannot."""
    if requested not in EXPERT_PATHS:
        raise ValueError(f"trainer.experts: expected one of {EXPERT_PATHS}, got {requested!r}")
    if requested == "sequential":
        return "sequential", "trainer.experts=sequential: megatron's loop over the experts"
    why = grouped_unsupported(hidden, expert_width, dtype)
    if why is None:
        return "grouped", "torch._grouped_mm over the local experts"
    if requested == "grouped":
        raise ValueError(f"trainer.experts: grouped cannot run here: {why}; use auto or "
                         f"sequential")
    return "sequential", f"megatron's loop over the experts ({why})"


def model_expert_path(requested: str, hf: dict, tensor_parallel: int, dtype: torch.dtype
                      ) -> tuple[str, str]:
    """:func:`choose_expert_path` for the model of config.json ``hf``."""
    return choose_expert_path(requested, *expert_sizes(hf, tensor_parallel), dtype)
