"""Which computation an MoE layer's experts take (``trainer.experts``): Transformer Engine's
grouped experts (megatron-core's ``TEGroupedMLP``, where TE and CUDA are present), two grouped
GEMMs of torch over all local experts (:mod:`moe_rl.trainer.grouped_experts`) or megatron-core's
loop over them (``SequentialMLP``). Decided from sizes and whether the trainer's machine has TE,
so ``moe-rl plan`` and the run's start say it without building the model."""
from __future__ import annotations

import torch

from moe_rl.config.checks import expert_sizes, grouped_misaligned

EXPERT_PATHS = ("auto", "te_grouped", "grouped", "sequential")
TE_GROUPED_WHY = "Transformer Engine's grouped GEMM (megatron-core's TEGroupedMLP)"
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


def choose_expert_path(requested: str, hidden: int, expert_width: int, dtype: torch.dtype,
                       te: bool = False) -> tuple[str, str]:
    """(``te_grouped``, ``grouped`` or ``sequential``, why) for ``trainer.experts`` =
    ``requested`` on a machine with (``te``) or without Transformer Engine and CUDA: ``auto``
    takes TE's grouped experts where they are, else torch's grouped GEMM wherever it can run;
    ``te_grouped`` and ``grouped`` refuse where they cannot."""
    if requested not in EXPERT_PATHS:
        raise ValueError(f"trainer.experts: expected one of {EXPERT_PATHS}, got {requested!r}")
    if requested == "sequential":
        return "sequential", "trainer.experts=sequential: megatron's loop over the experts"
    if requested in ("auto", "te_grouped") and te:
        return "te_grouped", TE_GROUPED_WHY
    if requested == "te_grouped":
        raise ValueError("trainer.experts: te_grouped needs Transformer Engine and a CUDA GPU on "
                         "the trainer's machine; use auto or grouped (torch's grouped GEMM)")
    why = grouped_unsupported(hidden, expert_width, dtype)
    if why is None:
        return "grouped", "torch._grouped_mm over the local experts"
    if requested == "grouped":
        raise ValueError(f"trainer.experts: grouped cannot run here: {why}; use auto or "
                         f"sequential")
    return "sequential", f"megatron's loop over the experts ({why})"


def model_expert_path(requested: str, hf: dict, tensor_parallel: int, dtype: torch.dtype,
                      te: bool = False) -> tuple[str, str]:
    """:func:`choose_expert_path` for the model of config.json ``hf``."""
    return choose_expert_path(requested, *expert_sizes(hf, tensor_parallel), dtype, te)
